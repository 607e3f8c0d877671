"""Per-model, per-minute trends of finished requests, kept in SQLite (WAL).

The daemon's hot path only appends the record to a queue (`observe`); a writer thread
folds the queue into minute rows once a second, in one transaction. Means are exact
(sums); percentiles come from log-spaced histograms (bins 2^(1/8) wide, ~9%), which
merge by addition, so hours and days roll up from minutes without keeping requests.

GPU-seconds per phase are not in the request records (the ledger has the measured
ones): they are estimated per request from the profile by the `estimate` callable,
and every row says so in `gpu_source`.

Burstiness: each minute row also keeps the inter-arrival gaps of its requests (count,
sum, sum of squares), from which the squared coefficient of variation c_a² of that
minute follows (1 for Poisson arrivals, 0 for evenly spaced ones, far above 1 for
bursts). Records come in finish order, not arrival order, so the writer keeps the
arrival times of the last `ARRIVAL_MEMORY_MIN` minutes in memory, sorted, with each
minute's gap sums kept up to date as arrivals slot in (`MinuteGaps`); a minute it has
no memory of (older, or written by another process) keeps the sums it has. A bucket's c_a² is the mean of its minutes'
weighted by their gaps (Kingman's wait is linear in c_a², so that is the c_a² of the
mean wait); per minute, so a rate that changes from minute to minute (which the
forecast follows) is not counted as burstiness. The sum of squared prompt lengths
gives the prompt-length spread c_L², from which sizing derives the service-time
variability c_s².
"""
from __future__ import annotations

import bisect
import collections
import json
import math
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from appliance.accounting.records import RequestRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS planner_minutes (
    model TEXT NOT NULL,
    minute INTEGER NOT NULL,          -- unix time // 60
    requests INTEGER NOT NULL,
    prompt_sum REAL NOT NULL,
    output_sum REAL NOT NULL,
    cached_sum REAL NOT NULL,
    prefill_gpu_s REAL NOT NULL,
    decode_gpu_s REAL NOT NULL,
    ttft_sum REAL NOT NULL, ttft_n INTEGER NOT NULL,
    itl_sum REAL NOT NULL, itl_n INTEGER NOT NULL,
    hist TEXT NOT NULL,               -- {"prompt"|"output"|"ttft"|"itl": {bin: count}}
    gpu_source TEXT NOT NULL,
    prompt_sq_sum REAL NOT NULL DEFAULT 0,
    gap_n INTEGER NOT NULL DEFAULT 0,     -- inter-arrival gaps within the minute
    gap_sum REAL NOT NULL DEFAULT 0,
    gap_sq REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (model, minute)
);
"""
# Columns added after the first release: a ledger.db written before them gains them.
ADDED_COLUMNS = {"prompt_sq_sum": "REAL NOT NULL DEFAULT 0",
                 "gap_n": "INTEGER NOT NULL DEFAULT 0",
                 "gap_sum": "REAL NOT NULL DEFAULT 0", "gap_sq": "REAL NOT NULL DEFAULT 0"}
ROW_FIELDS = ("requests", "prompt_sum", "output_sum", "cached_sum", "prefill_gpu_s",
              "decode_gpu_s", "ttft_sum", "ttft_n", "itl_sum", "itl_n", "prompt_sq_sum",
              "gap_n", "gap_sum", "gap_sq")
ARRIVAL_MEMORY_MIN = 30     # minutes of arrival times the writer keeps to compute gaps
MIN_GAPS = 30               # inter-arrival gaps needed to trust a measured c_a²

BIN_RATIO = 2 ** (1 / 8)
_LOG_RATIO = math.log(BIN_RATIO)
# Bin origins: token counts from 1, seconds from 10 µs.
_ORIGIN = {"prompt": 1.0, "output": 1.0, "ttft": 1e-5, "itl": 1e-5}


def _bin(kind: str, value: float) -> int:
    return max(0, int(math.floor(math.log(max(value, _ORIGIN[kind]) / _ORIGIN[kind]) / _LOG_RATIO)))


def hist_quantile(kind: str, hist: dict, q: float) -> float | None:
    """The q-quantile of a binned distribution (geometric interpolation in the bin)."""
    total = sum(hist.values())
    if total == 0:
        return None
    target = q * total
    run = 0.0
    for b in sorted(hist, key=int):
        c = hist[b]
        if run + c >= target:
            frac = (target - run) / c if c else 0.0
            return _ORIGIN[kind] * BIN_RATIO ** (int(b) + frac)
        run += c
    return _ORIGIN[kind] * BIN_RATIO ** (int(max(hist, key=int)) + 1)


@dataclass
class Bucket:
    start: float                # unix seconds
    width_s: float
    requests: int
    rate: float                 # requests/s
    prompt_mean: float | None
    prompt_p50: float | None
    prompt_p90: float | None
    output_mean: float | None
    output_p50: float | None
    output_p90: float | None
    prefix_hit: float | None    # cached prompt tokens / prompt tokens
    arrival_scv: float | None   # c_a²: squared CV of inter-arrival gaps (per minute, weighted)
    arrival_gaps: int           # gaps behind it
    prompt_scv: float | None    # c_L²: squared CV of prompt lengths
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    prefill_gpu_s: float
    decode_gpu_s: float
    rho: float | None           # prefill GPU-seconds / decode GPU-seconds
    gpu_source: str

    def to_json(self) -> dict:
        from dataclasses import asdict
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _empty_row() -> dict:
    return {"requests": 0, "prompt_sum": 0.0, "output_sum": 0.0, "cached_sum": 0.0,
            "prefill_gpu_s": 0.0, "decode_gpu_s": 0.0, "ttft_sum": 0.0, "ttft_n": 0,
            "itl_sum": 0.0, "itl_n": 0, "prompt_sq_sum": 0.0,
            "gap_n": 0, "gap_sum": 0.0, "gap_sq": 0.0, "scv_wsum": 0.0,
            "hist": {"prompt": {}, "output": {}, "ttft": {}, "itl": {}}}


def gap_stats(arrivals: list[float]) -> tuple[int, float, float]:
    """(count, sum, sum of squares) of the gaps between sorted arrival times, within one
    minute: the gap across a minute's start is left out, so a quiet spell between two
    minutes is not counted as burstiness (the rate forecast follows those). For Poisson
    arrivals this reads c_a² ≈ 0.98 at 1 req/s, 1.00 from 5 req/s (0.83 at 0.2 req/s,
    where a minute holds a dozen gaps)."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return len(gaps), float(sum(gaps)), float(sum(g * g for g in gaps))


