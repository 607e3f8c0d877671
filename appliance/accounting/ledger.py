"""The durable record of who used what: one SQLite file in the state directory.

WAL with `synchronous=FULL`: a transaction that has committed survives a kill -9 and a
power cut. Writes never happen on the request's path: `Ledger.put_*` only queues the
row, and one writer thread commits everything queued every `flush_interval_s` in one
transaction. So a kill -9 loses at most what was queued since the last commit (one
batch: the last `flush_interval_s` of finished requests and closed windows), and a
clean stop loses nothing (`stop` commits the queue before it returns).

Each batch also records in `meta` the time it was taken from the queue (`covered_until`):
every row queued before that instant is committed. That is the bound a test can check.

Tables: `requests` (one row per request, written once: when every window that could
hold one of its iterations has closed, `final = 1`), `pending` (the requests that have
finished but are not final yet, one row per batch holding that batch's provisional rows:
the durability of a finished request without a second write of its row; a batch's
`pending` row is deleted in the transaction that writes the last of its final rows, and
a restart turns what is left into `incomplete` request rows), `device_windows` (one row
per device per window), `rollups` (hour and day sums of request rows, added once an hour
has been over for 10 minutes; kept longer than the raw rows).
"""
from __future__ import annotations

import functools
import logging
import marshal
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("applianced.ledger")

SCHEMA_VERSION = 1

class RequestRow(NamedTuple):
    """One request's row in `requests`, in column order: the schema, and what readers get
    (`unpack_rows`, recovery). A NamedTuple, not a dataclass: the writer flattens
    thousands of rows into multi-row INSERTs. The accountant builds its rows as plain
    tuples in this order and reads them by `COL.<field>`: making each a RequestRow
    costs ~3 µs of CPU per request on the accounting process's path (measured: 21 vs
    24 µs per request), which is its whole budget for a feature."""

    request_id: str
    tenant: str
    model: str
    site: str
    appliance: str
    endpoint: str
    status: str
    finish_reason: str | None
    arrival: float
    first_token: float | None
    finish: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    choices: int
    prefill_worker: str | None
    decode_worker: str | None
    prefill_gpu_s: float
    decode_gpu_s: float
    prefill_j: float | None
    decode_j: float | None
    prefill_cost_usage: float
    decode_cost_usage: float
    prefill_cost_allocation: float
    decode_cost_allocation: float
    prefill_co2e_op_g: float | None
    decode_co2e_op_g: float | None
    prefill_co2e_emb_g: float
    decode_co2e_emb_g: float
    intensity_g_per_kwh: float
    intensity_source: str
    intensity_kind: str
    intensity_estimated: int
    intensity_factor: str
    pue: float
    energy_source: str
    simulated: int
    approximate: int
    final: int
    incomplete: int
    structured: int     # a grammar constrained the output (structured output, forced tool call)

    @property
    def co2e_g(self) -> float:
        return co2e_of(self)


class WindowRow(NamedTuple):
    """One device over one window in `device_windows`, in column order."""

    device: str
    start: float
    end: float
    site: str
    appliance: str
    model: str
    measured_gpu_s: float
    attributed_gpu_s: float
    idle_gpu_s: float
    unattributed_gpu_s: float
    measured_j: float | None
    attributed_j: float | None
    idle_j: float | None
    unattributed_j: float | None
    energy_source: str
    iterations: int
    simulated: int
    approximate: int
    idle_cost: float
    idle_co2e_emb_g: float


REQUEST_COLUMNS = RequestRow._fields
WINDOW_COLUMNS = WindowRow._fields
# Each field's position, by name, for rows kept as plain tuples: row[COL.request_id]
COL = RequestRow._make(range(len(REQUEST_COLUMNS)))
_ID = COL.request_id
_CO2E = (COL.prefill_co2e_op_g, COL.decode_co2e_op_g, COL.prefill_co2e_emb_g,
         COL.decode_co2e_emb_g)


