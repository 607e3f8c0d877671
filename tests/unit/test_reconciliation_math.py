"""Reconciliation's arithmetic (issue 22 §4): counter series interpolated across resets,
the ledger's windows prorated, a window without energy a gap, the span cut to what both
sides cover, starting at the ledger's first window boundary inside the counters' span.
(On real daemons: tests/integration/test_reconciliation.py.)"""
from __future__ import annotations

import sqlite3

import pytest
from appliance.accounting.reconcile import (FIRST_WINDOW_SQL, CounterSeries, Counters, gap,
                                            ledger_side, reconcile)


# ---- arithmetic ---------------------------------------------------------------------

def test_counter_series_interpolates_and_survives_a_reset():
    s = CounterSeries()
    for t, v in [(0, 0.0), (10, 100.0), (20, 200.0)]:
        s.add(t, v)
    assert s.delta(5, 15) == pytest.approx(100.0)
    assert s.delta(-1, 5) is None and s.delta(5, 21) is None      # outside the readings
    s.add(30, 50.0)                 # the counter restarted (a daemon restart) and counted 50
    assert s.delta(10, 30) == pytest.approx(100.0 + 50.0)


def test_ledger_side_prorates_windows_and_a_window_without_energy_is_a_gap():
    rows = [("g0", 0.0, 10.0, 8.0, 1000.0), ("g0", 10.0, 20.0, 4.0, None),
            ("g1", 0.0, 100.0, 0.0, 5000.0)]                  # an idle stretch
    busy, joules, devices = ledger_side(rows, 5.0, 15.0)
    assert busy == pytest.approx(4.0 + 2.0)
    assert joules == pytest.approx(500.0 + 500.0)             # the unread window adds nothing
    assert devices == {"g0", "g1"}
    assert gap(90.0, 100.0) == pytest.approx(-0.1) and gap(0.0, 0.0) == 0.0
    assert gap(1.0, 0.0) == 1.0 and gap(1.0, None) is None


def test_reconcile_cuts_the_span_to_what_both_sides_cover():
    c = Counters()
    for t in range(100, 201):
        c.sample_busy(float(t), 2.0 * (t - 100))               # 2 busy devices all along
        c.sample_energy("g0", float(t), 300.0 * (t - 100))
    rows = [("g0", float(t), float(t + 10), 10.0, 3000.0) for t in range(0, 200, 10)]
    seen = []

    def query(sql, args):
        if sql == FIRST_WINDOW_SQL:
            return [(min((r[1] for r in rows if args[0] <= r[1] < args[1]), default=None),)]
        seen.append(args)
        return [r for r in rows if r[2] > args[0] and r[1] < args[1]]

    r = reconcile(query, c, ["g0"], since=0.0, until=250.0, now=200.0, lag_s=20.0)
    assert (r.since, r.until) == (100.0, 180.0) and seen == [(100.0, 180.0)]
    j = r.as_json()
    # the ledger holds one busy device (g0), the counters two: half is missing
    assert j["gpu_seconds"]["ledger"] == pytest.approx(80.0)
    assert j["gpu_seconds"]["telemetry"] == pytest.approx(160.0)
    assert j["gpu_seconds"]["gap"] == pytest.approx(-0.5)
    assert j["energy_joules"]["gap"] == pytest.approx(0.0, abs=1e-9)
    assert "not closed in the ledger yet" in j["note"]


def test_a_run_that_starts_busy_shows_no_gap_at_the_counters_first_sample():
    """The engine is busy from t = 5 on; the daemon's counters start at t = 6, inside
    the ledger's first window [0, 10) (5 busy seconds, all after 5). Prorating that
    window over [6, 10) would count 2 s where the counters saw 4 (a -1.2 % gap from
    the edge alone): the span starts at the ledger's next window boundary instead."""
    db = sqlite3.connect(":memory:")
    db.execute('CREATE TABLE device_windows (device, start, "end", attributed_gpu_s, '
               'unattributed_gpu_s, measured_j)')
    db.executemany("INSERT INTO device_windows VALUES (?, ?, ?, ?, 0, NULL)",
                   [("g0", float(t), t + 10.0, 5.0 if t == 0 else 10.0) for t in range(0, 200, 10)])
    c = Counters()
    for t in range(6, 201):
        c.sample_busy(float(t), t - 5.0)
    r = reconcile(lambda sql, args=(): db.execute(sql, args).fetchall(), c, [], since=0.0,
                  until=200.0, now=200.0, lag_s=20.0)
    assert (r.since, r.until) == (10.0, 180.0)
    assert r.gpu_ledger == pytest.approx(170.0) and r.gpu_telemetry == pytest.approx(170.0)
    assert abs(r.as_json()["gpu_seconds"]["gap"]) < 1e-9