class MinuteGaps:
    """One minute's arrival times, sorted, with the gap sums kept up to date as arrivals
    come in any order: an arrival between two others replaces their gap by two, so
    each insertion costs a bisection, not a pass over the minute."""

    __slots__ = ("times", "n", "sum", "sq")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.n, self.sum, self.sq = 0, 0.0, 0.0

    def _gap(self, a: float, b: float, sign: int) -> None:
        g = b - a
        self.n += sign
        self.sum += sign * g
        self.sq += sign * g * g

    def add(self, t: float) -> None:
        ts = self.times
        i = bisect.bisect_right(ts, t)
        if 0 < i < len(ts):
            self._gap(ts[i - 1], ts[i], -1)
        if i > 0:
            self._gap(ts[i - 1], t, +1)
        if i < len(ts):
            self._gap(t, ts[i], +1)
        ts.insert(i, t)

    def stats(self) -> tuple[int, float, float]:
        return self.n, self.sum, max(0.0, self.sq)


def scv(n: int, total: float, sq: float) -> float | None:
    """Squared coefficient of variation from a count, sum and sum of squares."""
    if n < 1 or total <= 0:
        return None
    mean = total / n
    return max(0.0, sq / n - mean * mean) / (mean * mean)


def _merge(into: dict, row: dict) -> None:
    for k, v in row.items():
        if k == "hist":
            for kind, h in v.items():
                dst = into["hist"].setdefault(kind, {})
                for b, c in h.items():
                    dst[str(b)] = dst.get(str(b), 0) + c
        elif k in into:
            into[k] += v


