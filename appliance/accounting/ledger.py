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
per device per window), and the 10-s slice and hour rollups reports read for whole hours
(rollups.py: `usage_rollups`, `window_rollups`; kept longer than the raw rows, which
are bounded by days and by size). A row or window that lands in an hour already rolled
up is added to (or marks for recomputing) the rollups in the transaction that writes it.
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

from appliance.accounting import rollups

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
_FINISH = COL.finish
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
""" + rollups.SCHEMA

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

def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


ROLL_EVERY_S = 10.0         # the writer rolls up the 10-s slices this often
PRUNE_EVERY_S = 600.0       # and applies retention this often


def _late_table(conn: sqlite3.Connection) -> None:
    """A per-connection scratch table with the requests' columns, for late rows."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS late_requests AS SELECT * FROM requests WHERE 0")


def _add_late(conn: sqlite3.Connection, rows: list, h: rollups.Horizons) -> None:
    """Add request rows that finished in slices (hours) already rolled up to those
    rollups, in the caller's transaction, before it writes them to `requests`: a row
    whose id is there already is left out (the writes keep an existing final row, so
    it is not new and was rolled up with its hour)."""
    rows = [r for r in rows if h.slices is not None and r[_FINISH] < h.slices]
    if not rows:
        return
    write_rows(conn, "INSERT", "temp.late_requests", REQUEST_COLUMNS, rows)
    conn.execute("DELETE FROM temp.late_requests WHERE request_id IN "
                 "(SELECT request_id FROM main.requests)")
    rollups.add_late(conn, "temp.late_requests", h)
    conn.execute("DELETE FROM temp.late_requests")


