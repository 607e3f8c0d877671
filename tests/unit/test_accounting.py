"""Chargeback without HTTP: attribution, conservation, cost, carbon, budgets, the ledger.

The energy meter here is a deterministic stand-in for the telemetry hub (the boundary:
power readings of hardware we do not have); everything else is the real code on a real
SQLite file.
"""
from __future__ import annotations

import csv
import io
import json
import random
import sqlite3

import pytest

from appliance.accounting.accountant import Accountant, Site
from appliance.accounting.attribution import (
    Attributor, Calibration, DeviceInfo, PhaseWeights, entry_phase, request_of, take_readings,
)
from appliance.accounting.budgets import Budgets, period_start
from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon, parse_time
from appliance.accounting.cost import PriceBook
from appliance.accounting.ledger import Ledger, unpack_rows
from appliance.accounting.records import RequestRecord
from appliance.accounting import reports
from appliance.engines.messages import IterationRecord

T0 = 1_700_000_000.0        # a window boundary for 10 s windows (in the past)


class Meter:
    """Each device draws `idle_w` plus `active_w` while busy; the reading is exact."""

    def __init__(self, busy: dict[str, list[tuple[float, float]]], idle_w=100.0, active_w=500.0,
                 source="measured"):
        self.busy, self.idle_w, self.active_w, self.source = busy, idle_w, active_w, source

    def energy_j(self, device, t0, t1):
        on = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.busy.get(device, []))
        return self.idle_w * (t1 - t0) + self.active_w * on, self.source

    def idle_power_w(self, device):
        return self.idle_w


def it(worker, phase, start, wall, devices, entries, approximate=False):
    return IterationRecord(worker, phase, start, wall, tuple(devices), False, list(entries),
                           approximate)


def close_enough(a, b, rel=0.005):
    return abs(a - b) <= rel * max(abs(b), 1e-9)


def check_conserved(windows):
    for w in windows:
        assert w.attributed_gpu_s + w.idle_gpu_s + w.unattributed_gpu_s == \
            pytest.approx(w.measured_gpu_s, rel=0.005), w
        assert sum(s[0] for s in w.shares.values()) == pytest.approx(w.attributed_gpu_s, rel=1e-9)
        if w.measured_j is not None:
            assert w.attributed_j + w.idle_j + w.unattributed_j == \
                pytest.approx(w.measured_j, rel=0.005), w
            assert sum(s[1] for s in w.shares.values()) == pytest.approx(w.attributed_j, rel=1e-9)


# ---- attribution ------------------------------------------------------------------

def test_phase_and_request_of_entries():
    assert request_of("abc.2") == "abc" and request_of("abc") == "abc"
    assert entry_phase("prefill", 1) == "prefill"
    assert entry_phase("kv_import", 0) == "decode"
    assert entry_phase("mixed", 64) == "prefill" and entry_phase("mixed", 1) == "decode"


def test_iteration_split_by_weight_and_choices_fold_into_their_request():
    devs = [DeviceInfo("g0", "H100-SXM", "gpu", False)]
    cal = Calibration(min_iterations=10 ** 9)         # keep the defaults
    a = Attributor(devs, "m", 10.0, cal, start=T0)
    # decode step of 4 sequences: R (two choices) and S, T; default weight 1 each
    a.add(it("d0", "decode", T0 + 1, 2.0, ["g0"], [("R", 1, 10), ("R.1", 1, 10),
                                                     ("S", 1, 10), ("T", 1, 10)]))
    (w,) = a.close_until(T0 + 10, None)
    assert w.shares[("R", "decode")][0] == pytest.approx(1.0)
    assert w.shares[("S", "decode")][0] == pytest.approx(0.5)
    assert w.idle_gpu_s == pytest.approx(8.0) and w.measured_j is None
    check_conserved([w])


