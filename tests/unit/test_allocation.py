"""Allocation that adds up and carbon after SCI (issue 22 §2, §3), on a real SQLite ledger
written by the real accountant; the energy meter is a stand-in at the hardware boundary.

The scene is the issue's: 8 simulated H100s priced at $3.60/h, one request in the first
10-s window and none in the second. A 20-s report used to bill $0.080 of the $0.160 the
devices cost, and its carbon rows counted the request's active energy only.
"""
from __future__ import annotations

import random

import pytest

from appliance import config
from appliance.accounting import reports
from appliance.accounting.allocation import Method
from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon, parse_time
from appliance.accounting.cost import PriceBook, RateCard
from helpers.ledger_scene import GRID, H100_G_PER_S, PRICE, PUE, T0, capacity_of, ledger_with, method


def billed(rep) -> float:
    return sum(r["cost_allocation"] for r in rep["rows"])


# ---- §2: allocation that adds up ----------------------------------------------------

@pytest.mark.parametrize("policy", ["share", "idle"])
def test_the_issues_20_s_window_bills_the_whole_capacity(tmp_path, policy):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0)], end=T0 + 20)
    rep = reports.usage(led, ["tenant"], T0, T0 + 20, method=method(policy))
    capacity = 8 * 20 * PRICE / 3600                   # $0.160
    assert capacity == pytest.approx(0.160)
    assert billed(rep) == pytest.approx(capacity, rel=0.005)
    assert rep["totals"]["capacity_cost"] == pytest.approx(capacity, rel=1e-9)
    assert rep["currency"] == "USD" and all(r["currency"] == "USD" for r in rep["rows"])
    rows = {r["tenant"]: r for r in rep["rows"]}
    used = (4 * 2.0 + 4 * 3.0) * PRICE / 3600          # what A ran, at the rate
    assert rows["ta"]["cost_usage"] == pytest.approx(used, rel=0.005)
    if policy == "share":
        assert set(rows) == {"ta"}                      # the whole bill on the tenant
        assert rows["ta"]["cost_allocation"] == pytest.approx(capacity, rel=0.005)
    else:
        assert rows["ta"]["cost_allocation"] == pytest.approx(used, rel=0.005)
        assert rows[reports.IDLE_TENANT]["cost_allocation"] == pytest.approx(capacity - used, rel=0.005)
    # utilization = usage ÷ allocation, as the docs say
    assert rep["totals"]["utilization"] == pytest.approx(used / capacity, rel=0.005)
    led.stop()


@pytest.mark.parametrize("policy", ["share", "idle"])
def test_allocation_adds_up_for_any_window(tmp_path, policy):
    """Requests here and there, idle windows between them and a long idle stretch (one
    device-window row for 60 s): any query window, edges anywhere, bills exactly what
    the devices cost in it."""
    rng = random.Random(7)
    runs = [(f"R{i}", rng.choice(["ta", "tb", "tc"]), T0 + t, rng.uniform(0.2, 2.0),
             rng.uniform(0.5, 4.0)) for i, t in enumerate([1, 3.5, 7, 12, 31, 33, 44, 112, 115])]
    led = ledger_with(tmp_path, runs, end=T0 + 130)
    # the idle stretch is one 60-s row: reports find it from a start inside it
    assert led.query("SELECT value FROM meta WHERE key = 'max_window_s'") == [(60.0,)]
    m = method(policy, per_kwh=0.3, node_w=4600.0)
    spans = [(T0, T0 + 130), (T0 + 10, T0 + 30), (T0 + 50, T0 + 110), (T0 + 3.3, T0 + 47.9),
             (T0 + 70, T0 + 90)]
    spans += [tuple(sorted((T0 + rng.uniform(0, 130), T0 + rng.uniform(0, 130)))) for _ in range(6)]
    for since, until in spans:
        rep = reports.usage(led, ["tenant", "phase"], since, until, method=m)
        capacity = capacity_of(led, since, until, per_kwh=0.3, node_w=4600.0)
        assert capacity > 0
        assert billed(rep) == pytest.approx(capacity, rel=0.005), (since - T0, until - T0)
        people = [r for r in rep["rows"] if r["tenant"] != reports.IDLE_TENANT]
        for r in people:
            assert r["cost_allocation"] >= r["cost_usage"] - 1e-12
        if policy == "share" and people:
            assert not any(r["tenant"] == reports.IDLE_TENANT for r in rep["rows"])
    led.stop()


