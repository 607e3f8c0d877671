"""Chargeback across two boxes (issue 29 §2): the decode box's `cluster_decode` rows bill
their decode time but count neither the request nor its tokens (raw rows and rollups
alike), so the two boxes' reports and FOCUS exports add up to one view of the pair."""
from __future__ import annotations

import csv
import io
import math
import sqlite3

import pytest

from appliance.accounting import focus, reports, rollups
from appliance.accounting.accountant import Site
from appliance.accounting.carbon import CarbonIntensity
from appliance.accounting.cluster_join import JoinError, join_focus, join_usage
from appliance.accounting.ledger import Ledger
from helpers.ledger_scene import PUE, box_ledger, method

START = 1_700_000_000.0
RUNS = [("R0", "ta", START + 1, 1.0, 2.0), ("R1", "tb", START + 30, 0.5, 3.0),
        ("R2", "ta", START + 500, 2.0, 1.0), ("R3", "tc", START + 2700, 1.0, 1.0)]
END = START + 3000
FRONT_SITE = Site("paris", "front", "FR", PUE, CarbonIntensity(50.0))
DECODE_SITE = Site("berlin", "decode", "DE", PUE, CarbonIntensity(480.0))
FRONT, DECODE = "http://front:8000", "http://decode:8000"


@pytest.fixture(scope="module")
def boxes(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    box_ledger(d / "front.db", "prefill", RUNS, START, END, FRONT_SITE, DECODE)
    box_ledger(d / "decode.db", "decode", RUNS, START, END, DECODE_SITE, DECODE)
    front, decode = Ledger(d / "front.db", retention_days=0), Ledger(d / "decode.db", retention_days=0)
    yield front, decode
    front.stop()
    decode.stop()


def box_method(grid: float):
    return method(intensity=CarbonIntensity(grid))


def test_the_decode_box_bills_decode_time_and_counts_no_request(boxes):
    front, decode = boxes
    rep = reports.usage(decode, ["tenant", "phase"], START, END, method=box_method(480.0))
    rows = {(r["tenant"], r["phase"]): r for r in rep["rows"]}
    assert rows[("ta", "decode")]["gpu_seconds"] == pytest.approx(4 * (2.0 + 1.0))
    assert ("ta", "prefill") not in rows          # nothing ran there, nothing counted
    assert all(r["requests"] == 0 and r["prompt_tokens"] == 0 and r["output_tokens"] == 0
               for r in rep["rows"])
    rep = reports.usage(front, ["tenant"], START, END, method=box_method(50.0))
    assert {r["tenant"]: r["requests"] for r in rep["rows"]} == {"ta": 2, "tb": 1, "tc": 1}
    assert sum(r["prompt_tokens"] for r in rep["rows"]) == 4 * 2000


def test_rolled_up_figures_count_the_same_as_raw_rows(tmp_path):
    """The rollups (what a report over whole hours reads) count a cluster_decode row
    as the raw query does: decode time yes, request and tokens no."""
    box_ledger(tmp_path / "d.db", "decode", RUNS, START, END, DECODE_SITE)
    led = Ledger(tmp_path / "d.db", retention_days=0)
    try:
        raw = reports.usage(led, ["tenant", "phase"], START, END)
        conn = sqlite3.connect(tmp_path / "d.db")
        rollups.roll_up(conn, END + 7 * 86400)
        conn.close()
        n = led.query("SELECT count(*), sum(requests), sum(gpu_s) FROM usage_rollups "
                      "WHERE period = 'hour'")[0]
        assert n[0] > 0 and n[1] == 0 and n[2] == pytest.approx(4 * 7.0)
        hour0 = math.floor(START / 3600) * 3600
        rolled = reports.usage(led, ["tenant", "phase"], hour0, hour0 + 2 * 3600)
        key = lambda rep: {(r["tenant"], r["phase"]): (r["requests"], r["output_tokens"],
                                                       round(r["gpu_seconds"], 6))
                           for r in rep["rows"]}
        assert key(rolled) == key(raw)
    finally:
        led.stop()


def test_joined_report_sums_the_boxes_and_counts_each_request_once(boxes):
    front, decode = boxes
    parts = [(FRONT, reports.usage(front, ["tenant"], START, END, method=box_method(50.0))),
             (DECODE, reports.usage(decode, ["tenant"], START, END, method=box_method(480.0)))]
    joined = join_usage(parts)
    rows = {r["tenant"]: r for r in joined["rows"]}
    assert set(rows) == {"ta", "tb", "tc"}
    for tenant, r in rows.items():
        a = next(x for x in parts[0][1]["rows"] if x["tenant"] == tenant)
        b = next(x for x in parts[1][1]["rows"] if x["tenant"] == tenant)
        for f in ("gpu_seconds", "cost_usage", "cost_allocation", "co2e_grams"):
            assert r[f] == pytest.approx(a[f] + b[f]), f
        assert r["requests"] == a["requests"] and r["prompt_tokens"] == a["prompt_tokens"]
        assert r["output_tokens"] == a["output_tokens"] and r["boxes"] == [FRONT, DECODE]
    # prefill on one box, decode on the other: the pair's whole GPU time
    assert rows["ta"]["gpu_seconds"] == pytest.approx(4 * (1.0 + 2.0 + 2.0 + 1.0))
    # carbon per box at its own site: the same decode seconds weigh more in Berlin
    a = next(x for x in parts[0][1]["rows"] if x["tenant"] == "ta")
    b = next(x for x in parts[1][1]["rows"] if x["tenant"] == "ta")
    assert b["co2e_grams"] > a["co2e_grams"]
    t = joined["totals"]
    assert t["capacity_cost"] == pytest.approx(sum(p["totals"]["capacity_cost"] for _, p in parts))
    assert sum(r["cost_allocation"] for r in joined["rows"]) == pytest.approx(t["capacity_cost"])
    assert t["utilization"] == pytest.approx(t["used_cost"] / t["capacity_cost"])


def test_join_refuses_different_groupings_and_currencies(boxes):
    front, decode = boxes
    a = reports.usage(front, ["tenant"], START, END)
    b = reports.usage(decode, ["tenant", "phase"], START, END)
    with pytest.raises(JoinError, match="grouped by"):
        join_usage([(FRONT, a), (DECODE, b)])
    with pytest.raises(JoinError, match="two currencies"):
        join_usage([(FRONT, a), (DECODE, {**a, "currency": "EUR"})])


def test_joined_focus_export_counts_requests_once_and_sums_costs(boxes):
    front, decode = boxes
    fa = focus.to_csv(focus.rows(front, START, END, box_method(50.0),
                                 focus.Source("front", "8xH100-SXM", "paris", "FR")))
    fb = focus.to_csv(focus.rows(decode, START, END, box_method(480.0),
                                 focus.Source("decode", "8xH100-SXM", "berlin", "DE")))
    text = join_focus([(FRONT, fa), (DECODE, fb)])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == len(fa.splitlines()) - 1 + len(fb.splitlines()) - 1
    # each phase's rows count each request once (a box's export has a row per phase)
    for sku in ("gpu-time:prefill", "gpu-time:decode"):
        assert sum(int(r["x_Requests"]) for r in rows if r["SkuId"] == sku) == len(RUNS)
    assert sum(int(r["x_PromptTokens"]) for r in rows) == 2000 * len(RUNS)
    assert sum(int(r["x_OutputTokens"]) for r in rows) == 100 * len(RUNS)
    decode_box = [r for r in rows if r["BillingAccountId"] == "decode"]
    assert decode_box and all(r["x_Requests"] == "0" for r in decode_box)
    assert sum(float(r["ConsumedQuantity"]) for r in decode_box
               if r["SkuId"] == "gpu-time:decode") == pytest.approx(4 * 7.0 / 3600)
    cap = sum(reports.usage(led, ["tenant"], START, END, method=box_method(g))["totals"]
              ["capacity_cost"] for led, g in ((front, 50.0), (decode, 480.0)))
    assert sum(float(r["EffectiveCost"]) for r in rows) == pytest.approx(cap, rel=1e-6)
    assert {r["RegionId"] for r in rows} == {"paris", "berlin"}
    with pytest.raises(JoinError, match="columns"):
        join_focus([(FRONT, fa), (DECODE, "A,B\n1,2\n")])


def test_one_row_per_request_joins_both_phases_of_each_request(boxes):
    """group_by request_id (the request rows, not the rollups): one row per request of
    the pair, its prefill from the front and its decode from the decode box."""
    front, decode = boxes
    dims = ["request_id", "tenant"]
    parts = [(FRONT, reports.usage(front, dims, START, END, method=box_method(50.0))),
             (DECODE, reports.usage(decode, dims, START, END, method=box_method(480.0)))]
    joined = join_usage(parts)
    rows = {r["request_id"]: r for r in joined["rows"]}
    assert set(rows) == {rid for rid, *_ in RUNS}
    for rid, tenant, _, p_s, d_s in RUNS:
        r = rows[rid]
        assert r["tenant"] == tenant and r["requests"] == 1 and r["boxes"] == [FRONT, DECODE]
        assert r["gpu_seconds"] == pytest.approx(4 * (p_s + d_s))
        assert (r["prompt_tokens"], r["output_tokens"]) == (2000, 100)
    by_tenant = join_usage([(u, reports.usage(led, ["tenant"], START, END, method=box_method(g)))
                            for u, led, g in ((FRONT, front, 50.0), (DECODE, decode, 480.0))])
    for t in by_tenant["rows"]:
        mine = [r for r in joined["rows"] if r["tenant"] == t["tenant"]]
        assert sum(r["cost_allocation"] for r in mine) == pytest.approx(t["cost_allocation"])
        assert sum(r["co2e_grams"] for r in mine) == pytest.approx(t["co2e_grams"])
    text = reports.usage_csv(joined)
    assert text.splitlines()[0].startswith("tenant,model,phase,site,request_id,")
    with pytest.raises(ValueError, match="cannot group by"):
        reports.parse_group_by("request", reports.USAGE_GROUPS, ())
