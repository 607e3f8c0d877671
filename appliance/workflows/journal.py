"""The workflow journal: one SQLite file in the state directory.

Why SQLite and not a workflow library: DBOS would give checkpointed steps and resume, but
brings SQLAlchemy (and Postgres habits) into a single binary, and its resume replays
recorded step outputs without ever looking at the machine. Our steps touch processes
that die with the daemon, so a recorded "done" proves nothing after a crash: recovery
must check reality (see `engine`). What we need from storage is small: durable rows,
written before and after each action, that a kill -9 cannot tear. WAL with
`synchronous=FULL` makes every commit durable when `commit` returns; `BEGIN IMMEDIATE`
takes the write lock up front so a check-then-insert (one active workflow) is atomic.

The same file holds the appliance's persisted state (partition, served model,
admission) and the pids of the workers the daemon started, so that the state a
workflow commits and the journal entry saying so are written in one transaction.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

STATUSES = ("pending", "running", "succeeded", "failed", "cancelled", "compensated")
FINISHED = ("succeeded", "failed", "cancelled", "compensated")
STEP_STATUSES = ("pending", "running", "succeeded", "skipped", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS workflows (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    exclusive TEXT NOT NULL,          -- workflows of one class run one at a time
    params TEXT NOT NULL,             -- JSON
    status TEXT NOT NULL,
    phase TEXT NOT NULL DEFAULT 'forward',   -- forward | compensating
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    recoveries INTEGER NOT NULL DEFAULT 0,   -- daemon deaths it was resumed after
    owner TEXT,                       -- the daemon instance running it
    error TEXT,
    context TEXT NOT NULL DEFAULT '{}',      -- JSON: what validation resolved
    created_at REAL NOT NULL,
    started_at REAL,
    updated_at REAL NOT NULL,
    finished_at REAL
);
CREATE TABLE IF NOT EXISTS steps (
    workflow_id TEXT NOT NULL REFERENCES workflows(id),
    seq INTEGER NOT NULL,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    intent TEXT,                      -- JSON, written before acting
    result TEXT,                      -- JSON, the observed outcome
    attempts INTEGER NOT NULL DEFAULT 0,
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY (workflow_id, seq)
);
CREATE TABLE IF NOT EXISTS state (
    key TEXT PRIMARY KEY,             -- partition | model | admission
    value TEXT NOT NULL,              -- JSON
    workflow_id TEXT,                 -- who wrote it last
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    devices TEXT NOT NULL,            -- JSON list
    daemon_pid INTEGER NOT NULL,
    started_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS workflows_status ON workflows(status);
"""


class Refused(Exception):
    """A workflow cannot be created now (another one holds its class); one line."""


class NotFound(KeyError):
    pass


@dataclass
class Step:
    seq: int
    name: str
    status: str
    intent: Any = None
    result: Any = None
    attempts: int = 0
    started_at: float | None = None
    finished_at: float | None = None

    def to_json(self) -> dict:
        return {"seq": self.seq, "name": self.name, "status": self.status,
                "attempts": self.attempts, "intent": self.intent, "result": self.result,
                "started_at": self.started_at, "finished_at": self.finished_at}


@dataclass
class Workflow:
    id: str
    kind: str
    exclusive: str
    params: dict
    status: str
    phase: str
    cancel_requested: bool
    owner: str | None
    error: str | None
    context: dict
    created_at: float
    started_at: float | None
    updated_at: float
    finished_at: float | None
    recoveries: int = 0
    steps: list[Step] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "params": self.params, "status": self.status,
                "phase": self.phase, "cancel_requested": self.cancel_requested,
                "owner": self.owner, "error": self.error, "recoveries": self.recoveries, "created_at": self.created_at,
                "started_at": self.started_at, "updated_at": self.updated_at,
                "finished_at": self.finished_at, "steps": [s.to_json() for s in self.steps]}


def _dumps(value) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)


def _loads(text):
    return None if text is None else json.loads(text)