@pytest.mark.parametrize("policy", ["share", "idle"])
def test_a_window_with_no_request_is_an_idle_row_not_nothing(tmp_path, policy):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0)], end=T0 + 100)
    rep = reports.usage(led, ["tenant"], T0 + 20, T0 + 80, method=method(policy))
    (row,) = rep["rows"]
    assert row["tenant"] == reports.IDLE_TENANT
    assert row["cost_allocation"] == pytest.approx(8 * 60 * PRICE / 3600, rel=0.005)
    assert rep["note"] and "idle" in rep["note"]
    led.stop()


def test_a_tenants_own_view_keeps_its_share_of_the_whole_window(tmp_path):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0), ("B", "tb", T0 + 12, 1.0, 1.0)],
                      end=T0 + 30)
    m = method("share")
    every = {r["tenant"]: r for r in reports.usage(led, ["tenant"], T0, T0 + 30, method=m)["rows"]}
    own = reports.usage(led, ["model"], T0, T0 + 30, tenant="tb", method=m)
    (row,) = own["rows"]
    assert row["cost_allocation"] == pytest.approx(every["tb"]["cost_allocation"], rel=1e-9)
    assert own["totals"]["capacity_cost"] is None         # no appliance-wide figures
    led.stop()


def test_rate_cards_price_each_window_at_the_rate_then(tmp_path):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0), ("B", "tb", T0 + 12, 2.0, 3.0)],
                      end=T0 + 20)
    before = reports.usage(led, ["tenant"], T0, T0 + 20, method=method("share"))
    # a price change next year reprices nothing in the past
    later = method("share", [RateCard(T0 + 86400 * 365, {"H100-SXM": 9.0}, 1.0)])
    again = reports.usage(led, ["tenant"], T0, T0 + 20, method=later)
    assert [r["cost_allocation"] for r in again["rows"]] == \
        pytest.approx([r["cost_allocation"] for r in before["rows"]], rel=1e-12)
    # a card from T0 + 10: the first window at $3.60, the second at $4.80
    mid = method("share", [RateCard(T0 + 10, {"H100-SXM": 4.8})])
    rep = reports.usage(led, ["tenant"], T0, T0 + 20, method=mid)
    assert billed(rep) == pytest.approx(8 * 10 * (3.6 + 4.8) / 3600, rel=0.005)
    assert billed(rep) == pytest.approx(
        capacity_of(led, T0, T0 + 20, rate=lambda t: 3.6 if t < T0 + 10 else 4.8), rel=0.005)
    # a card that only moves the energy price keeps the device price; energy is facility
    # energy (× PUE)
    kwh = method("share", [RateCard(T0 + 10, {}, 0.5)])
    assert kwh.prices.usd_per_hour("H100-SXM", T0 + 15) == PRICE
    rep = reports.usage(led, ["tenant"], T0 + 10, T0 + 20, method=kwh)
    (mj,) = led.query("SELECT sum(measured_j) FROM device_windows WHERE start >= ?", (T0 + 10,))[0]
    assert billed(rep) == pytest.approx(8 * 10 * PRICE / 3600 + mj * PUE / 3.6e6 * 0.5, rel=0.005)
    led.stop()