def test_calibration_recovers_the_cost_model_and_bills_context():
    """Iteration times drawn from a known cost model: the fit finds its coefficients, and
    the weights then bill a long-context decode more than a short one."""
    rng = random.Random(1)
    cal = Calibration(min_iterations=20)
    p_tok, p_ctx, d_seq, d_ctx = 2e-4, 1e-7, 5e-3, 2e-6
    for i in range(200):
        n = rng.randint(1, 4)
        es = [(f"p{i}.{j}", rng.randint(16, 2000), 0) for j in range(n)]
        es = [(r, new, new + rng.randint(0, 500)) for r, new, _ in es]
        wall = 0.003 + sum(new * (p_tok + p_ctx * (ctx - new / 2)) for _, new, ctx in es)
        cal.observe("k", it("p", "prefill", T0, wall, ["g"], es))
        m = rng.randint(1, 64)
        ds = [(f"d{i}.{j}", 1, rng.randint(10, 4000)) for j in range(m)]
        wall = 0.004 + sum(d_seq + d_ctx * ctx for *_, ctx in ds)
        cal.observe("k", it("d", "decode", T0, wall, ["g"], ds))
    w = cal.weights("k")
    assert w.calibrated
    assert w.p_tok == pytest.approx(p_tok, rel=1e-3) and w.p_ctx == pytest.approx(p_ctx, rel=1e-3)
    assert w.d_seq == pytest.approx(d_seq, rel=1e-3) and w.d_ctx == pytest.approx(d_ctx, rel=1e-3)
    # the intercept is kept: the shared part of a step
    assert w.p_c0 == pytest.approx(0.003, rel=1e-3) and w.d_c0 == pytest.approx(0.004, rel=1e-3)
    shown = cal.describe()["k"]
    assert shown["decode"]["c0_s"] == pytest.approx(0.004, rel=1e-3)
    assert shown["prefill"]["status"] == shown["decode"]["status"] == "fit"
    assert w.weight("decode", 1, 4000) > 2 * w.weight("decode", 1, 10)
    # uncalibrated until both phases have enough steps
    assert not Calibration(10 ** 6).weights("k").calibrated


def test_mixed_step_is_priced_as_one_prefill_pass_and_billed_per_entry_phase():
    weights = PhaseWeights(p_tok=1e-3, p_ctx=0.0, d_seq=1e-2, d_ctx=0.0, calibrated=True,
                           p_c0=0.03)
    cal = Calibration()
    cal.weights = lambda key: weights           # a given fit, not one made from this step
    a = Attributor([DeviceInfo("g0", "H100-SXM", "gpu", False)], "m", 10.0, cal, start=T0)
    # a 100-token prompt chunk (m = 0.1) with two decoding sequences (m = 0.001 each, a
    # 1-token chunk), c0 = 0.03 split three ways: Σ = 0.132, scaled to τ = 1.32
    a.add(it("w", "mixed", T0 + 1, 1.32, ["g0"], [("P", 100, 100), ("D1", 1, 50), ("D2", 1, 70)]))
    (w,) = a.close_until(T0 + 10, None)
    assert w.shares[("P", "prefill")][0] == pytest.approx(1.1)
    assert w.shares[("D1", "decode")][0] == pytest.approx(0.11)
    check_conserved([w])


@pytest.mark.parametrize("seed", range(25))
def test_conservation_randomized(seed):
    """Random devices (some tp=2, a shared CPU), random non-overlapping iterations per
    worker crossing window edges, random entries (some empty), an exact meter: every
    device window conserves GPU-seconds and joules, and the shares add up."""
    rng = random.Random(seed)
    W = rng.choice([1.0, 2.5, 10.0])
    devs = [DeviceInfo("g0", "H100-SXM", "gpu", False), DeviceInfo("g1", "H100-SXM", "gpu", False),
            DeviceInfo("g2", "L40S", "gpu", False), DeviceInfo("cpu0", "cpu", "cpu", False, capacity=2)]
    workers = {"w01": ["g0", "g1"], "w2": ["g2"], "c0": ["cpu0"], "c1": ["cpu0"]}
    start = T0 + rng.random() * W
    cal = Calibration(min_iterations=rng.choice([5, 10 ** 9]))
    a = Attributor(devs, "m", W, cal, start=start)
    busy: dict[str, list] = {}
    end_time = start + rng.uniform(3, 8) * W
    for worker, ds in workers.items():
        t = start + rng.random()
        while t < end_time:
            wall = rng.uniform(0.001, 0.6 * W)
            phase = rng.choice(["prefill", "decode", "mixed", "kv_import"])
            n = rng.randint(0, 6)
            es = [(f"r{rng.randint(0, 20)}" + rng.choice(["", ".1"]),
                   rng.randint(1, 300) if phase != "decode" else 1, rng.randint(1, 3000))
                  for _ in range(n)]
            a.add(it(worker, phase, t, wall, ds, es))
            for d in ds:
                busy.setdefault(d, []).append((t, t + wall))
            t += wall + rng.expovariate(1 / (0.3 * W))
    meter = Meter(busy, idle_w=rng.choice([0.0, 60.0, 1e6]), active_w=rng.uniform(50, 700))
    # what the accounting process asks the daemon's meter for is what gets closed
    spans = [(t0, t1) for _, t0, t1 in a.spans_until(end_time + W)]
    first = a.close_until(end_time + W, meter)
    assert sorted({(w.start, w.end) for w in first}) == spans
    spans = [(t0, t1) for _, t0, t1 in a.spans_until(end_time + 2.5 * W, final=True)]
    last = a.close_until(end_time + 2.5 * W, meter, final=True)
    assert sorted({(w.start, w.end) for w in last}) == spans
    windows = first + last
    assert windows and a.closed_until == pytest.approx(end_time + 2.5 * W)
    check_conserved(windows)
    # the windows tile time: per device, measured = capacity × elapsed
    for d in devs:
        total = sum(w.measured_gpu_s for w in windows if w.device == d.id)
        assert total == pytest.approx(d.capacity * (a.closed_until - start), rel=1e-9)