def request_row(rec: RequestRecord, prefill_gpu_s: float, decode_gpu_s: float) -> dict:
    row = _empty_row()
    row["requests"] = 1
    row["prompt_sum"] = float(rec.prompt_tokens)
    row["output_sum"] = float(rec.output_tokens)
    row["cached_sum"] = float(rec.cached_tokens)
    row["prompt_sq_sum"] = float(rec.prompt_tokens) ** 2
    row["prefill_gpu_s"] = prefill_gpu_s
    row["decode_gpu_s"] = decode_gpu_s
    h = row["hist"]
    if rec.status != "rejected":
        h["prompt"][str(_bin("prompt", rec.prompt_tokens))] = 1
        h["output"][str(_bin("output", rec.output_tokens / max(1, rec.choices)))] = 1
    if rec.first_token is not None:
        ttft = max(0.0, rec.first_token - rec.arrival)
        row["ttft_sum"], row["ttft_n"] = ttft, 1
        h["ttft"][str(_bin("ttft", ttft))] = 1
        per_choice = rec.output_tokens / max(1, rec.choices)
        if per_choice > 1 and rec.status == "ok":
            itl = max(0.0, rec.finish - rec.first_token) / (per_choice - 1)
            row["itl_sum"], row["itl_n"] = itl, 1
            h["itl"][str(_bin("itl", itl))] = 1
    return row


Estimate = Callable[[RequestRecord], tuple[float, float]]


