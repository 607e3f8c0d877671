"""A ledger at scale: what a request costs on disk, and how long a 24-hour and a 30-day
usage report take, through the report functions `/admin/v1/usage` calls.

It synthesizes the ledger a busy box would hold after `--days` at `--rate` requests/s:
the old days as the rollups the writer would have left (hour rows for every hour, 10-s
slice rows and raw rows only where a report's edges fall, and slice rows for the part of the
current hour before the raw rows), the last `--raw-hours` as raw
request rows and 10-s device windows, which the real roll-up pass (rollups.roll_up)
then rolls, leaving the newest seconds raw as a live ledger does. Then it times the
reports (each the best of `--repeat`), a raw-only report over the raw hours (what
every report cost before rollups), and prints bytes per request.

    .venv/bin/python bench/bench_ledger.py                        # 30 days at 1,000 req/s
    .venv/bin/python bench/bench_ledger.py --raw-hours 0.25       # a quicker run

The full size writes 3.6 M raw rows per raw hour (~1 GB, minutes on a quiet machine).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance.accounting import reports, rollups  # noqa: E402
from appliance.accounting.ledger import (REQUEST_COLUMNS, Ledger, LedgerReader,  # noqa: E402
                                         WINDOW_COLUMNS, write_rows)

H = 3600.0
PHASES = ("prefill", "decode")


def request_rows(t0: float, t1: float, rate: float, tenants, models, site, start_id: int):
    """Request rows finishing evenly over [t0, t1) at `rate` per second, in chunks."""
    n = int((t1 - t0) * rate)
    step = 1.0 / rate
    rng = random.Random(int(t0))
    chunk = []
    for i in range(n):
        finish = t0 + i * step
        tenant = tenants[rng.randrange(len(tenants))]
        model = models[i % len(models)]
        pt, ot = 200 + (i % 1800), 50 + (i % 450)
        pg, dg = 0.002 + pt * 1e-5, 0.01 + ot * 2e-4
        chunk.append((f"r{start_id + i:012d}", tenant, model, site, "app1", "chat", "ok", "stop",
                      finish - 3.0, finish - 2.5, finish, pt, ot, 0, 1, "p0", "d0", pg, dg,
                      pg * 600.0, dg * 400.0, pg * 0.001, dg * 0.001, pg * 0.0012, dg * 0.0012,
                      pg * 0.12, dg * 0.08, pg * 0.005, dg * 0.005, 480.0, "static", "average",
                      0, "", 1.56, "simulated", 1, 0, 1, 0, 0))
        if len(chunk) == 100_000:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def window_rows(t0: float, t1: float, devices: int, model: str, site: str, busy: float):
    out = []
    t = t0
    while t < t1:
        for d in range(devices):
            out.append((f"g{d}", t, t + 10.0, site, "app1", model, 10.0, 10.0 * busy,
                        10.0 * (1 - busy), 0.0, 10.0 * (70 + 630 * busy), 10.0 * 630 * busy,
                        700.0 * (1 - busy), 0.0, "simulated", 20, 1, 0, 0.0, 0.0))
        t += 10.0
    return out


def rollup_rows(period: str, t0: float, t1: float, rate: float, tenants, models, site):
    """What the writer would have rolled for [t0, t1): a row per bucket × tenant × model ×
    phase with the sums of `rate` requests/s spread over the tenants and models."""
    size = rollups.SLICE if period == "slice" else H
    per = rate * size / (len(tenants) * len(models))
    out = []
    b = t0
    while b < t1:
        for tenant in tenants:
            for model in models:
                for phase in PHASES:
                    pre = phase == "prefill"
                    gpu = per * (0.011 if pre else 0.065)
                    out.append((period, b, tenant, model, site, phase, int(per),
                                int(per * 1100) if pre else 0, 0 if pre else int(per * 275), gpu,
                                gpu * (600 if pre else 400), 0, 0, gpu * 0.001, gpu * 0.1,
                                gpu * 0.005, 0, 1, 480.0, 480.0, "static", "average", 0))
        b += size
    return out


def window_rollup_rows(t0: float, t1: float, devices: int, model: str, busy: float):
    rows, cover = [], []
    h = t0
    while h < t1:
        s = devices * H
        rows.append((h, model, devices * 360, s, s * busy, s * (1 - busy), 0.0,
                     s * (70 + 630 * busy), s * 630 * busy, 700.0 * s * (1 - busy), 0.0, 0, s,
                     s * busy, 0, 0))
        cover.append((h, H))
        h += H
    return rows, cover


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=1000.0, help="requests per second")
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--raw-hours", type=float, default=1.0, help="raw rows at the end")
    p.add_argument("--tenants", type=int, default=20)
    p.add_argument("--models", type=int, default=2)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the ledger goes (default: a temp dir)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ledger.json"))
    args = p.parse_args()

    tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench-ledger-"))
    path = tmp / "ledger.db"
    for f in tmp.glob("ledger.db*"):
        f.unlink()
    Ledger(path, retention_days=0).stop()           # the schema, as the daemon makes it
    tenants = [f"t{i:02d}" for i in range(args.tenants)]
    models = [f"model-{i}" for i in range(args.models)]
    site = "s1"
    now = time.time()
    end = now
    raw_start = math.floor((end - args.raw_hours * H) / rollups.SLICE) * rollups.SLICE
    old_start = math.floor((end - args.days * 86400) / H) * H
    edges = [end - 86400, end - args.days * 86400]      # the reports' left edges
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")

    t = time.perf_counter()
    # ---- the old days: rollups (hours; slices and raw rows only at the reports' edges)
    hour0 = math.floor(raw_start / H) * H           # hours before the raw ones are rolled
    with conn:
        write_rows(conn, "INSERT", "usage_rollups", rollups.USAGE_COLUMNS,
                   rollup_rows("hour", old_start, hour0, args.rate, tenants, models, site))
        wr, cover = window_rollup_rows(old_start, hour0, args.devices, models[0], 0.6)
        write_rows(conn, "INSERT", "window_rollups", rollups.WINDOW_COLUMNS, wr)
        write_rows(conn, "INSERT", "window_cover", ("hour", "covered_s"), cover)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s_roll = size(path)
    with conn:
        n_edge = 0
        for e in edges:
            h = math.floor(e / H) * H
            if h >= hour0:
                continue
            write_rows(conn, "INSERT", "usage_rollups", rollups.USAGE_COLUMNS,
                       rollup_rows("slice", h, h + H, args.rate, tenants, models, site))
            m = math.floor(e / rollups.SLICE) * rollups.SLICE
            for chunk in request_rows(m, m + rollups.SLICE, args.rate, tenants, models, site,
                                      10**11 + n_edge):
                write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, chunk)
                n_edge += len(chunk)
            write_rows(conn, "INSERT", "device_windows", WINDOW_COLUMNS,
                       window_rows(m - 60.0, m + 120.0, args.devices, models[0], site, 0.6))
        # the hour the raw rows start in: its first slices are rolled, the hour is not
        write_rows(conn, "INSERT", "usage_rollups", rollups.USAGE_COLUMNS,
                   rollup_rows("slice", hour0, raw_start, args.rate, tenants, models, site))
        for key, value in ((rollups.SLICES_ROLLED, raw_start), (rollups.HOURS_ROLLED, hour0),
                           (rollups.WINDOWS_ROLLED, hour0)):
            conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('max_window_s', 10.0)")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s_old = size(path)
    t_old = time.perf_counter() - t

    # ---- the last hours: raw rows and windows, then the real roll-up pass
    t = time.perf_counter()
    n_raw = 0
    for chunk in request_rows(raw_start, end, args.rate, tenants, models, site, 0):
        with conn:
            write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, chunk)
        n_raw += len(chunk)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s_req = size(path)
    with conn:
        write_rows(conn, "INSERT", "device_windows", WINDOW_COLUMNS,
                   window_rows(hour0, math.floor(end / 10) * 10 - 10, args.devices, models[0],
                               site, 0.6))
    t_raw = time.perf_counter() - t
    t = time.perf_counter()
    rollups.roll_up(conn, end)
    t_roll = time.perf_counter() - t
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    s_all = size(path)
    bytes_per_request = (s_req - s_old) / n_raw
    old_requests = args.rate * (raw_start - old_start)
    rollup_bytes = s_roll / old_requests if old_requests else float("nan")

    # ---- the reports, as /admin/v1/usage runs them
    reader = LedgerReader(path, timeout_s=0)
    method = reports.default_method("share")
    method.tenant_tags = {t: {"team": f"team-{i % 4}"} for i, t in enumerate(tenants)}
    dims = list(reports.USAGE_DIMS)
    out = {}
    for name, since in (("24h", end - 86400), (f"{args.days:g}d", end - args.days * 86400)):
        for by in (dims, ["tag:team"]):
            secs, rep = timed(lambda: reports.usage(reader, by, since, end, method=method),
                              args.repeat)
            out[(name, ",".join(by))] = (secs, sum(r["requests"] for r in rep["rows"]
                                               if r.get("phase") in (None, "prefill")))
    # what a report over raw rows costs per hour of traffic (the path before rollups)

    class RawOnly:
        def query(self, sql, a=()):
            if any(x in (rollups.SLICES_ROLLED, rollups.HOURS_ROLLED, rollups.DAYS_ROLLED,
                         rollups.WINDOWS_ROLLED) for x in a):
                return []
            return reader.query(sql, a)

    span = min(end - raw_start, H)
    raw_secs, _ = timed(lambda: reports.usage(RawOnly(), dims, end - span, end, method=method), 1)
    raw_per_hour = raw_secs * H / span
    reader.close()

    print(f"ledger {path}: {s_all / 1e9:.2f} GB after {args.days:g} days at {args.rate:g} req/s "
          f"({args.raw_hours:g} h raw, {args.tenants} tenants x {args.models} models x 2 phases)")
    print(f"raw rows: {n_raw + n_edge:,}; synthesized in {t_old + t_raw:.1f} s; "
          f"roll-up pass over them {t_roll:.1f} s ({t_roll / max(n_raw, 1) * 1e6:.2f} us/request)")
    print(f"bytes per request: raw {bytes_per_request:.0f} B "
          f"(= {bytes_per_request * args.rate * 86400 / 1e9:.1f} GB/day at {args.rate:g} req/s); "
          f"rolled up {rollup_bytes:.4f} B")
    for (name, by), (secs, n) in out.items():
        print(f"report {name:>4} group_by={by:<26} {secs * 1000:8.1f} ms  ({n:,} requests)")
    print(f"raw-only report over the last {span / 60:g} min: {raw_secs:.2f} s "
          f"(~{raw_per_hour * 24:.0f} s for 24 h of raw rows at this rate)")
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
              "ledger_bytes": s_all, "raw_rows": n_raw + n_edge,
              "raw_bytes_per_request": bytes_per_request,
              "rollup_bytes_per_request": rollup_bytes, "rollup_pass_s": t_roll,
              "reports_s": {f"{name} {by}": secs for (name, by), (secs, _) in out.items()},
              "raw_only_report_s": raw_secs, "raw_only_span_s": span}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    if not args.dir:
        for f in tmp.glob("ledger.db*"):
            f.unlink()
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