def test_energy_idle_capped_and_window_without_iterations_is_unattributed():
    devs = [DeviceInfo("g0", "H100-SXM", "gpu", False)]
    a = Attributor(devs, "m", 10.0, Calibration(), start=T0)
    a.add(it("w", "decode", T0 + 12, 1.0, ["g0"], [("R", 1, 5)]))
    busy = {"g0": [(T0 + 2, T0 + 4), (T0 + 12, T0 + 13)]}    # activity outside iterations too
    w1, w2 = a.close_until(T0 + 20, Meter(busy, idle_w=100, active_w=300))
    assert w1.idle_j == pytest.approx(1000) and w1.unattributed_j == pytest.approx(600)
    assert w1.attributed_j == 0 and not w1.shares
    assert w2.shares[("R", "decode")][1] == pytest.approx(300)
    # idle power above the reading: idle takes all of it, nothing goes negative
    a2 = Attributor(devs, "m", 10.0, Calibration(), start=T0)
    (w,) = a2.close_until(T0 + 10, Meter({}, idle_w=1e6))
    assert w.idle_j == w.measured_j and w.unattributed_j == 0
    check_conserved([w1, w2, w])


def test_late_record_is_kept_and_busy_time_never_exceeds_capacity():
    a = Attributor([DeviceInfo("g0", "H100-SXM", "gpu", False)], "m", 10.0, Calibration(), start=T0)
    a.close_until(T0 + 10, None)
    a.add(it("w", "decode", T0 + 5, 3.0, ["g0"], [("R", 1, 5)]))      # after its window closed
    for k in range(12):                                                # overlapping (jitter)
        a.add(it("w", "decode", T0 + 10 + k * 0.7, 1.0, ["g0"], [("S", 1, 5)]))
    (w,) = a.close_until(T0 + 20, None)
    assert a.late == 1
    assert w.attributed_gpu_s == pytest.approx(10.0) and w.idle_gpu_s == 0
    check_conserved([w])



def test_windows_close_only_through_what_the_daemon_has_sent(tmp_path):
    """An accounting process behind on its inbox: by its clock the first window ended
    long ago, but the daemon's records of its busy second half are still queued. Closed
    by the clock, they would come late, pile onto the next (itself busy) window and be
    cut at its capacity: 5 of 20 device-seconds lost."""
    acc, ledger = make_accountant(tmp_path)
    for k in range(5):                          # taken: sent by T0 + 5
        acc.iteration(it("d0", "decode", T0 + k, 1.0, ["g0"], [("A", 1, 10 + k)]))
    acc.received(T0 + 5)
    acc.tick(now=T0 + 17)                       # 12 s behind: closes nothing
    assert acc.windows_closed == 0
    for k in range(5, 20):                      # the backlog, then the next window busy
        acc.iteration(it("d0", "decode", T0 + k, 1.0, ["g0"], [("A", 1, 10 + k)]))
    acc.received(T0 + 20)
    acc.tick(now=T0 + 21.6)
    acc.stop(now=T0 + 21.6)
    assert acc.attributor.late == 0
    rows = sqlite3.connect(tmp_path / "ledger.db").execute(
        'SELECT sum(attributed_gpu_s + unattributed_gpu_s) FROM device_windows '
        'WHERE device = \'g0\'').fetchone()
    assert rows[0] == pytest.approx(20.0)

# ---- cost, carbon, budgets ---------------------------------------------------------

def test_prices_from_catalogue_and_overrides():
    pb = PriceBook({"L40S": 1.0}, usd_per_kwh=0.2)
    assert pb.usd_per_hour("H100-SXM") == 3.0 and pb.usd_per_hour("L40S") == 1.0
    assert pb.cost("H100-SXM", 3600, 3.6e6) == pytest.approx(3.2)


def test_intensity_file_csv_and_json_step_lookup(tmp_path):
    f = tmp_path / "grid.csv"
    f.write_text("datetime,carbonIntensity,isEstimated,emissionFactorType\n"
                 "2026-11-23T10:00:00Z,200,false,lifecycle\n"
                 "2026-11-23T11:00:00Z,400,true,lifecycle\n")
    ci = CarbonIntensity.from_file(f, "marginal")
    before = ci.at(parse_time("2026-11-23T10:59:59Z"))
    after = ci.at(parse_time("2026-11-23T11:00:00Z"))
    assert before.g_per_kwh == 200 and not before.provenance.estimated
    assert after.g_per_kwh == 400 and after.provenance.estimated
    assert before.provenance.source == "file:grid.csv" and before.provenance.kind == "marginal"
    assert before.provenance.factor == "lifecycle"
    assert ci.at(parse_time("2026-11-23T09:00:00Z")).provenance.estimated      # before the data
    j = tmp_path / "grid.json"
    j.write_text(json.dumps({"history": [{"datetime": "2026-11-23T10:00:00.000Z",
                                          "carbonIntensity": 123, "isEstimated": False}]}))
    assert CarbonIntensity.from_file(j).at(parse_time("2026-11-23T10:30:00Z")).g_per_kwh == 123
    bad = tmp_path / "bad.csv"
    bad.write_text("time,value\n1,2\n")
    with pytest.raises(ValueError, match="datetime and carbonIntensity"):
        CarbonIntensity.from_file(bad)
    assert CarbonIntensity(300.0).at(0).provenance.source == "static"