def test_currency_is_named_and_catalogue_dollars_are_not_used_in_another(tmp_path):
    pb = PriceBook({}, 0.0, "share", currency="EUR", cards=[RateCard(T0, {"H100-SXM": 3.1})])
    assert pb.usd_per_hour("H100-SXM", T0 - 1) == 0.0 and not pb.priced("L40S")
    assert pb.usd_per_hour("H100-SXM", T0 + 1) == 3.1
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0)], end=T0 + 20)
    m = Method(pb, EmbodiedCarbon({}, {}), PUE, CarbonIntensity(GRID))
    rep = reports.usage(led, ["tenant"], T0, T0 + 20, method=m)
    assert rep["currency"] == "EUR" and rep["totals"]["currency"] == "EUR"
    assert "currency" in reports.usage_csv(rep).splitlines()[0].split(",")
    assert reports.usage_csv(rep).splitlines()[1].split(",")[11] == "EUR"
    led.stop()


def test_rate_cards_in_the_config():
    cfg = config.parse('[accounting]\ncurrency = "EUR"\n'
                       '[[accounting.rate_cards]]\neffective = 2027-01-01\n'
                       'per_device_hour = { "H100-SXM" = 3.2 }\nper_kwh = 0.15\n'
                       '[[accounting.rate_cards]]\neffective = "2027-06-01T12:00:00Z"\nper_kwh = 0.2\n')
    cards = cfg.accounting.rate_cards
    assert [c["effective"] for c in cards] == [parse_time("2027-01-01T00:00:00Z"),
                                               parse_time("2027-06-01T12:00:00Z")]
    assert cards[0]["per_device_hour"] == {"H100-SXM": 3.2} and cards[1]["per_kwh"] == 0.2
    for text, words in [('[[accounting.rate_cards]]\nper_kwh = 1\n', "needs effective"),
                        ('[[accounting.rate_cards]]\neffective = "soon"\n', "date or time"),
                        ('[[accounting.rate_cards]]\neffective = 2027-01-01\nprice = 1\n',
                         r"unknown key accounting\.rate_cards\[0\]\.price"),
                        ('[[accounting.rate_cards]]\neffective = 2027-01-01\n'
                         'per_device_hour = { "H100-SXM" = -1 }\n', "0 or more"),
                        ('[accounting]\ncurrency = "dollars"\n', "ISO 4217"),
                        ('[site]\nnode_overhead_w = -5\n', "node_overhead_w"),
                        ('[site]\ncarbon_intensity_market = -3\n', "carbon_intensity_market")]:
        with pytest.raises(config.ConfigError, match=words):
            config.parse(text)


# ---- §3: carbon after SCI -------------------------------------------------------------

def carbon_truth(led, since, until, g_per_kwh=GRID, node_w=0.0):
    """Σ measured energy × PUE × I + node overhead × PUE × I + embodied over wall time,
    from the device windows."""
    op = emb = 0.0
    spans = set()
    for start, end, meas_j in led.query('SELECT start, "end", measured_j FROM device_windows'):
        a, b = max(start, since), min(end, until)
        if b <= a:
            continue
        op += meas_j * (b - a) / (end - start) * PUE / 3.6e6 * g_per_kwh
        emb += (b - a) * H100_G_PER_S
        spans.add((a, b))
    op += sum(b - a for a, b in spans) * node_w * PUE / 3.6e6 * g_per_kwh
    return op, emb


