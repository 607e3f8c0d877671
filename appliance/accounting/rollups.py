"""10-second and hour rollups of the ledger: what lets a report over a day or a month read
thousands of rows where the raw tables hold tens of millions (issue 22 §6).

At 1,000 requests/s the `requests` table grows by 3.6 M rows an hour; a report that
scans them takes minutes. Reports price at query time (allocation.py), so what a
rollup keeps is *quantities*, never money: summing them over an hour and pricing the
sum gives the figure the rows would give, because every price and intensity is
constant within the intervals a report prices (they are cut at rate-card and
intensity steps, and the rollups are only read for whole hours inside one interval).

- `usage_rollups`: per (period, bucket, tenant, model, site, phase) the sums of the
  request rows that finished in the bucket: requests, tokens, GPU-seconds, joules,
  the stored usage cost and carbon (the weights of the allocation), and what says
  how complete they are (requests without an energy reading, measured / simulated,
  intensity range and provenance). Key tags need no column: they are the tenant's
  (read from the config at query time), so the tenant key carries them.
  `slice` buckets (10 s) are rolled from the raw rows `LAG_S` after the slice ends,
  `hour` buckets from the slices once the hour is rolled, `day` buckets (UTC) from
  the hours once the day is rolled. Slice rows are kept as long
  as the raw rows (they are the edges of a report and its newest minute, so a report
  reads at most ~10 s of raw rows at each edge and the ~25 s not rolled yet); hour
  rows for
  `rollup_retention_days`.
- `window_rollups` and `window_cover`: per hour and device model the device windows
  clipped to the hour (each window prorated by its overlap, exactly as a report clips
  a window at its edges), and the wall-clock time the windows cover (node overhead).

Late rows. A request row is final seconds after the request finishes, but one can
land after its slice (or hour) was rolled up (a long window, a restart that turns
pending rows into incomplete ones). It is added to the rollups in the transaction
that writes it (`add_late`): additive sums, so it is counted once whatever its age,
even when the raw rows of its hour are gone. A device window that lands in a rolled
hour (an idle stretch is written when it ends, hours later) marks its hours dirty in
the same transaction; the next pass recomputes them from the raw windows, and until
then reports read those hours raw (`window_segments`).

Retention never drops what is not rolled up: raw rows are deleted only below the
rolled horizons (ledger.py `_prune`).
"""
from __future__ import annotations

import math
import sqlite3
from typing import NamedTuple

CLUSTER_DECODE = "cluster_decode"     # the endpoint of a decode served for a peer box
# A row's request and tokens as the reports count them: not a peer's decode (its front
# counts those), in the rollups and in reports.py's raw queries alike.
COUNTED = f"sum(endpoint IS NOT '{CLUSTER_DECODE}')"
PT = f"CASE WHEN endpoint IS '{CLUSTER_DECODE}' THEN 0 ELSE prompt_tokens END"
OT = f"CASE WHEN endpoint IS '{CLUSTER_DECODE}' THEN 0 ELSE output_tokens END"

SLICE = 10.0            # the fine rollups: a report's edges and its newest seconds
HOUR = 3600.0
DAY = 86400.0           # UTC days: a month's report reads ~30 rows per group
# A slice is rolled once it has been over this long: rows are final seconds after
# their request finishes (window + grace + a tick + a commit); the few later ones are
# added as late rows. What is not rolled yet is what a report reads raw at its end.
LAG_S = 15.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_rollups (
    period TEXT, bucket REAL, tenant TEXT, model TEXT, site TEXT, phase TEXT,
    requests INTEGER, pt INTEGER, ot INTEGER, gpu_s REAL, j REAL, j_null INTEGER,
    j_null_req INTEGER, cu REAL, op REAL, emb REAL, measured INTEGER, simulated INTEGER,
    imin REAL, imax REAL, sources TEXT, kinds TEXT, est INTEGER,
    PRIMARY KEY (period, bucket, tenant, model, site, phase));
CREATE TABLE IF NOT EXISTS window_rollups (
    hour REAL, model TEXT, windows INTEGER, measured_gpu_s REAL, attributed_gpu_s REAL,
    idle_gpu_s REAL, unattributed_gpu_s REAL, measured_j REAL, attributed_j REAL,
    idle_j REAL, unattributed_j REAL, unmeasured INTEGER, wall_s REAL, used_wall_s REAL,
    carried INTEGER, carried_unmeasured INTEGER, PRIMARY KEY (hour, model));