def test_embodied_per_second():
    e = EmbodiedCarbon({}, {})
    assert e.grams_per_second("H100-SXM") == pytest.approx(318e3 / (5 * 365.25 * 86400))
    assert EmbodiedCarbon({"cpu": 100.0}, {"cpu": 1.0}).grams_per_second("cpu") == \
        pytest.approx(1e5 / (365.25 * 86400))


def test_budget_alerts_once_per_crossing_and_reset_per_period(caplog):
    import time
    t = time.time()
    b = Budgets("day", {"gpu_hours": {"a": 1.0}}, now=t)
    b.add("a", t, {"gpu_hours": 0.5})
    assert b.report("a")[0]["alerts"] == []
    b.add("a", t, {"gpu_hours": 0.35})
    b.add("a", t, {"gpu_hours": 0.01})
    r = b.states[("a", "gpu_hours")]
    assert [x["threshold"] for x in r.alerts] == [0.8]
    b.add("a", t, {"gpu_hours": 0.2})
    assert [x["threshold"] for x in r.alerts] == [0.8, 1.0] and r.ratio == pytest.approx(1.06)
    assert sum("budget alert" in m for m in caplog.messages) == 2
    b.add("a", t + 86400, {"gpu_hours": 0.1})          # next day: from zero
    assert r.used == pytest.approx(0.1) and r.alerts == []
    assert period_start("week", parse_time("2026-11-26T08:00:00Z")) == parse_time("2026-11-23T00:00:00Z")
    assert period_start("month", parse_time("2026-11-10T12:00:00Z")) == parse_time("2026-11-01T00:00:00Z")


# ---- the accountant and the ledger ---------------------------------------------------

def make_accountant(tmp_path, meter=None, pue=1.5, intensity=None, policy="share", budgets=None,
                    name="s1", start=T0, flush=0.05):
    devs = [DeviceInfo("g0", "H100-SXM", "gpu", False), DeviceInfo("g1", "H100-SXM", "gpu", False)]
    ledger = Ledger(tmp_path / "ledger.db", flush_interval_s=flush, retention_days=0)
    ledger.start()
    site = Site(name, "app1", "DE", pue, intensity or CarbonIntensity(400.0))
    acc = Accountant(devs, "m", site, ledger, PriceBook({}, 0.0, policy), EmbodiedCarbon({}, {}),
                     budgets=budgets, meter=lambda: meter, window_s=10.0, start=start)
    return acc, ledger


def req(rid, tenant, arrival, finish, prompt=10, output=5):
    return RequestRecord(rid, tenant, "m", "chat", prompt, output, 0, arrival, arrival + 0.1,
                         finish, "p0", "d0", "ok", "stop")