def co2e_of(row: tuple) -> float:
    """Operational (where known) + embodied grams of a request row, both phases."""
    return sum(row[i] or 0.0 for i in _CO2E)

_TYPES = {"arrival": "REAL", "first_token": "REAL", "finish": "REAL", "start": "REAL",
          "end": "REAL", "pue": "REAL", "intensity_g_per_kwh": "REAL"}
_INT = {"prompt_tokens", "output_tokens", "cached_tokens", "choices", "intensity_estimated",
        "simulated", "approximate", "final", "incomplete", "iterations", "structured"}
_TEXT = {"request_id", "tenant", "model", "site", "appliance", "endpoint", "status",
         "finish_reason", "prefill_worker", "decode_worker", "intensity_source",
         "intensity_kind", "intensity_factor", "energy_source", "device"}


def _coltype(c: str) -> str:
    if c in _INT:
        return "INTEGER"
    if c in _TEXT:
        return "TEXT"
    return _TYPES.get(c, "REAL")


SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value);
CREATE TABLE IF NOT EXISTS requests ({", ".join(f'"{c}" {_coltype(c)}' for c in REQUEST_COLUMNS)},
    PRIMARY KEY (request_id));
CREATE INDEX IF NOT EXISTS requests_finish ON requests(finish);
CREATE TABLE IF NOT EXISTS pending (batch INTEGER PRIMARY KEY, rows BLOB);
CREATE TABLE IF NOT EXISTS device_windows ({", ".join(f'"{c}" {_coltype(c)}' for c in WINDOW_COLUMNS)},
    PRIMARY KEY (device, start));
CREATE INDEX IF NOT EXISTS device_windows_start ON device_windows(start);
CREATE TABLE IF NOT EXISTS rollups (
    period TEXT, bucket REAL, tenant TEXT, model TEXT, site TEXT,
    requests INTEGER, prompt_tokens INTEGER, output_tokens INTEGER,
    prefill_gpu_s REAL, decode_gpu_s REAL, prefill_j REAL, decode_j REAL,
    cost_usage REAL, cost_allocation REAL, co2e_g REAL,
    PRIMARY KEY (period, bucket, tenant, model, site));