class TrendStore:
    """Minute rows in `path` (the ledger's database file, own tables, own connection)."""

    def __init__(self, path: str | Path, estimate: Estimate | None = None,
                 gpu_source: str = "estimated", flush_interval_s: float = 1.0):
        self.path = str(path)
        self.estimate = estimate or (lambda rec: (0.0, 0.0))
        self.gpu_source = gpu_source
        self.flush_interval_s = flush_interval_s
        self._queue: collections.deque = collections.deque()
        self._db_lock = threading.Lock()
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._migrate()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (model, minute) -> sorted arrival times seen by this process, or None for a
        # minute that had a row before this process touched it (its gaps are not ours).
        self._arrivals: dict[tuple[str, int], MinuteGaps | None] = {}

    def _migrate(self) -> None:
        have = {r[1] for r in self._db.execute("PRAGMA table_info(planner_minutes)")}
        for col, decl in ADDED_COLUMNS.items():
            if col not in have:
                self._db.execute(f"ALTER TABLE planner_minutes ADD COLUMN {col} {decl}")

    # -- writing ----------------------------------------------------------------------
    def observe(self, rec: RequestRecord) -> None:
        """Hot path: O(1), no I/O."""
        self._queue.append(rec)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="planner-trends", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except sqlite3.Error:   # a locked or full disk must not kill the thread
                pass

    def flush(self) -> int:
        """Fold queued records into their minute rows; returns how many were written."""
        batch: dict[tuple[str, int], dict] = {}
        arrived: dict[tuple[str, int], list[float]] = {}
        n = 0
        while self._queue:
            rec = self._queue.popleft()
            try:
                pre, dec = self.estimate(rec)
            except Exception:
                pre, dec = 0.0, 0.0
            key = (rec.model, int(rec.arrival // 60))
            _merge(batch.setdefault(key, _empty_row()), request_row(rec, pre, dec))
            arrived.setdefault(key, []).append(rec.arrival)
            n += 1
        if not batch:
            return 0
        cols = ", ".join(ROW_FIELDS)
        with self._db_lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                for (model, minute), row in batch.items():
                    old = db.execute(f"SELECT {cols}, hist FROM planner_minutes "
                                     "WHERE model=? AND minute=?", (model, minute)).fetchone()
                    key = (model, minute)
                    if key not in self._arrivals:
                        self._arrivals[key] = None if old else MinuteGaps()
                    if old:
                        merged = dict(zip(ROW_FIELDS, old[:-1]))
                        merged["hist"] = json.loads(old[-1])
                        _merge(merged, row)
                        row = merged
                    gaps = self._arrivals[key]
                    if gaps is not None:
                        for t in arrived[key]:
                            gaps.add(t)
                        row["gap_n"], row["gap_sum"], row["gap_sq"] = gaps.stats()
                    db.execute(f"INSERT OR REPLACE INTO planner_minutes (model, minute, {cols}, "
                               f"hist, gpu_source) VALUES ({', '.join('?' * (len(ROW_FIELDS) + 4))})",
                               (model, minute, *(row[k] for k in ROW_FIELDS),
                                json.dumps(row["hist"]), self.gpu_source))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._forget_old_arrivals()
        return n

    def _forget_old_arrivals(self) -> None:
        if not self._arrivals:
            return
        newest = max(m for _, m in self._arrivals)
        for key in [k for k in self._arrivals if k[1] < newest - ARRIVAL_MEMORY_MIN]:
            del self._arrivals[key]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        with self._db_lock:
            self._db.close()

    # -- reading ----------------------------------------------------------------------
    def models(self) -> list[str]:
        with self._db_lock:
            return [r[0] for r in self._db.execute(
                "SELECT DISTINCT model FROM planner_minutes ORDER BY model")]

    def span(self, model: str) -> tuple[float, float] | None:
        with self._db_lock:
            lo, hi = self._db.execute("SELECT MIN(minute), MAX(minute) FROM planner_minutes "
                                      "WHERE model=?", (model,)).fetchone()
        return None if lo is None else (lo * 60.0, (hi + 1) * 60.0)

    def buckets(self, model: str, width_s: float, since: float, until: float) -> list[Bucket]:
        """Contiguous buckets of `width_s` (a multiple of 60) from `since` to `until`;
        empty ones have rate 0 and no distributions."""
        width_m = max(1, int(round(width_s / 60)))
        first = int(since // 60) // width_m * width_m
        last = int(math.ceil(until / 60))
        with self._db_lock:
            rows = self._db.execute(
                f"SELECT minute, {', '.join(ROW_FIELDS)}, hist, gpu_source "
                "FROM planner_minutes WHERE model=? AND minute>=? AND minute<? ORDER BY minute",
                (model, first, last)).fetchall()
        agg: dict[int, dict] = {}
        sources: dict[int, set] = {}
        nf = len(ROW_FIELDS)
        for r in rows:
            k = (r[0] - first) // width_m
            row = dict(zip(ROW_FIELDS, r[1:1 + nf]))
            row["hist"] = json.loads(r[1 + nf])
            # c_a² per minute, then weighted by gaps (see the module doc)
            c2 = scv(row["gap_n"], row["gap_sum"], row["gap_sq"])
            row["scv_wsum"] = row["gap_n"] * c2 if c2 is not None else 0.0
            _merge(agg.setdefault(k, _empty_row()), row)
            sources.setdefault(k, set()).add(r[2 + nf])
        n = max(1, int(math.ceil((last - first) / width_m)))
        return [self._bucket(first * 60.0 + k * width_m * 60.0, width_m * 60.0,
                             agg.get(k, _empty_row()), sources.get(k, {self.gpu_source}))
                for k in range(n)]

    @staticmethod
    def _bucket(start: float, width: float, row: dict, sources: set) -> Bucket:
        h = row["hist"]
        q = lambda kind, p: hist_quantile(kind, h.get(kind, {}), p)  # noqa: E731
        req = row["requests"]
        pre, dec = row["prefill_gpu_s"], row["decode_gpu_s"]
        pmean = row["prompt_sum"] / req if req else None
        return Bucket(
            start=start, width_s=width, requests=req, rate=req / width,
            prompt_mean=row["prompt_sum"] / req if req else None,
            prompt_p50=q("prompt", 0.5), prompt_p90=q("prompt", 0.9),
            output_mean=row["output_sum"] / req if req else None,
            output_p50=q("output", 0.5), output_p90=q("output", 0.9),
            prefix_hit=row["cached_sum"] / row["prompt_sum"] if row["prompt_sum"] else None,
            arrival_scv=row["scv_wsum"] / row["gap_n"] if row["gap_n"] else None,
            arrival_gaps=row["gap_n"],
            prompt_scv=(max(0.0, row["prompt_sq_sum"] / req / pmean ** 2 - 1.0)
                        if pmean and row["prompt_sq_sum"] else None),
            ttft_p50_s=q("ttft", 0.5), ttft_p90_s=q("ttft", 0.9), ttft_p99_s=q("ttft", 0.99),
            itl_p50_s=q("itl", 0.5), itl_p90_s=q("itl", 0.9), itl_p99_s=q("itl", 0.99),
            prefill_gpu_s=pre, decode_gpu_s=dec, rho=pre / dec if dec > 0 else None,
            gpu_source=",".join(sorted(sources)))


def series(buckets: list[Bucket], field: str, fill: float | None = None) -> np.ndarray:
    """One field over buckets; empty buckets carry the last seen value (or `fill`)."""
    out, last = [], fill
    for b in buckets:
        v = getattr(b, field)
        if v is None:
            v = last if last is not None else 0.0
        last = v
        out.append(v)
    return np.asarray(out, dtype=float)