def test_accountant_rows_conserve_and_report(tmp_path):
    busy = {"g0": [(T0 + 1, T0 + 3)], "g1": [(T0 + 4, T0 + 8), (T0 + 12, T0 + 13)]}
    acc, ledger = make_accountant(tmp_path, Meter(busy, idle_w=50, active_w=400), policy="share")
    acc.iteration(it("p0", "prefill", T0 + 1, 2.0, ["g0"], [("A", 500, 500), ("B", 500, 500)]))
    acc.iteration(it("d0", "decode", T0 + 4, 4.0, ["g1"], [("A", 1, 501), ("B", 1, 501)]))
    acc.iteration(it("d0", "decode", T0 + 12, 1.0, ["g1"], [("B", 1, 502)]))
    acc.request(req("A", "ta", T0, T0 + 8))
    acc.request(req("B", "tb", T0, T0 + 13))
    assert acc.tick(now=T0 + 11.6) == 1           # A final after the first window closed
    acc.stop(now=T0 + 20)
    rows = {r[0]: r for r in sqlite3.connect(tmp_path / "ledger.db").execute(
        "SELECT request_id, prefill_gpu_s, decode_gpu_s, prefill_j, decode_j, final, "
        "prefill_cost_allocation + decode_cost_allocation, prefill_cost_usage + decode_cost_usage "
        "FROM requests")}
    assert rows["A"][1:3] == pytest.approx((1.0, 2.0)) and rows["B"][1:3] == pytest.approx((1.0, 3.0))
    assert rows["A"][3] == pytest.approx(400.0) and rows["A"][5] == 1
    ledger2 = Ledger(tmp_path / "ledger.db", retention_days=0)
    rep = reports.usage(ledger2, ["tenant", "phase"], T0 - 1, T0 + 100)
    tot = rep["totals"]
    assert tot["measured_gpu_seconds"] == pytest.approx(2 * (acc.attributor.closed_until - T0))
    assert tot["attributed_gpu_seconds"] + tot["idle_gpu_seconds"] + tot["unattributed_gpu_seconds"] \
        == pytest.approx(tot["measured_gpu_seconds"], rel=0.005)
    assert tot["attributed_energy_joules"] + tot["idle_energy_joules"] + \
        tot["unattributed_energy_joules"] == pytest.approx(tot["measured_energy_joules"], rel=0.005)
    assert sum(r["gpu_seconds"] for r in rep["rows"]) == pytest.approx(tot["attributed_gpu_seconds"])
    # allocation basis: the whole bill of the query window lands on tenants (g0's second
    # window ran nothing: its idle is shared over the window's usage too)
    price = 3.0 / 3600
    billed = sum(r["cost_allocation"] for r in rep["rows"])
    assert billed == pytest.approx(tot["measured_gpu_seconds"] * price, rel=0.005)
    assert tot["capacity_cost"] == pytest.approx(tot["measured_gpu_seconds"] * price)
    assert sum(r["cost_usage"] for r in rep["rows"]) == pytest.approx(tot["attributed_gpu_seconds"] * price)
    by = {(r["tenant"], r["phase"]): r for r in rep["rows"]}
    assert by[("ta", "prefill")]["prompt_tokens"] == 10 and by[("ta", "prefill")]["output_tokens"] == 0
    assert by[("tb", "decode")]["gpu_seconds"] == pytest.approx(3.0)
    # CSV: the same rows, parsing back to the same sums
    parsed = list(csv.DictReader(io.StringIO(reports.usage_csv(rep))))
    assert len(parsed) == len(rep["rows"])
    assert sum(float(r["gpu_seconds"]) for r in parsed) == pytest.approx(tot["attributed_gpu_seconds"])
    # a tenant's own view: its rows only, no appliance-wide totals
    own = reports.usage(ledger2, ["tenant"], T0 - 1, T0 + 100, tenant="ta")
    assert [r["tenant"] for r in own["rows"]] == ["ta"] and own["totals"]["measured_gpu_seconds"] is None
    ledger2.stop()


def test_idle_policy_keeps_an_idle_row(tmp_path):
    acc, ledger = make_accountant(tmp_path, None, policy="idle")
    acc.iteration(it("p0", "prefill", T0 + 1, 2.0, ["g0"], [("A", 500, 500)]))
    acc.request(req("A", "ta", T0, T0 + 3))
    acc.tick(now=T0 + 12)
    acc.stop(now=T0 + 20)
    led = Ledger(tmp_path / "ledger.db", retention_days=0)
    rep = reports.usage(led, ["tenant"], T0 - 1, T0 + 100, idle_policy="idle")
    rows = {r["tenant"]: r for r in rep["rows"]}
    assert rows["ta"]["cost_allocation"] == pytest.approx(rows["ta"]["cost_usage"])
    assert rows["(idle)"]["gpu_seconds"] == pytest.approx(rep["totals"]["idle_gpu_seconds"])
    assert rows["ta"]["cost_allocation"] + rows["(idle)"]["cost_allocation"] == \
        pytest.approx(rep["totals"]["measured_gpu_seconds"] * 3.0 / 3600)
    assert rows["ta"]["energy_joules"] is None and rows["ta"]["measured"] is False
    led.stop()


def test_carbon_intensity_at_request_time_and_pue_ratio(tmp_path):
    f = tmp_path / "grid.csv"
    f.write_text("datetime,carbonIntensity,isEstimated\n"
                 f"{reports.iso(T0 - 3600)},250,false\n{reports.iso(T0 + 15)},500,false\n")
    figures = {}
    for name, pue in (("s1", 1.2), ("s2", 1.8)):
        d = tmp_path / name
        busy = {"g0": [(T0 + 1, T0 + 2), (T0 + 21, T0 + 22)]}
        acc, ledger = make_accountant(d, Meter(busy, idle_w=0, active_w=3600), pue=pue,
                                      intensity=CarbonIntensity.from_file(f), name=name)
        acc.iteration(it("p0", "prefill", T0 + 1, 1.0, ["g0"], [("early", 100, 100)]))
        acc.iteration(it("p0", "prefill", T0 + 21, 1.0, ["g0"], [("late", 100, 100)]))
        acc.request(req("early", "t", T0 + 0.5, T0 + 2))
        acc.request(req("late", "t", T0 + 20.5, T0 + 22))
        acc.stop(now=T0 + 30)
        led = Ledger(d / "ledger.db", retention_days=0)
        for rid, g, i in led.query("SELECT request_id, prefill_co2e_op_g, intensity_g_per_kwh "
                                   "FROM requests"):
            figures[(name, rid)] = (g, i)
        rep = reports.carbon(led, ["site"], T0 - 1, T0 + 100)
        assert rep["rows"][0]["provenance"]["sources"] == ["file:grid.csv"]
        led.stop()
    # 3600 J = 1 Wh each; 0.001 kWh × PUE × intensity
    assert figures[("s1", "early")] == (pytest.approx(0.001 * 1.2 * 250), 250)
    assert figures[("s1", "late")] == (pytest.approx(0.001 * 1.2 * 500), 500)
    assert figures[("s2", "late")][0] / figures[("s1", "late")][0] == pytest.approx(1.8 / 1.2)