@pytest.mark.parametrize("policy", ["share", "idle"])
def test_carbon_rows_add_up_to_all_energy_and_embodied_over_wall_time(tmp_path, policy):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0), ("B", "tb", T0 + 3, 1.0, 1.0)],
                      end=T0 + 20)
    m = method(policy, node_w=4600.0)
    rep = reports.carbon(led, ["tenant"], T0, T0 + 20, method=m)
    op, emb = carbon_truth(led, T0, T0 + 20, node_w=4600.0)
    assert sum(r["co2e_grams"] for r in rep["rows"]) == pytest.approx(op + emb, rel=0.005)
    assert sum(r["co2e_operational_grams"] for r in rep["rows"]) == pytest.approx(op, rel=0.005)
    assert sum(r["co2e_embodied_grams"] for r in rep["rows"]) == pytest.approx(emb, rel=0.005)
    assert rep["totals"]["co2e_grams"] == pytest.approx(op + emb, rel=1e-9)
    # SCI: the total over the requests, and per 1,000 tokens (prompt + output)
    assert rep["totals"]["sci_grams_per_request"] == pytest.approx((op + emb) / 2, rel=0.005)
    assert rep["totals"]["sci_grams_per_1k_tokens"] == pytest.approx((op + emb) / 4200 * 1000,
                                                                     rel=0.005)
    # node overhead is a component of its own, in the idle/static share
    node = sum(r["components"]["operational_node_overhead"] for r in rep["rows"])
    assert node == pytest.approx(20 * 4600 * PUE / 3.6e6 * GRID, rel=0.005)
    people = [r for r in rep["rows"] if r["tenant"] != reports.IDLE_TENANT]
    if policy == "idle":
        (idle,) = [r for r in rep["rows"] if r["tenant"] == reports.IDLE_TENANT]
        assert idle["components"]["operational_node_overhead"] == pytest.approx(node)
        assert all(r["components"]["operational_idle_static"] == 0 for r in people)
    else:
        assert len(people) == len(rep["rows"]) == 2
    # the usage report carries the same carbon per row
    use = reports.usage(led, ["tenant"], T0, T0 + 20, method=m)
    assert sum(r["co2e_grams"] for r in use["rows"]) == pytest.approx(op + emb, rel=0.005)
    led.stop()


def test_market_based_is_a_second_column_never_in_sci(tmp_path):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0)], end=T0 + 20)
    plain = reports.carbon(led, ["tenant"], T0, T0 + 20, method=method("share"))
    dual = reports.carbon(led, ["tenant"], T0, T0 + 20, method=method("share", market=25.0))
    (a,), (b,) = plain["rows"], dual["rows"]
    for f in ("co2e_grams", "co2e_operational_grams", "sci_grams_per_request",
              "sci_grams_per_1k_tokens"):
        assert b[f] == pytest.approx(a[f], rel=1e-12), f
    assert a["co2e_market_operational_grams"] is None and a["market_provenance"] is None
    op, _ = carbon_truth(led, T0, T0 + 20, g_per_kwh=25.0)
    assert b["co2e_market_operational_grams"] == pytest.approx(op, rel=0.005)
    assert b["provenance"]["basis"] == "location" and b["market_provenance"]["basis"] == "market"
    assert dual["totals"]["co2e_market_operational_grams"] == pytest.approx(op, rel=0.005)
    led.stop()


def test_staleness_is_judged_at_every_point_of_a_series(tmp_path):
    h = 3600.0
    f = tmp_path / "grid.csv"
    # hourly points, a gap of 8 h in the middle, hourly again
    times = [T0 + k * h for k in (0, 1, 2, 10, 11, 12)]
    f.write_text("datetime,carbonIntensity,isEstimated\n" + "".join(
        f"{reports.iso(t)},{100 + i * 10},false\n" for i, t in enumerate(times)))
    ci = CarbonIntensity.from_file(f)
    assert ci.stale_after_s == 2 * h                    # max(1 h, 2 × the median step)
    assert not ci.at(T0 + 2.5 * h).provenance.estimated     # 30 min after its point
    assert ci.at(T0 + 5 * h).provenance.estimated           # 3 h after: inside the gap
    assert not ci.at(T0 + 10.5 * h).provenance.estimated
    assert ci.at(T0 + 15 * h).provenance.estimated          # after the series
    assert ci.mean(T0 + 0.5 * h, T0 + 1.5 * h) == (pytest.approx(105.0), False)
    assert ci.mean(T0 + 1.5 * h, T0 + 2.5 * h)[1] is False
    assert ci.mean(T0 + 3.5 * h, T0 + 4.5 * h)[1] is True          # runs past 2 h after its point
    # a report whose windows fall in the gap says estimated
    led = ledger_with(tmp_path, [("A", "ta", T0 + 5 * h + 1, 2.0, 3.0)], end=T0 + 5 * h + 20)
    m = method("share", intensity=ci)
    rep = reports.carbon(led, ["tenant"], T0 + 5 * h, T0 + 5 * h + 20, method=m)
    assert rep["totals"]["provenance"]["estimated"] and rep["rows"][0]["provenance"]["estimated"]
    led.stop()