CREATE TABLE IF NOT EXISTS window_cover (hour REAL PRIMARY KEY, covered_s REAL);
CREATE TABLE IF NOT EXISTS dirty_hours (hour REAL PRIMARY KEY);
"""

USAGE_COLUMNS = ("period", "bucket", "tenant", "model", "site", "phase", "requests", "pt",
                 "ot", "gpu_s", "j", "j_null", "j_null_req", "cu", "op", "emb", "measured",
                 "simulated", "imin", "imax", "sources", "kinds", "est")
WINDOW_COLUMNS = ("hour", "model", "windows", "measured_gpu_s", "attributed_gpu_s",
                  "idle_gpu_s", "unattributed_gpu_s", "measured_j", "attributed_j", "idle_j",
                  "unattributed_j", "unmeasured", "wall_s", "used_wall_s", "carried",
                  "carried_unmeasured")

# meta keys: everything before these is in the rollups
SLICES_ROLLED = "slices_rolled_until"
HOURS_ROLLED = "hours_rolled_until"
DAYS_ROLLED = "days_rolled_until"
WINDOWS_ROLLED = "windows_rolled_until"


def _nmin(c: str, f: str) -> str:
    return (f"{c} = CASE WHEN {c} IS NULL THEN excluded.{c} WHEN excluded.{c} IS NULL "
            f"THEN {c} ELSE {f}({c}, excluded.{c}) END")


def _text(c: str) -> str:
    return (f"{c} = CASE WHEN excluded.{c} IS NULL OR instr(',' || coalesce({c}, '') || ',', "
            f"',' || excluded.{c} || ',') > 0 THEN {c} WHEN {c} IS NULL THEN excluded.{c} "
            f"ELSE {c} || ',' || excluded.{c} END")


_ADD = ", ".join(
    [f"{c} = {c} + excluded.{c}" for c in ("requests", "pt", "ot", "gpu_s", "j_null",
                                            "j_null_req", "cu", "op", "emb")]
    + ["j = CASE WHEN j IS NULL AND excluded.j IS NULL THEN NULL "
       "ELSE coalesce(j, 0) + coalesce(excluded.j, 0) END",
       _nmin("measured", "min"), _nmin("simulated", "max"), _nmin("imin", "min"),
       _nmin("imax", "max"), _text("sources"), _text("kinds"), _nmin("est", "max")])
_UPSERT = (" WHERE true ON CONFLICT(period, bucket, tenant, model, site, phase) "
           f"DO UPDATE SET {_ADD}")


def _phase_sums(phase: str, period: str, size: float, src: str, where: str) -> str:
    """One phase's sums of request rows per bucket: the figures reports.py's raw query
    takes from the same rows (`j_null_req`, on the prefill row only, is the requests
    with no energy reading in either phase: the count a report without `phase` shows)."""
    other = "decode" if phase == "prefill" else "prefill"
    pre = phase == "prefill"
    size_sql = repr(float(size))
    return (
        f"SELECT '{period}', CAST(finish / {size_sql} AS INTEGER) * {size_sql}, tenant, model, "
        f"site, '{phase}', {COUNTED}, {f'sum({PT})' if pre else '0'}, "
        f"{'0' if pre else f'sum({OT})'}, sum({phase}_gpu_s), sum({phase}_j), "
        f"sum({phase}_j IS NULL AND {phase}_gpu_s > 0), "
        + (f"sum({phase}_j IS NULL AND {other}_j IS NULL AND {phase}_gpu_s + {other}_gpu_s > 0)"
           if pre else "0")
        + f", sum({phase}_cost_usage), sum(coalesce({phase}_co2e_op_g, 0)), "
        f"sum({phase}_co2e_emb_g), min(energy_source = 'measured'), max(simulated), "
        f"min(intensity_g_per_kwh), max(intensity_g_per_kwh), group_concat(DISTINCT "
        f"intensity_source), group_concat(DISTINCT intensity_kind), max(intensity_estimated) "
        f"FROM {src} WHERE {where} GROUP BY 2, 3, 4, 5")


def _from_rows(period: str, size: float, src: str, where: str) -> str:
    return (f"INSERT INTO usage_rollups ({', '.join(USAGE_COLUMNS)}) SELECT * FROM ("
            f"{_phase_sums('prefill', period, size, src, where)} UNION ALL "
            f"{_phase_sums('decode', period, size, src, where)}){_UPSERT}")


def _coarser(src: str, period: str, size: float) -> str:
    """`period` rows (hours, days) summed from the finer `src` rows of [?, ?)."""
    return (f"INSERT INTO usage_rollups ({', '.join(USAGE_COLUMNS)}) SELECT * FROM ("
            f"SELECT '{period}', CAST(bucket / {size!r} AS INTEGER) * {size!r}, tenant, model, "
            "site, phase, sum(requests), sum(pt), sum(ot), sum(gpu_s), sum(j), sum(j_null), "
            "sum(j_null_req), sum(cu), sum(op), sum(emb), min(measured), max(simulated), "
            "min(imin), max(imax), group_concat(DISTINCT sources), group_concat(DISTINCT "
            f"kinds), max(est) FROM usage_rollups WHERE period = '{src}' AND bucket >= ? "
            f"AND bucket < ? GROUP BY 2, 3, 4, 5, 6){_UPSERT}")


_HOURS_FROM_SLICES = _coarser("slice", "hour", HOUR)
_DAYS_FROM_HOURS = _coarser("hour", "day", DAY)


def meta(conn, key: str) -> float | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _set(conn, key: str, value: float) -> None:
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))


class Horizons(NamedTuple):
    """What is rolled until: the writer keeps them to tell late rows."""

    slices: float | None
    hours: float | None
    days: float | None
    windows: float | None


def horizons(conn) -> Horizons:
    return Horizons(meta(conn, SLICES_ROLLED), meta(conn, HOURS_ROLLED), meta(conn, DAYS_ROLLED),
                    meta(conn, WINDOWS_ROLLED))


# ---- writing (the ledger's writer thread) -------------------------------------------

def roll_up(conn: sqlite3.Connection, now: float, chunk_s: float = 6 * HOUR) -> None:
    """Roll every slice that ended `LAG_S` ago, every hour whose slices are rolled,
    every hour of device windows that ended `LAG_S` ago, and the dirty hours. Each
    step reads its horizon, rolls and moves the horizon in one write transaction
    (BEGIN IMMEDIATE): a crash in between redoes nothing twice, and neither would a
    second writer on the same file. A long backlog (a ledger from before rollups) goes
    in chunks of `chunk_s`."""
    m1 = math.floor((now - LAG_S) / SLICE) * SLICE
    while True:
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            a = meta(conn, SLICES_ROLLED)
            if a is None:
                (first,) = conn.execute("SELECT min(finish) FROM requests").fetchone()
                if first is None:
                    break
                a = math.floor(first / HOUR) * HOUR
            if a >= m1:
                break
            (nxt,) = conn.execute("SELECT min(finish) FROM requests WHERE finish >= ?",
                                  (a,)).fetchone()
            if nxt is not None and nxt >= a + chunk_s:    # nothing to roll before it
                a = min(m1, math.floor(nxt / HOUR) * HOUR)
            b = min(m1, a + chunk_s if nxt is not None else m1)
            conn.execute(_from_rows("slice", SLICE, "requests", "finish >= ? AND finish < ?"),
                         (a, b, a, b))
            _set(conn, SLICES_ROLLED, b)
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        m = meta(conn, SLICES_ROLLED)
        h0 = meta(conn, HOURS_ROLLED)
        if h0 is None:      # nothing pruned yet: the first slice's hour
            (first,) = conn.execute("SELECT min(bucket) FROM usage_rollups "
                                    "WHERE period = 'slice'").fetchone()
            h0 = None if first is None else math.floor(first / HOUR) * HOUR
        if m is not None and h0 is not None:
            h1 = math.floor(m / HOUR) * HOUR
            if h1 > h0:
                conn.execute(_HOURS_FROM_SLICES, (h0, h1))
                _set(conn, HOURS_ROLLED, h1)
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        h = meta(conn, HOURS_ROLLED)
        d0 = meta(conn, DAYS_ROLLED)
        if d0 is None:
            (first,) = conn.execute("SELECT min(bucket) FROM usage_rollups "
                                    "WHERE period = 'hour'").fetchone()
            d0 = None if first is None else math.floor(first / DAY) * DAY
        if h is not None and d0 is not None:
            d1 = math.floor(h / DAY) * DAY
            if d1 > d0:
                conn.execute(_DAYS_FROM_HOURS, (d0, d1))
                _set(conn, DAYS_ROLLED, d1)
    roll_windows(conn, now)


def add_late(conn: sqlite3.Connection, src: str, h: Horizons) -> None:
    """Add the rows of table `src` that finished before the rolled horizons to the
    rollups (call it in the transaction that writes them to `requests`)."""
    for period, size, until in (("slice", SLICE, h.slices), ("hour", HOUR, h.hours),
                                ("day", DAY, h.days)):
        if until is not None:
            conn.execute(_from_rows(period, size, src, "finish < ?"), (until, until))


def mark_dirty(conn: sqlite3.Connection, windows: list, rolled: float | None) -> None:
    """Hours already rolled that `windows` (WindowRows) overlap: recomputed next pass."""
    if rolled is None:
        return
    hours = set()
    for w in windows:
        start, end = w[1], w[2]
        h = math.floor(start / HOUR) * HOUR
        while h < min(end, rolled):
            hours.add(h)
            h += HOUR
    if hours:
        conn.executemany("INSERT OR IGNORE INTO dirty_hours VALUES (?)", [(h,) for h in hours])


_WINDOWS_OF_HOUR = """SELECT start, "end", model, measured_gpu_s, attributed_gpu_s, idle_gpu_s,
    unattributed_gpu_s, measured_j, attributed_j, idle_j, unattributed_j
