"""A ledger that scales (issue 22 §6): reports over whole hours read the 10-s slice and hour
rollups and give the figures the raw rows give; late rows and windows reach the
rollups; raw retention is bounded by size and never drops what is not rolled up; a
report query that runs out of time is stopped and answered as an error.

Real SQLite ledgers, written by the real accountant (test_allocation's scene) or row by
row through the real writer. (The report timeout through a real daemon and the CLI:
tests/integration/test_ledger_scale_daemon.py.)
"""
from __future__ import annotations

import random
import sqlite3
import time

import pytest

from appliance.accounting import reports, rollups
from appliance.accounting.ledger import (REQUEST_COLUMNS, Ledger, LedgerReader, ReportTimeout,
                                         RequestRow, WindowRow, write_rows)
from helpers.ledger_rows import row, seed
from helpers.ledger_scene import T0, capacity_of, ledger_with, method

H = 3600.0
H0 = (T0 // H) * H                      # the hour T0 is in (T0 is 800 s into it)
TAGS = {"ta": {"team": "search"}, "tb": {"team": "search"}, "tc": {"team": "ads"}}
# requests in four hours, with hours and minutes of nothing between them
rng = random.Random(22)
RUNS = [(f"R{i}", rng.choice(["ta", "tb", "tc"]), T0 + t, rng.uniform(0.2, 2.0),
         rng.uniform(0.3, 3.0))
        for i, t in enumerate([1, 30, 95, 500, 2700, 2790, 4000, 6100, 9000, 9050, 12000])]
END = T0 + 12100


class RawOnly:
    """The same file read as if nothing were rolled up: every piece comes from the raw
    rows and windows (the path reports took before rollups)."""

    def __init__(self, led):
        self.led = led

    def query(self, sql, args=()):
        if any(a in (rollups.SLICES_ROLLED, rollups.HOURS_ROLLED, rollups.DAYS_ROLLED,
                     rollups.WINDOWS_ROLLED) for a in args):
            return []
        return self.led.query(sql, args)


def tagged(policy="share"):
    m = method(policy, per_kwh=0.3, node_w=1000.0)
    m.tenant_tags = TAGS
    return m


def rows_by(rep, dims):
    return {tuple(r[d] for d in dims): r for r in rep["rows"]}


def same_report(a, b, dims):
    ra, rb = rows_by(a, dims), rows_by(b, dims)
    assert ra.keys() == rb.keys()
    for k in ra:
        for f in ("requests", "prompt_tokens", "output_tokens", "gpu_seconds", "energy_joules",
                  "cost_usage", "cost_allocation", "co2e_grams", "requests_without_energy",
                  "co2e_complete"):
            assert ra[k][f] == pytest.approx(rb[k][f], rel=1e-9, abs=1e-12), (k, f)
    for f in ("capacity_cost", "measured_gpu_seconds", "measured_energy_joules",
              "node_overhead_energy_joules"):
        x, y = a["totals"][f], b["totals"][f]
        assert (x is None and y is None) or x == pytest.approx(y, rel=1e-9), f


@pytest.fixture(scope="module")
def led(tmp_path_factory):
    ledger = ledger_with(tmp_path_factory.mktemp("scale"), RUNS, end=END)
    yield ledger
    ledger.stop()


D0 = (T0 // 86400) * 86400             # the UTC day T0 is in (the runs cross into the next)
SPANS = [(H0, H0 + 4 * H), (H0 + H, H0 + 3 * H), (T0 + 0.4, END - 50.7), (T0 + 61.3, T0 + 7299.9),
         (H0 + H, T0 + 9030.5), (T0 + 20, T0 + 200), (D0, D0 + 2 * 86400),
         (D0 - H - 0.5, D0 + 2 * 86400 + 100.0)]


def test_the_rollups_hold_every_hour_and_slice(led):
    meta = dict(led.query("SELECT key, value FROM meta"))
    assert meta[rollups.HOURS_ROLLED] >= H0 + 4 * H
    assert meta[rollups.WINDOWS_ROLLED] >= H0 + 4 * H
    n_hour = led.query("SELECT sum(requests) FROM usage_rollups WHERE period = 'hour' "
                       "AND phase = 'prefill'")
    n_slice = led.query("SELECT sum(requests) FROM usage_rollups WHERE period = 'slice' "
                        "AND phase = 'decode'")
    n_day = led.query("SELECT sum(requests) FROM usage_rollups WHERE period = 'day' "
                      "AND phase = 'prefill'")
    assert n_hour == n_slice == n_day == [(len(RUNS),)]
    assert meta[rollups.DAYS_ROLLED] >= D0 + 2 * 86400
    # a two-day report reads the two days' rows, a span of hours and days all three kinds
    assert [k for k, _, _ in rollups.usage_segments(led.query, D0, D0 + 2 * 86400)] == ["day"]
    kinds = [k for k, _, _ in rollups.usage_segments(led.query, D0 - H - 0.5, D0 + 2 * 86400 + 100)]
    assert kinds == ["hour", "day", "raw", "slice"]
    # the windows, clipped to the hours, hold every device-second the windows hold
    (total,) = led.query("SELECT sum(measured_gpu_s) FROM device_windows")[0]
    (rolled,) = led.query("SELECT sum(measured_gpu_s) FROM window_rollups")[0]
    assert rolled == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize("policy", ["share", "idle"])
@pytest.mark.parametrize("dims", [["tenant", "model", "phase", "site"], ["tenant"],
                                  ["tag:team"], ["tag:team", "phase"], ["model", "site"]])
def test_reports_through_the_rollups_give_the_raw_rows_figures(led, policy, dims):
    for since, until in SPANS:
        rolled = reports.usage(led, dims, since, until, method=tagged(policy))
        raw = reports.usage(RawOnly(led), dims, since, until, method=tagged(policy))
        same_report(rolled, raw, dims)
        # and the allocation adds up to the devices' capacity cost of any window
        billed = sum(r["cost_allocation"] for r in rolled["rows"])
        assert billed == pytest.approx(capacity_of(led, since, until, per_kwh=0.3,
                                                   node_w=1000.0), rel=0.005)


def test_carbon_through_the_rollups(led):
    since, until = T0 + 0.4, END - 50.7
    a = reports.carbon(led, ["site", "tenant"], since, until, method=tagged())
    b = reports.carbon(RawOnly(led), ["site", "tenant"], since, until, method=tagged())
    assert a["totals"]["co2e_grams"] == pytest.approx(b["totals"]["co2e_grams"], rel=1e-9)
    assert sum(r["co2e_grams"] for r in a["rows"]) == pytest.approx(a["totals"]["co2e_grams"],
                                                                    rel=0.005)


def test_whole_hours_are_answered_by_the_rollups_alone(tmp_path, led):
    """Delete the raw rows and windows of the middle hours: a report over whole hours
    gives the same figures (it never read them), the raw path does not."""
    path = tmp_path / "copy.db"
    src = sqlite3.connect(led.path)
    dst = sqlite3.connect(path)
    src.backup(dst)
    src.close()
    before = reports.usage(led, ["tenant", "phase"], H0 + H, H0 + 3 * H, method=tagged())
    dst.execute("DELETE FROM requests WHERE finish >= ? AND finish < ?", (H0 + H, H0 + 3 * H))
    dst.execute('DELETE FROM device_windows WHERE start >= ? AND "end" <= ?', (H0 + H, H0 + 3 * H))
    dst.commit()
    dst.close()
    copy = LedgerReader(path)
    after = reports.usage(copy, ["tenant", "phase"], H0 + H, H0 + 3 * H, method=tagged())
    same_report(after, before, ["tenant", "phase"])
    assert before["rows"] and before["totals"]["capacity_cost"] > 0
    raw = reports.usage(RawOnly(copy), ["tenant", "phase"], H0 + H, H0 + 3 * H, method=tagged())
    assert raw["totals"]["capacity_cost"] < 0.5 * before["totals"]["capacity_cost"]
    copy.close()


# ---- late rows and windows ---------------------------------------------------------



def window(device: str, start: float, end: float, busy: float = 0.0) -> WindowRow:
    span = end - start
    return WindowRow(device, start, end, "s1", "app1", "H100-SXM", span, busy, span - busy, 0.0,
                     100.0 * span, 500.0 * busy, 100.0 * span - 500.0 * busy, 0.0, "measured",
                     1, 0, 0, 0.0, 0.0)


def hour_requests(q, h: float, period: str = "hour") -> int:
    ((n,),) = q("SELECT sum(requests) FROM usage_rollups WHERE period = ? AND bucket >= ? "
                "AND bucket < ? AND phase = 'prefill'", (period, h, h + H))
    return n or 0


def test_a_row_finalized_after_its_hour_was_rolled_up_is_added_to_it(tmp_path):
    path = tmp_path / "ledger.db"
    led = Ledger(path, flush_interval_s=0.05, retention_days=0)
    led.start()
    for i in range(5):
        led.put_request(row(f"A{i}", "ta", H0 + 100 + i))
        led.put_window(window("g0", H0 + 10 * i, H0 + 10 * i + 10, busy=1.0))
    assert led.flush()
    led.stop()
    led = Ledger(path, flush_interval_s=0.05, retention_days=0)     # rolls the old hours up
    assert hour_requests(led.query, H0) == 5
    led.start()
    # a late row in that hour, one already there (written again), a late window
    led.put_request(row("LATE", "tb", H0 + 1800, gpu=2.0))
    led.put_request(row("A0", "ta", H0 + 100))
    led.put_window(window("g1", H0 + 2000, H0 + 2010, busy=4.0))
    assert led.flush()
    assert hour_requests(led.query, H0) == 6                        # LATE once, A0 not again
    assert hour_requests(led.query, H0, "slice") == 6
    assert led.query("SELECT sum(requests) FROM usage_rollups WHERE period = 'day' "
                     "AND phase = 'prefill'") == [(6,)]
    ((gpu,),) = led.query("SELECT sum(gpu_s) FROM usage_rollups WHERE period = 'hour'")
    assert gpu == pytest.approx(5 * 1.0 + 2.0)
    # the late window marked its hour dirty: reports read it raw until it is recomputed
    assert led.query("SELECT hour FROM dirty_hours") == [(H0,)]
    m = method("share")
    rep = reports.usage(led, ["tenant"], H0, H0 + H, method=m)
    assert rep["totals"]["measured_gpu_seconds"] == pytest.approx(60.0)
    assert {r["tenant"]: r["requests"] for r in rep["rows"]} == {"ta": 5, "tb": 1}
    led.stop()
    led = Ledger(path, retention_days=0)        # the next pass recomputes the dirty hour
    assert led.query("SELECT count(*) FROM dirty_hours") == [(0,)]
    assert led.query("SELECT sum(measured_gpu_s), sum(attributed_gpu_s) FROM window_rollups") == [
        (60.0, 9.0)]
    # with the raw rows gone the hour still counts the late row (added, not recomputed)
    db = sqlite3.connect(path)
    db.execute("DELETE FROM requests")
    db.commit()
    db.close()
    rep2 = reports.usage(led, ["tenant"], H0, H0 + H, method=m)
    assert {r["tenant"]: r["requests"] for r in rep2["rows"]} == {"ta": 5, "tb": 1}
    assert sum(r["gpu_seconds"] for r in rep2["rows"]) == pytest.approx(7.0)
    led.stop()


def test_a_recovered_request_in_a_rolled_hour_is_added_to_it(tmp_path):
    """A request committed only as pending (the process died before its windows closed)
    becomes an `incomplete` row at the next start; if its hour was rolled meanwhile,
    the rollups gain it."""
    path = tmp_path / "ledger.db"
    led = Ledger(path, flush_interval_s=0.05, retention_days=0)
    led.start()
    led.put_request(row("A", "ta", H0 + 100))
    led.put_provisional(row("P", "tb", H0 + 200, final=0))
    assert led.flush()
    # the process dies here (no stop), and the hour is rolled up before the next start
    # (recovery comes before the start's own roll-up, so roll it from a connection here)
    conn = sqlite3.connect(path)
    rollups.roll_up(conn, time.time())
    conn.close()
    assert hour_requests(lambda s, a: sqlite3.connect(path).execute(s, a).fetchall(), H0) == 1
    led2 = Ledger(path, retention_days=0)
    assert led2.recovered == 1
    assert hour_requests(led2.query, H0) == 2
    assert led2.query("SELECT tenant, incomplete FROM requests ORDER BY 1") == [("ta", 0), ("tb", 1)]
    led2.stop()
    led.stop()


# ---- retention ------------------------------------------------------------------------



def test_raw_retention_is_bounded_by_size_and_keeps_what_is_not_rolled_up(tmp_path):
    now = time.time()
    hour = (now // H) * H
    path = tmp_path / "ledger.db"
    seed(path, 30_000, hour - 6 * H, hour - H, "OLD")
    recent = [row(f"NEW{i}", "ta", now - 20 + i * 0.01) for i in range(500)]  # no hour rollup yet
    conn = sqlite3.connect(path)
    with conn:
        write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, recent)
    conn.close()
    # the figures before anything is pruned (every row still raw)
    led = LedgerReader(path)
    before = reports.usage(RawOnly(led), ["tenant"], hour - 6 * H, now + 1, method=method())
    led.close()
    size_before = path.stat().st_size
    assert size_before > 5e6
    led = Ledger(path, retention_days=0, retention_mb=2.0)
    ps, pc, free = (led.query(f"PRAGMA {p}")[0][0] for p in ("page_size", "page_count",
                                                             "freelist_count"))
    assert (pc - free) * ps <= 2.0e6
    ((old, new),) = led.query("SELECT sum(request_id LIKE 'OLD%'), sum(request_id LIKE 'NEW%') "
                              "FROM requests")
    assert new == 500 and (old or 0) < 30_000 // 2             # nothing unrolled went
    # nothing was lost: the rollups answer for the pruned rows
    after = reports.usage(led, ["tenant"], hour - 6 * H, now + 1, method=method())
    same_report(after, before, ["tenant"])
    # a size so small that every old row would have to go: still never an unrolled one
    led.stop()
    led = Ledger(path, retention_days=0, retention_mb=0.001)
    ((hours,),) = led.query("SELECT value FROM meta WHERE key = ?", (rollups.HOURS_ROLLED,))
    assert led.query("SELECT count(*) FROM requests WHERE finish >= ?", (hours,)) == [(500,)]
    assert led.query("SELECT count(*) FROM requests WHERE finish < ?", (hours,)) == [(0,)]
    same_report(reports.usage(led, ["tenant"], hour - 6 * H, now + 1, method=method()), before,
                ["tenant"])
    led.stop()


# ---- report timeout --------------------------------------------------------------------

def test_a_report_that_runs_out_of_time_is_stopped(tmp_path):
    path = tmp_path / "ledger.db"
    future = time.time() + 3 * H            # never rolled up: every report reads raw rows
    seed(path, 40_000, future, future + 600)
    slow = LedgerReader(path, timeout_s=1e-6)
    with pytest.raises(ReportTimeout, match="report_timeout_s"):
        reports.usage(slow, ["tenant", "phase"], future - 60, future + 900, method=method())
    slow.close()
    ok = LedgerReader(path, timeout_s=60)
    rep = reports.usage(ok, ["tenant", "phase"], future - 60, future + 900, method=method())
    assert sum(r["requests"] for r in rep["rows"] if r["phase"] == "prefill") == 40_000
    # the reader is usable after an interrupted query (the handler is cleared)
    assert ok.query("SELECT count(*) FROM requests") == [(40_000,)]
    ok.close()