class Journal:
    """Durable workflows and steps. One connection, used from the daemon's event loop
    thread only (each call is a short local transaction: microseconds to a few ms)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self.db = sqlite3.connect(str(self.path), isolation_level=None, timeout=10.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ---- workflows ---------------------------------------------------------
    def create(self, kind: str, exclusive: str, params: dict, steps: list[str],
               context: dict | None = None) -> Workflow:
        """Insert a pending workflow with its steps, unless one of its class is active:
        the check and the insert are one IMMEDIATE transaction, so two callers (or two
        daemons on one state dir) cannot both pass the check."""
        now = time.time()
        wid = f"wf-{time.strftime('%Y%m%d%H%M%S', time.gmtime(now))}-{secrets.token_hex(3)}"
        with self.tx() as db:
            row = db.execute("SELECT id, kind, status FROM workflows WHERE exclusive = ? AND "
                             "status IN ('pending', 'running') ORDER BY created_at LIMIT 1",
                             (exclusive,)).fetchone()
            if row:
                raise Refused(f"workflow {row[0]} ({row[1]}) is {row[2]}; one {exclusive} "
                              f"workflow runs at a time: wait for it or cancel it")
            db.execute("INSERT INTO workflows (id, kind, exclusive, params, status, context, "
                       "created_at, updated_at) VALUES (?, ?, ?, ?, 'pending', ?, ?, ?)",
                       (wid, kind, exclusive, _dumps(params), _dumps(context or {}), now, now))
            db.executemany("INSERT INTO steps (workflow_id, seq, name, status) "
                           "VALUES (?, ?, ?, 'pending')",
                           [(wid, i, name) for i, name in enumerate(steps)])
        return self.get(wid)

    def get(self, wid: str) -> Workflow:
        row = self.db.execute("SELECT id, kind, exclusive, params, status, phase, "
                              "cancel_requested, owner, error, context, created_at, started_at, "
                              "updated_at, finished_at, recoveries FROM workflows WHERE id = ?",
                              (wid,)).fetchone()
        if row is None:
            raise NotFound(wid)
        wf = Workflow(row[0], row[1], row[2], _loads(row[3]), row[4], row[5], bool(row[6]),
                      row[7], row[8], _loads(row[9]), row[10], row[11], row[12], row[13],
                      row[14])
        wf.steps = [Step(r[0], r[1], r[2], _loads(r[3]), _loads(r[4]), r[5], r[6], r[7])
                    for r in self.db.execute(
                        "SELECT seq, name, status, intent, result, attempts, started_at, "
                        "finished_at FROM steps WHERE workflow_id = ? ORDER BY seq", (wid,))]
        return wf

    def list(self, limit: int = 50, unfinished: bool = False) -> list[Workflow]:
        where = "WHERE status IN ('pending', 'running')" if unfinished else ""
        ids = [r[0] for r in self.db.execute(
            f"SELECT id FROM workflows {where} ORDER BY created_at DESC, id DESC LIMIT ?",
            (limit,))]
        return [self.get(i) for i in ids]

    def counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT status, COUNT(*) FROM workflows GROUP BY status"))

    def set_status(self, wid: str, status: str, error: str | None = None,
                   owner: str | None = None) -> None:
        assert status in STATUSES, status
        now = time.time()
        with self.tx() as db:
            db.execute("UPDATE workflows SET status = ?, updated_at = ?, "
                       "error = COALESCE(?, error), owner = COALESCE(?, owner), "
                       "started_at = COALESCE(started_at, CASE WHEN ? = 'running' THEN ? END), "
                       "finished_at = CASE WHEN ? IN ('succeeded', 'failed', 'cancelled', "
                       "'compensated') THEN ? END WHERE id = ?",
                       (status, now, error, owner, status, now, status, now, wid))

    def note_recovery(self, wid: str) -> int:
        """One more daemon death survived; returns how many so far."""
        with self.tx() as db:
            db.execute("UPDATE workflows SET recoveries = recoveries + 1, updated_at = ? "
                       "WHERE id = ?", (time.time(), wid))
            return db.execute("SELECT recoveries FROM workflows WHERE id = ?", (wid,)).fetchone()[0]

    def request_cancel(self, wid: str) -> Workflow:
        with self.tx() as db:
            row = db.execute("SELECT status FROM workflows WHERE id = ?", (wid,)).fetchone()
            if row is None:
                raise NotFound(wid)
            if row[0] in FINISHED:
                raise Refused(f"workflow {wid} is already {row[0]}")
            db.execute("UPDATE workflows SET cancel_requested = 1, updated_at = ? WHERE id = ?",
                       (time.time(), wid))
        return self.get(wid)

    def start_compensation(self, wid: str, steps: list[str], error: str | None) -> None:
        """Switch a workflow to its compensating phase: the undo steps are appended after
        the forward ones (forward steps not reached are marked skipped), in one commit."""
        now = time.time()
        with self.tx() as db:
            phase = db.execute("SELECT phase FROM workflows WHERE id = ?", (wid,)).fetchone()[0]
            if phase == "compensating":
                return
            db.execute("UPDATE steps SET status = 'skipped', finished_at = ? WHERE "
                       "workflow_id = ? AND status = 'pending'", (now, wid))
            db.execute("UPDATE steps SET status = 'failed', finished_at = ? WHERE "
                       "workflow_id = ? AND status = 'running'", (now, wid))
            base = db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM steps WHERE "
                              "workflow_id = ?", (wid,)).fetchone()[0]
            db.executemany("INSERT INTO steps (workflow_id, seq, name, status) "
                           "VALUES (?, ?, ?, 'pending')",
                           [(wid, base + i, name) for i, name in enumerate(steps)])
            db.execute("UPDATE workflows SET phase = 'compensating', error = COALESCE(?, error), "
                       "updated_at = ? WHERE id = ?", (error, now, wid))

    # ---- steps -------------------------------------------------------------
    def step_intent(self, wid: str, seq: int, intent) -> None:
        """Before acting: what the step is about to do (and one more attempt)."""
        now = time.time()
        with self.tx() as db:
            db.execute("UPDATE steps SET status = 'running', intent = ?, attempts = attempts + 1, "
                       "started_at = ?, finished_at = NULL WHERE workflow_id = ? AND seq = ?",
                       (_dumps(intent), now, wid, seq))
            db.execute("UPDATE workflows SET updated_at = ? WHERE id = ?", (now, wid))

    def step_result(self, wid: str, seq: int, status: str, result,
                    state: dict | None = None) -> None:
        """After acting: what was observed. `state` (key -> JSON value) is persisted in the
        same transaction, so "the partition is X" and "the step that made it so is done"
        can never disagree after a crash."""
        assert status in STEP_STATUSES, status
        now = time.time()
        with self.tx() as db:
            db.execute("UPDATE steps SET status = ?, result = ?, finished_at = ? WHERE "
                       "workflow_id = ? AND seq = ?", (status, _dumps(result), now, wid, seq))
            db.execute("UPDATE workflows SET updated_at = ? WHERE id = ?", (now, wid))
            for key, value in (state or {}).items():
                self._put_state(db, key, value, wid, now)

    # ---- persisted appliance state ------------------------------------------
    @staticmethod
    def _put_state(db, key: str, value, wid: str | None, now: float) -> None:
        db.execute("INSERT INTO state (key, value, workflow_id, updated_at) VALUES (?, ?, ?, ?) "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value, "
                   "workflow_id = excluded.workflow_id, updated_at = excluded.updated_at",
                   (key, _dumps(value), wid, now))

    def get_state(self, key: str):
        row = self.db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    # ---- worker processes ----------------------------------------------------
    def worker_started(self, worker: str, pid: int, devices: list[str]) -> None:
        with self.tx() as db:
            db.execute("INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?)",
                       (worker, pid, _dumps(devices), os.getpid(), time.time()))

    def worker_stopped(self, worker: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM workers WHERE worker = ?", (worker,))

    def recorded_workers(self) -> list[tuple[str, int, list[str], int]]:
        return [(r[0], r[1], json.loads(r[2]), r[3]) for r in
                self.db.execute("SELECT worker, pid, devices, daemon_pid FROM workers")]

    def forget_workers(self) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM workers")