def test_ledger_recovers_unfinished_rows_and_counts_each_request_once(tmp_path):
    acc, ledger = make_accountant(tmp_path, None)
    acc.iteration(it("p0", "prefill", T0 + 1, 1.0, ["g0"], [("A", 5, 5)]))
    acc.request(req("A", "ta", T0, T0 + 2))
    assert ledger.flush()
    # the process dies here (no stop): A is committed as pending, without a request row
    db = sqlite3.connect(tmp_path / "ledger.db")
    assert db.execute("SELECT count(*) FROM requests").fetchone() == (0,)
    (blob,) = db.execute("SELECT rows FROM pending").fetchone()
    db.close()
    assert [r.request_id for r in unpack_rows(blob)] == ["A"]
    led = Ledger(tmp_path / "ledger.db", retention_days=0, rollup_retention_days=0)
    assert led.recovered == 1
    assert led.query("SELECT count(*), final, incomplete FROM requests") == [(1, 1, 1)]
    assert led.query("SELECT sum(requests) FROM usage_rollups "
                     "WHERE period = 'hour' AND phase = 'prefill'") == [(1,)]
    led.stop()
    ledger.stop()


def test_pending_blob_lives_until_its_last_request_is_final(tmp_path):
    """A request's row is written once: while it waits for its windows it is committed
    in its batch's `pending` blob, which goes in the transaction that writes the last
    final row of the batch; a restart turns what is left (and only that) into
    incomplete rows."""
    acc, ledger = make_accountant(tmp_path, None)
    db = sqlite3.connect(tmp_path / "ledger.db")

    def pending():
        return sorted(r.request_id for (blob,) in db.execute("SELECT rows FROM pending")
                      for r in unpack_rows(blob))

    # A and B in one batch, C in the next
    acc.iteration(it("p0", "prefill", T0 + 1, 1.0, ["g0"], [("A", 5, 5), ("B", 5, 5)]))
    acc.request(req("A", "ta", T0, T0 + 2))
    acc.request(req("B", "tb", T0, T0 + 12))
    assert ledger.flush()
    acc.iteration(it("p0", "prefill", T0 + 13, 1.0, ["g0"], [("C", 5, 5)]))
    acc.request(req("C", "tc", T0 + 12, T0 + 14))
    assert ledger.flush()
    assert pending() == ["A", "B", "C"]
    assert db.execute("SELECT count(*) FROM pending").fetchone() == (2,)
    assert db.execute("SELECT count(*) FROM requests").fetchone() == (0,)
    # the first window closes: A is final, its blob stays for B
    acc.tick(now=T0 + 10 + acc.grace_s + 0.1)
    assert ledger.flush()
    assert db.execute("SELECT request_id, final FROM requests").fetchall() == [("A", 1)]
    assert pending() == ["A", "B", "C"]
    # the second closes: B and C final, both blobs gone
    acc.tick(now=T0 + 20 + acc.grace_s + 0.1)
    assert ledger.flush()
    assert pending() == []
    assert sorted(db.execute("SELECT request_id FROM requests WHERE final = 1")) == \
        [("A",), ("B",), ("C",)]
    # provisional and final in one batch: only the final row, no blob
    acc.iteration(it("p0", "prefill", T0 + 21, 1.0, ["g0"], [("D", 5, 5)]))
    acc.request(req("D", "td", T0 + 21, T0 + 22))
    acc.request(req("E", "te", T0 + 21, T0 + 40))
    acc.tick(now=T0 + 30 + acc.grace_s + 0.1)
    assert ledger.flush()
    assert pending() == ["E"]
    assert db.execute("SELECT final FROM requests WHERE request_id = 'D'").fetchone() == (1,)
    # the process dies (no stop): a restart keeps D as it was and adds E, incomplete
    gpu_d = db.execute("SELECT prefill_gpu_s FROM requests WHERE request_id = 'D'").fetchone()
    led = Ledger(tmp_path / "ledger.db", retention_days=0, rollup_retention_days=0)
    assert led.recovered == 1
    assert led.query("SELECT request_id, final, incomplete FROM requests ORDER BY 1") == [
        ("A", 1, 0), ("B", 1, 0), ("C", 1, 0), ("D", 1, 0), ("E", 1, 1)]
    assert led.query("SELECT prefill_gpu_s FROM requests WHERE request_id = 'D'") == [gpu_d]
    assert pending() == []
    led.stop()
    ledger.stop()
    db.close()