"""

_REQ_CONFLICT = (" ON CONFLICT(request_id) DO UPDATE SET "
                 + ", ".join(f'"{c}" = excluded."{c}"' for c in REQUEST_COLUMNS[1:])
                 + " WHERE requests.final = 0")


@functools.cache
def _insert(verb: str, table: str, columns: tuple, rows: int, tail: str = "") -> str:
    one = "(" + ", ".join("?" * len(columns)) + ")"
    return (f'{verb} INTO {table} ({", ".join(chr(34) + c + chr(34) for c in columns)}) '
            f'VALUES {", ".join([one] * rows)}{tail}')


MAX_PARAMETERS = 32766          # SQLite's bound on one statement's parameters


def write_rows(conn: sqlite3.Connection, verb: str, table: str, columns: tuple,
               rows: list[tuple], tail: str = "") -> None:
    """Insert `rows` with many rows per statement, not `executemany`'s one.

    The sqlite3 module lets go of the GIL for every step of a statement. `executemany`
    steps once per row, and a writer thread that needs the GIL back after each row
    while the event loop holds it waits for a forced switch every time: 40,000 rows
    took 39 s of wall time beside a busy thread (and cost that thread a GIL hand-off
    each), against 0.7 s in statements of ~800 rows. Four statement sizes only, so
    the connection's statement cache keeps them all prepared."""
    i = 0
    for size in (MAX_PARAMETERS // len(columns), 64, 8, 1):
        if len(rows) - i < size:
            continue
        sql = _insert(verb, table, columns, size, tail)
        while len(rows) - i >= size:
            conn.execute(sql, [v for row in rows[i:i + size] for v in row])
            i += size


def pack_rows(rows: list[RequestRow]) -> bytes:
    """A batch of provisional rows as one blob. marshal: rows hold only str, int, float
    and None; it is as fast as pickle (0.4 µs a row, JSON is 3 µs) and loading it runs
    no code (it takes plain tuples only: RequestRows are copied)."""
    if rows and type(rows[0]) is not tuple:
        rows = [tuple(r) for r in rows]
    return marshal.dumps(rows)


def _add_new_columns(conn: sqlite3.Connection) -> None:
    """Columns are only ever added at the end of a table: a ledger written by an older
    release gains the new ones here (NULL in its old rows, which readers take as 0)."""
    for table, columns in (("requests", REQUEST_COLUMNS), ("device_windows", WINDOW_COLUMNS)):
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for c in columns:
            if c not in have:
                conn.execute(f'ALTER TABLE {table} ADD COLUMN "{c}" {_coltype(c)}')


def unpack_rows(blob: bytes) -> list[RequestRow]:
    """The rows of a blob; one written by an older release with fewer columns is padded
    with None (columns are only ever added at the end)."""
    n = len(REQUEST_COLUMNS)
    return [RequestRow._make(r if len(r) == n else (tuple(r) + (None,) * n)[:n])
            for r in marshal.loads(blob)]

# Hour and day sums of final request rows, for whole hours that ended a while ago (rows
# are final seconds after they finish): one GROUP BY per hour of traffic in the writer
# thread, not an upsert per request.
_ROLLUP = """INSERT INTO rollups
SELECT ?, CAST(finish / ? AS INTEGER) * ?, tenant, model, site, count(*), sum(prompt_tokens),
    sum(output_tokens), sum(prefill_gpu_s), sum(decode_gpu_s), sum(prefill_j), sum(decode_j),
    sum(prefill_cost_usage + decode_cost_usage),
    sum(prefill_cost_allocation + decode_cost_allocation),
    sum(coalesce(prefill_co2e_op_g, 0) + coalesce(decode_co2e_op_g, 0)
        + prefill_co2e_emb_g + decode_co2e_emb_g)
FROM requests WHERE finish >= ? AND finish < ? GROUP BY 2, 3, 4, 5
ON CONFLICT(period, bucket, tenant, model, site) DO UPDATE SET
    requests = requests + excluded.requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    output_tokens = output_tokens + excluded.output_tokens,
    prefill_gpu_s = prefill_gpu_s + excluded.prefill_gpu_s,
    decode_gpu_s = decode_gpu_s + excluded.decode_gpu_s,
    prefill_j = coalesce(prefill_j, 0) + coalesce(excluded.prefill_j, 0),
    decode_j = coalesce(decode_j, 0) + coalesce(excluded.decode_j, 0),
    cost_usage = cost_usage + excluded.cost_usage,
    cost_allocation = cost_allocation + excluded.cost_allocation,
    co2e_g = co2e_g + excluded.co2e_g"""
ROLLUP_LAG_S = 600.0


def roll_up(conn: sqlite3.Connection, now: float) -> None:
    """Add every whole hour from `rolled_until` to (now - lag) to the rollups, once."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'rolled_until'").fetchone()
    if row is None:
        first = conn.execute("SELECT min(finish) FROM requests").fetchone()[0]
        if first is None:
            return
        start = (first // 3600) * 3600
    else:
        start = float(row[0])
    until = ((now - ROLLUP_LAG_S) // 3600) * 3600
    if until <= start:
        return
    with conn:
        for period, size in (("hour", 3600), ("day", 86400)):
            conn.execute(_ROLLUP, (period, size, size, start, until))
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('rolled_until', ?)", (until,))


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


class Ledger:
    def __init__(self, path: Path, flush_interval_s: float = 1.0, retention_days: float = 90.0,
                 rollup_retention_days: float = 730.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        self.retention_days = retention_days
        self.rollup_retention_days = rollup_retention_days
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._flushed = threading.Condition()
        self._generation = 0
        self.batches = 0
        self.rows_written = 0
        self.cpu_s = 0.0            # the writer thread's CPU time in commits
        self.error: str | None = None
        # Set by the accounting process: the daemon's time up to which its records have
        # been queued here. A batch's `covered_until` is never later (records still on
        # their way from the daemon are not covered).
        self.received_until: float | None = None
        # the writer thread's own: which `pending` batch holds each provisional row, and
        # how many of each batch's requests are not final yet
        self._pending_of: dict[str, int] = {}
        self._pending_left: dict[int, int] = {}
        conn = connect(self.path)
        try:
            with conn:
                conn.executescript(SCHEMA)
                _add_new_columns(conn)
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                             (SCHEMA_VERSION,))
            self._longest = self._longest_window(conn)
            self.recovered = self._recover(conn)
            roll_up(conn, time.time())      # before pruning: raw rows roll up first
            self._prune(conn, time.time())
        finally:
            conn.close()
        self.reader = LedgerReader(self.path)

    # ---- start-up ------------------------------------------------------------
    @staticmethod
    def _longest_window(conn: sqlite3.Connection) -> float:
        """meta `max_window_s`: the longest device window (an idle stretch is one row), so
        a report finds the windows overlapping its start through the index on `start`.
        A ledger written before it is scanned once."""
        row = conn.execute("SELECT value FROM meta WHERE key = 'max_window_s'").fetchone()
        if row is not None:
            return float(row[0])
        (longest,) = conn.execute('SELECT max("end" - start) FROM device_windows').fetchone()
        longest = float(longest or 0.0)
        with conn:
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('max_window_s', ?)", (longest,))
        return longest

    def _recover(self, conn: sqlite3.Connection) -> int:
        """Requests a previous run committed as finished but never completed (it died
        before their windows closed): they get a row with what figures they had, marked
        `incomplete`, and count in the rollups like any other. (`final = 0` rows are
        what ledgers written before the `pending` table hold for the same case.)"""
        with conn:
            n = conn.execute("UPDATE requests SET final = 1, incomplete = 1 WHERE final = 0").rowcount
            for (blob,) in conn.execute("SELECT rows FROM pending ORDER BY batch").fetchall():
                rows = [row._replace(final=1, incomplete=1) for row in unpack_rows(blob)]
                before = conn.total_changes
                # a request that did become final keeps its final row
                write_rows(conn, "INSERT OR IGNORE", "requests", REQUEST_COLUMNS, rows)
                n += conn.total_changes - before
            conn.execute("DELETE FROM pending")
        if n:
            log.warning("ledger: %d requests of the previous run finished without their "
                        "device windows closing; kept, marked incomplete", n)
        return n

    def _prune(self, conn: sqlite3.Connection, now: float) -> None:
        with conn:
            if self.retention_days > 0:
                cut = now - self.retention_days * 86400
                conn.execute("DELETE FROM requests WHERE finish < ?", (cut,))
                conn.execute("DELETE FROM device_windows WHERE start < ?", (cut,))
            if self.rollup_retention_days > 0:
                conn.execute("DELETE FROM rollups WHERE bucket < ?",
                             (now - self.rollup_retention_days * 86400,))

    # ---- writing (any thread; never blocks) ----------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def put_request(self, row: tuple) -> None:
        """A request's final row (RequestRow's columns; a plain tuple will do)."""
        self._queue.put(("req", row))

    def put_provisional(self, row: tuple) -> None:
        """A finished request's row before its figures are final: committed (in its
        batch's `pending` blob) so a kill -9 does not lose the request, never written
        to `requests` unless the process dies before the final row."""
        self._queue.put(("pend", row))

    def put_window(self, row: WindowRow) -> None:
        self._queue.put(("win", row))

    def stop(self, timeout: float = 30.0) -> None:
        """Commit everything queued, then stop the writer."""
        self._stopping.set()
        self._queue.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        self.reader.close()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until what is queued now has been committed (tests, shutdown)."""
        with self._flushed:
            target = self._generation + 2
            self._queue.put(("wake", None))
            return self._flushed.wait_for(lambda: self._generation >= target, timeout)

    def _run(self) -> None:
        conn = connect(self.path)
        last_prune = time.monotonic()
        try:
            while True:
                try:
                    first = self._queue.get(timeout=self.flush_interval_s)
                except queue.Empty:
                    first = None
                if first is not None and first[0] != "wake" and not self._stopping.is_set():
                    # a batch: what arrives within one flush interval
                    time.sleep(self.flush_interval_s)
                covered = time.time()
                if self.received_until is not None:
                    covered = min(covered, self.received_until)
                batch = [first] if first is not None else []
                while True:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._commit(conn, batch, covered)
                if time.monotonic() - last_prune > 600:
                    try:
                        roll_up(conn, time.time())
                        self._prune(conn, time.time())
                    except sqlite3.Error as exc:
                        log.error("ledger: rollup/retention failed: %s", exc)
                    last_prune = time.monotonic()
                if self._stopping.is_set() and self._queue.empty():
                    break
        finally:
            conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list, covered: float) -> None:
        cpu0 = time.thread_time()
        try:
            self._write(conn, batch, covered)
        finally:
            self.cpu_s += time.thread_time() - cpu0
        with self._flushed:
            self._generation += 1
            self._flushed.notify_all()

    def _write(self, conn: sqlite3.Connection, batch: list, covered: float) -> None:
        reqs = [row for kind, row in batch if kind == "req"]
        wins = [row for kind, row in batch if kind == "win"]
        pend = [row for kind, row in batch if kind == "pend"]
        if pend and reqs:       # final in the same batch: the provisional row is moot
            final_ids = {row[_ID] for row in reqs}
            pend = [row for row in pend if row[_ID] not in final_ids]
        # the batches whose last provisional row becomes final here (applied on commit)
        left = self._pending_left
        done: dict[int, int] = {}
        for row in reqs:
            b = self._pending_of.get(row[_ID])
            if b is not None:
                done[b] = done.get(b, 0) + 1
        emptied = [b for b, k in done.items() if left[b] == k]
        longest = max((w[2] - w[1] for w in wins), default=0.0)    # WindowRow end - start
        try:
            if reqs or wins or pend:
                with conn:
                    write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, reqs, _REQ_CONFLICT)
                    write_rows(conn, "INSERT OR REPLACE", "device_windows", WINDOW_COLUMNS, wins)
                    if longest > self._longest:
                        conn.execute("INSERT OR REPLACE INTO meta VALUES ('max_window_s', ?)",
                                     (longest,))
                    if emptied:
                        conn.executemany("DELETE FROM pending WHERE batch = ?",
                                         [(b,) for b in emptied])
                    if pend:
                        new = conn.execute("INSERT INTO pending (rows) VALUES (?)",
                                           (pack_rows(pend),)).lastrowid
                    conn.execute("INSERT OR REPLACE INTO meta VALUES ('covered_until', ?)",
                                 (covered,))
                self.batches += 1
                self.rows_written += len(reqs) + len(wins) + len(pend)
        except sqlite3.Error as exc:       # a full disk: say so, keep serving
            self.error = str(exc)
            log.error("ledger: could not commit %d rows: %s", len(reqs) + len(wins) + len(pend),
                      exc)
            return
        self._longest = max(self._longest, longest)
        for row in reqs:
            self._pending_of.pop(row[_ID], None)
        for b, k in done.items():
            left[b] -= k
        for b in emptied:
            del left[b]
        if pend:
            left[new] = len(pend)
            for row in pend:
                self._pending_of[row[_ID]] = new

    # ---- reading ---------------------------------------------------------------
    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self.reader.query(sql, args)


class LedgerReader:
    """A read connection: the daemon's reports read the file the accounting process
    writes (WAL: readers never wait for the writer)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._conn = connect(self.path)
        self._lock = threading.Lock()

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def close(self) -> None:
        self._conn.close()