class Ledger:
    def __init__(self, path: Path, flush_interval_s: float = 1.0, retention_days: float = 90.0,
                 rollup_retention_days: float = 730.0, retention_mb: float = 0.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        self.retention_days = retention_days
        self.rollup_retention_days = rollup_retention_days
        self.retention_mb = retention_mb
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
            rollups.roll_up(conn, time.time())     # before pruning: raw rows roll up first
            self._prune(conn, time.time())
            self._horizons = rollups.horizons(conn)
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
            rolled = rollups.horizons(conn)
            _late_table(conn)
            for (blob,) in conn.execute("SELECT rows FROM pending ORDER BY batch").fetchall():
                rows = [row._replace(final=1, incomplete=1) for row in unpack_rows(blob)]
                # a recovered row in an hour already rolled up is added to it
                _add_late(conn, rows, rolled)
                before = conn.total_changes
                # a request that did become final keeps its final row
                write_rows(conn, "INSERT OR IGNORE", "requests", REQUEST_COLUMNS, rows)
                n += conn.total_changes - before
            conn.execute("DELETE FROM pending")
        if n:
            log.warning("ledger: %d requests of the previous run finished without their "
                        "device windows closing; kept, marked incomplete", n)
        return n

    def _size_cut(self, conn: sqlite3.Connection) -> float | None:
        """The finish time below which raw rows must go for the file to hold at most
        `retention_mb` (to 90 % of it, so pruning is not redone every pass): raw request
        rows are nearly all of a busy ledger, so the oldest fraction of them that is over."""
        if self.retention_mb <= 0:
            return None
        (ps,), (pc,), (free,) = (conn.execute(f"PRAGMA {p}").fetchone()
                                 for p in ("page_size", "page_count", "freelist_count"))
        used, limit = (pc - free) * ps, self.retention_mb * 1e6
        if used <= limit:
            return None
        lo, hi = conn.execute("SELECT min(rowid), max(rowid) FROM requests").fetchone()
        if lo is None:
            return None
        n = hi - lo + 1
        drop = min(n - 1, int(n * (used - 0.9 * limit) / used) + 1)
        row = conn.execute("SELECT finish FROM requests ORDER BY finish LIMIT 1 OFFSET ?",
                           (max(drop, 0),)).fetchone()
        return None if row is None else float(row[0])

    def _prune(self, conn: sqlite3.Connection, now: float) -> None:
        """Raw rows older than `retention_days`, or the oldest beyond `retention_mb`,
        but never a row not rolled up yet: requests only below the hours rolled
        (slices roll into hours), windows only below the windows rolled and the first
        dirty hour. Slice rollups go with the raw rows (they are a report's edges to
        10 s); hour rollups after `rollup_retention_days`. Deleted pages are reused
        (the file does not shrink below its high-water mark)."""
        cuts = [now - self.retention_days * 86400] if self.retention_days > 0 else []
        size = self._size_cut(conn)
        if size is not None:
            cuts.append(size)
        _, hours, _, windows = rollups.horizons(conn)
        with conn:
            req_cut = float("-inf")
            if cuts:
                cut = max(cuts)
                req_cut = min(cut, hours if hours is not None else float("-inf"))
                (dirty,) = conn.execute("SELECT min(hour) FROM dirty_hours").fetchone()
                win_cut = min(cut, windows if windows is not None else float("-inf"),
                              dirty if dirty is not None else float("inf"))
                conn.execute("DELETE FROM requests WHERE finish < ?", (req_cut,))
                conn.execute("DELETE FROM usage_rollups WHERE period = 'slice' "
                             "AND bucket + ? <= ?", (rollups.SLICE, req_cut))
                conn.execute('DELETE FROM device_windows WHERE "end" <= ?', (win_cut,))
            if self.rollup_retention_days > 0:
                # never below the raw rows still kept: a report reads those hours raw
                # only if they are not rolled, so their rollups stay as long as they do
                old = min(now - self.rollup_retention_days * 86400, req_cut)
                conn.execute("DELETE FROM usage_rollups WHERE bucket < ?", (old,))
                conn.execute("DELETE FROM window_rollups WHERE hour < ?", (old,))
                conn.execute("DELETE FROM window_cover WHERE hour < ?", (old,))

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
        _late_table(conn)
        last_prune = last_roll = time.monotonic()
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
                if time.monotonic() - last_roll > ROLL_EVERY_S:
                    try:
                        rollups.roll_up(conn, time.time())
                        if time.monotonic() - last_prune > PRUNE_EVERY_S:
                            self._prune(conn, time.time())
                            last_prune = time.monotonic()
                        self._horizons = rollups.horizons(conn)
                    except sqlite3.Error as exc:
                        log.error("ledger: rollup/retention failed: %s", exc)
                    last_roll = time.monotonic()
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
                rolled = self._horizons
                with conn:
                    late = ([r for r in reqs if r[_FINISH] < rolled.slices]
                            if rolled.slices is not None else [])
                    if late:
                        _add_late(conn, late, rolled)
                    write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, reqs, _REQ_CONFLICT)
                    write_rows(conn, "INSERT OR REPLACE", "device_windows", WINDOW_COLUMNS, wins)
                    if wins:
                        rollups.mark_dirty(conn, wins, rolled.windows)
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


class ReportTimeout(Exception):
    """A report's query ran past the reader's timeout and was interrupted."""


PROGRESS_OPS = 100_000      # SQLite VM steps between deadline checks (~1 ms of work each)


class LedgerReader:
    """A read connection: the daemon's reports read the file the accounting process
    writes (WAL: readers never wait for the writer).

    Each query runs under a deadline (`timeout_s`; 0 = none): a reader holds its WAL
    snapshot for as long as it reads, and a checkpoint cannot pass a snapshot still in
    use, so a report that scans for minutes would let the WAL grow and the writer's
    checkpoints stall for that long. SQLite's progress handler checks the deadline every
    `PROGRESS_OPS` steps (a check takes the GIL, so not more often) and interrupts the
    query: `ReportTimeout`, which the API returns as a 503 error."""

    def __init__(self, path: Path, timeout_s: float = 30.0):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._conn = connect(self.path)
        self._lock = threading.Lock()

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            if self.timeout_s <= 0:
                return self._conn.execute(sql, args).fetchall()
            deadline = time.monotonic() + self.timeout_s
            self._conn.set_progress_handler(lambda: time.monotonic() > deadline, PROGRESS_OPS)
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                if "interrupt" in str(exc):
                    raise ReportTimeout(
                        f"the ledger query ran past {self.timeout_s:g} s and was stopped "
                        "(accounting.report_timeout_s); ask for a shorter window or fewer "
                        "group-by dimensions") from None
                raise
            finally:
                self._conn.set_progress_handler(None, 0)

    def close(self) -> None:
        self._conn.close()