def test_requests_without_an_energy_reading_make_a_group_incomplete(tmp_path):
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0), ("B", "tb", T0 + 12, 1.0, 1.0),
                                 ("C", "tb", T0 + 14, 1.0, 1.0)], end=T0 + 20, blind_from=T0 + 10)
    m = method("share")
    for rep in (reports.carbon(led, ["tenant"], T0, T0 + 20, method=m),
                reports.usage(led, ["tenant"], T0, T0 + 20, method=m)):
        rows = {r["tenant"]: r for r in rep["rows"]}
        assert rows["ta"]["co2e_complete"] is True and rows["ta"]["requests_without_energy"] == 0
        assert rows["tb"]["co2e_complete"] is False and rows["tb"]["requests_without_energy"] == 2
    rep = reports.carbon(led, ["tenant"], T0, T0 + 20, method=m)
    assert rep["totals"]["co2e_complete"] is False
    assert rep["totals"]["unmeasured_energy_windows"] == 8
    led.stop()


def test_the_daemon_builds_the_reports_method_from_the_config():
    from appliance.daemon.accounting_link import method_of, prices_of, site_of
    cfg = config.parse('[site]\npue = 1.2\ncarbon_intensity = 300\nnode_overhead_w = 4600\n'
                       'carbon_intensity_market = 0\n[accounting]\nidle_policy = "idle"\n'
                       'currency = "EUR"\n[[accounting.rate_cards]]\neffective = 2027-01-01\n'
                       'per_device_hour = { "H100-SXM" = 3.2 }\n')
    site = site_of(cfg)
    m = method_of(cfg, site, prices_of(cfg), EmbodiedCarbon({}, {}))
    assert (m.pue, m.node_overhead_w, m.market_g_per_kwh) == (1.2, 4600.0, 0.0)
    assert m.idle_policy == "idle" and m.currency == "EUR"
    assert m.prices.usd_per_hour("H100-SXM", parse_time("2027-02-01T00:00:00Z")) == 3.2
    assert m.intensity.at(T0).g_per_kwh == 300.0
    # no market factor stated: no market column
    plain = config.parse("")
    assert method_of(plain, site_of(plain), prices_of(plain), EmbodiedCarbon({}, {})) \
        .market_g_per_kwh is None


def test_a_window_cut_by_a_card_and_an_intensity_step_is_priced_in_parts(tmp_path):
    """A card from T0 + 15 and a grid step at T0 + 5, both inside a 10-s window: each
    part of the window at its own price and intensity (windows are taken as even)."""
    led = ledger_with(tmp_path, [("A", "ta", T0 + 1, 2.0, 3.0), ("B", "tb", T0 + 12, 2.0, 3.0)],
                      end=T0 + 20)
    f = tmp_path / "grid.csv"
    f.write_text("datetime,carbonIntensity\n"
                 f"{reports.iso(T0 - 600)},100\n{reports.iso(T0 + 5)},300\n")
    m = method("share", [RateCard(T0 + 15, {"H100-SXM": 4.8})],
               intensity=CarbonIntensity.from_file(f))
    rep = reports.usage(led, ["tenant"], T0, T0 + 20, method=m)
    assert billed(rep) == pytest.approx(8 * (15 * 3.6 + 5 * 4.8) / 3600, rel=0.005)
    op = 0.0
    for start, end, meas_j in led.query('SELECT start, "end", measured_j FROM device_windows'):
        for a, b, g in ((start, min(end, T0 + 5), 100.0), (max(start, T0 + 5), end, 300.0)):
            if b > a:
                op += meas_j * (b - a) / (end - start) * PUE / 3.6e6 * g
    crep = reports.carbon(led, ["tenant"], T0, T0 + 20, method=m)
    assert sum(r["co2e_operational_grams"] for r in crep["rows"]) == pytest.approx(op, rel=0.005)
    assert crep["totals"]["intensity_g_per_kwh"]["min"] == 100.0
    assert crep["totals"]["intensity_g_per_kwh"]["max"] == 300.0
    led.stop()