@pytest.mark.parametrize("n", [1, 7, 73, 900, 1700])
def test_many_rows_per_statement_write_every_row_and_keep_final_rows(tmp_path, n):
    """The writer packs rows into multi-row statements (sizes 819, 64, 8, 1): every row of
    a batch lands whatever its count, a provisional and a final row of the same request
    in one batch leave the final one, and a final row is never overwritten."""
    from appliance.accounting.ledger import (
        REQUEST_COLUMNS, _REQ_CONFLICT, RequestRow, connect, write_rows,
    )
    Ledger(tmp_path / "ledger.db").stop()          # the schema
    conn = connect(tmp_path / "ledger.db")
    zero = RequestRow._make([0] * len(REQUEST_COLUMNS))

    def row(i: int, final: int, gpu_s: float) -> RequestRow:
        return zero._replace(request_id=f"R{i}", tenant=f"t{i % 3}", finish=T0 + i,
                             prefill_gpu_s=gpu_s, final=final)

    batch = [row(i, 0, 0.0) for i in range(n)] + [row(i, 1, i + 0.5) for i in range(0, n, 2)]
    with conn:
        write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, batch, _REQ_CONFLICT)
    with conn:      # late provisional rows must not undo final ones
        write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS,
                   [row(i, 0, -1.0) for i in range(n)], _REQ_CONFLICT)
    got = dict(conn.execute("SELECT request_id, prefill_gpu_s FROM requests").fetchall())
    assert len(got) == n
    assert got == {f"R{i}": (i + 0.5 if i % 2 == 0 else -1.0) for i in range(n)}
    conn.close()


def test_budgets_fed_by_final_rows(tmp_path):
    b = Budgets("month", {"gpu_hours": {"ta": 2.4 / 3600}}, now=T0)
    seen = []
    acc, ledger = make_accountant(tmp_path, None, budgets=b)
    acc.on_budget = seen.extend
    acc.iteration(it("p0", "prefill", T0 + 1, 2.0, ["g0"], [("A", 5, 5)]))
    acc.request(req("A", "ta", T0, T0 + 3))
    acc.iteration(it("p0", "prefill", T0 + 4, 0.5, ["g0"], [("B", 5, 5)]))
    acc.request(req("B", "ta", T0, T0 + 5))
    acc.stop(now=T0 + 10)
    state = b.states[("ta", "gpu_hours")]       # (report() would roll to today's period)
    assert state.ratio == pytest.approx(2.5 / 2.4)
    assert [a["threshold"] for a in state.alerts] == [0.8, 1.0]
    assert seen


def test_rollups_sum_whole_hours_once(tmp_path):
    acc, ledger = make_accountant(tmp_path, None)
    for i in range(3):
        acc.iteration(it("p0", "prefill", T0 + 1 + i, 0.5, ["g0"], [(f"R{i}", 5, 5)]))
        acc.request(req(f"R{i}", "ta", T0 + i, T0 + 1.5 + i, prompt=7))
    acc.stop(now=T0 + 10)
    for _ in range(2):                  # a second open must not add the same hours again
        led = Ledger(tmp_path / "ledger.db", retention_days=0, rollup_retention_days=0)
        led.stop()
    conn = sqlite3.connect(tmp_path / "ledger.db")
    for period in ("slice", "hour"):
        n, pt, gpu = conn.execute("SELECT sum(requests), sum(pt), sum(gpu_s) FROM usage_rollups "
                                  "WHERE period = ? AND phase = 'prefill'", (period,)).fetchone()
        assert (n, pt) == (3, 21) and gpu == pytest.approx(1.5)