FROM device_windows WHERE start >= ? AND start < ? AND "end" > ?"""


def _hour_of_windows(conn, h: float, longest: float) -> tuple[list[tuple], float]:
    """The windows overlapping [h, h + 1 h), each clipped to it (prorated by its
    overlap, as `allocation.window_pots` clips at a report's edges): rows per model, and
    the wall-clock time covered (distinct spans, as the report counts node overhead)."""
    h1 = h + HOUR
    sums: dict[str, list] = {}
    spans = set()
    for (start, end, model, meas_s, att_s, idle_s, unatt_s, meas_j, att_j, idle_j,
         unatt_j) in conn.execute(_WINDOWS_OF_HOUR, (h - longest, h1, h)):
        a, b = max(start, h), min(end, h1)
        if b <= a or end <= start:
            continue
        f = (b - a) / (end - start)
        meas_s = meas_s or 0.0
        att_s = att_s or 0.0
        used = att_s / meas_s if meas_s > 0 else 0.0
        first = start >= h
        s = sums.setdefault(model, [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 0, 0])
        s[0] += int(first)
        s[1] += meas_s * f
        s[2] += att_s * f
        s[3] += (idle_s or 0.0) * f
        s[4] += (unatt_s or 0.0) * f
        s[5] += (meas_j or 0.0) * f
        s[6] += (att_j or 0.0) * f
        s[7] += (idle_j or 0.0) * f
        s[8] += (unatt_j or 0.0) * f
        s[9] += int(first and meas_j is None)
        s[10] += b - a
        s[11] += (b - a) * used
        s[12] += int(not first)                 # begun in an earlier hour (a report that
        s[13] += int(not first and meas_j is None)     # starts here counts it, see below)
        spans.add((a, b))
    return [(h, model, *s) for model, s in sums.items()], sum(b - a for a, b in spans)


def _write_hour(conn, h: float, longest: float) -> bool:
    """Recompute one hour's window rollups; whether any window overlaps it."""
    rows, covered = _hour_of_windows(conn, h, longest)
    conn.execute("DELETE FROM window_rollups WHERE hour = ?", (h,))
    conn.execute("DELETE FROM window_cover WHERE hour = ?", (h,))
    if rows:
        conn.executemany(f"INSERT INTO window_rollups VALUES ({', '.join('?' * len(WINDOW_COLUMNS))})",
                         rows)
        conn.execute("INSERT INTO window_cover VALUES (?, ?)", (h, covered))
    return bool(rows)


def roll_windows(conn: sqlite3.Connection, now: float) -> None:
    w1 = math.floor((now - LAG_S) / HOUR) * HOUR
    while True:
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            longest = meta(conn, "max_window_s") or 0.0
            h = meta(conn, WINDOWS_ROLLED)
            if h is None:
                (first,) = conn.execute("SELECT min(start) FROM device_windows").fetchone()
                if first is None:
                    break
                h = math.floor(first / HOUR) * HOUR
            if h >= w1:
                break
            for _ in range(24):
                if h >= w1:
                    break
                if _write_hour(conn, h, longest):
                    h += HOUR
                    continue
                # an hour no window overlaps: none before the next window's start does
                (nxt,) = conn.execute("SELECT min(start) FROM device_windows WHERE start >= ?",
                                      (h + HOUR,)).fetchone()
                h = w1 if nxt is None else min(w1, max(h + HOUR, math.floor(nxt / HOUR) * HOUR))
            _set(conn, WINDOWS_ROLLED, h)
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        longest = meta(conn, "max_window_s") or 0.0
        dirty = [h for (h,) in conn.execute("SELECT hour FROM dirty_hours ORDER BY hour")]
        for h in dirty:
            _write_hour(conn, h, longest)
        conn.executemany("DELETE FROM dirty_hours WHERE hour = ?", [(h,) for h in dirty])


# ---- reading (reports) -----------------------------------------------------------------

def _ceil(t: float, size: float) -> float:
    return math.ceil(t / size) * size


def _floor(t: float, size: float) -> float:
    return math.floor(t / size) * size


def usage_segments(query, since: float, until: float) -> list[tuple[str, float, float]]:
    """[since, until) as pieces to read: ('day' | 'hour' | 'slice', a, b) from the
    rollups, ('raw', a, b) from the request rows: whole rolled days, whole rolled hours
    around them, then whole rolled 10-s slices at the edges, raw rows for the seconds at
    the very edges and what is not rolled yet."""
    got = dict(query("SELECT key, value FROM meta WHERE key IN (?, ?, ?)",
                     (SLICES_ROLLED, HOURS_ROLLED, DAYS_ROLLED)))
    mr, hr, dr = got.get(SLICES_ROLLED), got.get(HOURS_ROLLED), got.get(DAYS_ROLLED)
    out: list[tuple[str, float, float]] = []
    rest = [(since, until)]
    if hr is not None:
        h0, h1 = _ceil(since, HOUR), min(_floor(until, HOUR), float(hr))
        if h1 > h0:
            d0, d1 = _ceil(h0, DAY), min(_floor(h1, DAY), float(dr) if dr is not None else h0)
            if d1 > d0:
                out += [("hour", h0, d0)] if h0 < d0 else []
                out.append(("day", d0, d1))
                out += [("hour", d1, h1)] if d1 < h1 else []
            else:
                out.append(("hour", h0, h1))
            rest = [(since, h0), (h1, until)]
    for a, b in rest:
        if b <= a:
            continue
        m0, m1 = _ceil(a, SLICE), _floor(b, SLICE)
        if mr is not None:
            m1 = min(m1, float(mr))
        if mr is None or m1 <= m0:
            out.append(("raw", a, b))
            continue
        if a < m0:
            out.append(("raw", a, m0))
        out.append(("slice", m0, m1))
        if m1 < b:
            out.append(("raw", m1, b))
    return out


def window_segments(query, b0: float, b1: float) -> list[tuple[str, float, float]]:
    """[b0, b1) as ('hour', a, b) read from the window rollups and ('raw', a, b) read
    from the device windows: the edges, the hours not rolled yet, and dirty hours."""
    row = query("SELECT value FROM meta WHERE key = ?", (WINDOWS_ROLLED,))
    wr = float(row[0][0]) if row and row[0][0] is not None else None
    if wr is None:
        return [("raw", b0, b1)]
    h0, h1 = _ceil(b0, HOUR), min(_floor(b1, HOUR), wr)
    if h1 <= h0:
        return [("raw", b0, b1)]
    out = [("raw", b0, h0)] if b0 < h0 else []
    cur = h0
    for (d,) in query("SELECT hour FROM dirty_hours WHERE hour >= ? AND hour < ? ORDER BY hour",
                      (h0, h1)):
        if d > cur:
            out.append(("hour", cur, d))
        out.append(("raw", d, d + HOUR))
        cur = d + HOUR
    if cur < h1:
        out.append(("hour", cur, h1))
    if h1 < b1:
        out.append(("raw", h1, b1))
    return out


WINDOW_HOURS_SQL = """SELECT model, sum(windows), sum(measured_gpu_s), sum(attributed_gpu_s),
    sum(idle_gpu_s), sum(unattributed_gpu_s), sum(measured_j), sum(attributed_j), sum(idle_j),
    sum(unattributed_j), sum(unmeasured), sum(wall_s), sum(used_wall_s)
FROM window_rollups WHERE hour >= ? AND hour < ? GROUP BY model"""
COVER_SQL = "SELECT sum(covered_s) FROM window_cover WHERE hour >= ? AND hour < ?"
# A report counts each window once, where it begins or, if it began earlier, in its
# first piece: a report that starts on this hour counts the windows carried into it.
CARRIED_SQL = """SELECT model, carried, carried_unmeasured FROM window_rollups
WHERE hour = ? AND carried > 0"""


def usage_sql(keys: list[str], by_phase: bool) -> str:
    """The rollups' figures per `keys`, in the columns reports.py's raw query gives."""
    n = "sum(requests)" if by_phase else "sum(CASE WHEN phase = 'prefill' THEN requests ELSE 0 END)"
    jn = "sum(j_null)" if by_phase else "sum(j_null_req)"
    k = ", ".join(keys)
    return (f"SELECT {k}, {n}, sum(pt), sum(ot), sum(gpu_s), sum(j), {jn}, sum(cu), sum(op), "
            f"sum(emb), min(measured), max(simulated), min(imin), max(imax), "
            f"group_concat(DISTINCT sources), group_concat(DISTINCT kinds), max(est) "
            f"FROM usage_rollups WHERE period = ? AND bucket >= ? AND bucket < ? GROUP BY {k}")