def test_meter_read_in_one_go_per_tick_gives_the_same_figures(tmp_path):
    """The accounting process reads the daemon's meter once per tick for every window it
    closes (`read_meter` + `take_readings`): the rows are those of a live meter."""
    busy = {"g0": [(T0 + 1, T0 + 3)], "g1": [(T0 + 4, T0 + 8), (T0 + 12, T0 + 13)]}
    meter = Meter(busy, idle_w=50, active_w=400)
    asked: list[tuple[list, list]] = []

    def read_meter(devices, spans):
        asked.append((devices, spans))
        return take_readings(meter, devices, spans)

    rows = []
    for d, kw in ((tmp_path / "live", {"meter": lambda: meter}),
                  (tmp_path / "once", {"read_meter": read_meter})):
        d.mkdir()
        ledger = Ledger(d / "ledger.db", flush_interval_s=0.05, retention_days=0)
        ledger.start()
        acc = Accountant([DeviceInfo("g0", "H100-SXM", "gpu", False),
                          DeviceInfo("g1", "H100-SXM", "gpu", False)], "m",
                         Site("s1", "app1", "DE", 1.5, CarbonIntensity(400.0)), ledger,
                         PriceBook({}, 0.1, "share"), EmbodiedCarbon({}, {}), window_s=10.0,
                         start=T0, **kw)
        acc.iteration(it("p0", "prefill", T0 + 1, 2.0, ["g0"], [("A", 500, 500), ("B", 500, 500)]))
        acc.iteration(it("d0", "decode", T0 + 4, 4.0, ["g1"], [("A", 1, 501), ("B", 1, 501)]))
        acc.iteration(it("d0", "decode", T0 + 12, 1.0, ["g1"], [("B", 1, 502)]))
        acc.request(req("A", "ta", T0, T0 + 8))
        acc.request(req("B", "tb", T0, T0 + 13))
        acc.tick(now=T0 + 5)                    # nothing to close: the meter is not asked
        acc.tick(now=T0 + 31.6)                 # three windows at once
        acc.stop(now=T0 + 35)
        db = sqlite3.connect(d / "ledger.db")
        rows.append((db.execute("SELECT request_id, prefill_j, decode_j, prefill_co2e_op_g, "
                                "decode_cost_usage FROM requests ORDER BY 1").fetchall(),
                     db.execute("SELECT device, start, end, measured_j, idle_j, attributed_j "
                                "FROM device_windows ORDER BY 1, 2").fetchall()))
        db.close()
    assert rows[0] == rows[1] and rows[0][0][0][1] > 0
    assert [len(spans) for _, spans in asked] == [3, 1]
    assert asked[0][0] == ["g0", "g1"]
    assert asked[0][1] == [(T0, T0 + 10), (T0 + 10, T0 + 20), (T0 + 20, T0 + 30)]
    assert asked[1][1] == [(T0 + 30, T0 + 35)]
    # a meter that fails reads as "not measured", never as an exception
    class Broken:
        def energy_j(self, *a):
            raise OSError("gone")

        def idle_power_w(self, d):
            raise OSError("gone")
    r = take_readings(Broken(), ["g0"], [(T0, T0 + 1)])
    assert r.energy_j("g0", T0, T0 + 1) == (None, "none") and r.idle_power_w("g0") is None
    assert take_readings(None, ["g0"], [(T0, T0 + 1)]).energy_j("g0", T0, T0 + 1) == (None, "none")


def test_rows_say_when_a_grammar_constrained_the_output(tmp_path):
    import dataclasses
    acc, ledger = make_accountant(tmp_path)
    acc.iteration(it("p0", "prefill", T0 + 1, 1.0, ["g0"], [("A", 100, 100), ("B", 100, 100)]))
    acc.request(dataclasses.replace(req("A", "ta", T0, T0 + 2), structured=True))
    acc.request(req("B", "ta", T0, T0 + 2))
    acc.stop(now=T0 + 30)
    con = sqlite3.connect(tmp_path / "ledger.db")
    rows = dict(con.execute("SELECT request_id, structured FROM requests WHERE final = 1"))
    con.close()
    assert rows == {"A": 1, "B": 0}


def test_a_ledger_of_an_older_release_gains_the_new_columns(tmp_path):
    from appliance.accounting.ledger import REQUEST_COLUMNS, RequestRow, _coltype
    old = [c for c in REQUEST_COLUMNS if c != "structured"]
    path = tmp_path / "ledger.db"
    con = sqlite3.connect(path)
    con.execute(f"CREATE TABLE requests ({', '.join(f'{chr(34)}{c}{chr(34)} {_coltype(c)}' for c in old)}, "
                "PRIMARY KEY (request_id))")
    row = RequestRow._make([None] * len(REQUEST_COLUMNS))._replace(
        request_id="old", tenant="t", model="m", status="ok", arrival=T0, finish=T0 + 1,
        prompt_tokens=1, output_tokens=1, final=1)
    con.execute(f"INSERT INTO requests VALUES ({', '.join('?' * len(old))})", row[:len(old)])
    con.commit()
    con.close()
    led = Ledger(path, retention_days=0)       # opens, and migrates, the old file
    con = sqlite3.connect(path)
    cols = [r[1] for r in con.execute("PRAGMA table_info(requests)")]
    assert cols == list(REQUEST_COLUMNS)
    assert con.execute("SELECT request_id, structured FROM requests").fetchall() == [("old", None)]
    con.close()
    led.stop()
