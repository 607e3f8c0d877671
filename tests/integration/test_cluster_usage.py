"""`applianced usage --url FRONT --url DECODE` against two real daemons (simulated
devices), each on a ledger the real accountant wrote for one box of a prefill/decode
pair (helpers/ledger_scene.box_ledger): the front's rows bill prefill and count the
requests, the decode box's `cluster_decode` rows bill decode under the same ids. The
joined report equals the sum of the boxes' own reports, with the front's request count;
a box that is down stops the join with one line naming it."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import time
import urllib.parse

import pytest

from appliance.accounting.accountant import Site
from appliance.accounting.carbon import CarbonIntensity
from helpers.daemons import ROOT, free_port, http
from helpers.ledger_scene import PUE, box_ledger

# an hour ago, on a 10-s window boundary: inside the daemons' retention, before they start
START = math.floor((time.time() - 3600) / 10) * 10
RUNS = [("R0", "ta", START + 1, 1.0, 2.0), ("R1", "tb", START + 30, 0.5, 3.0),
        ("R2", "ta", START + 500, 2.0, 1.0), ("R3", "tc", START + 900, 1.0, 1.0)]
END = START + 1000
WINDOW = {"since": str(START), "until": str(END)}


def cli(*args: str):
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def config(site: str, region: str, grid: float) -> str:
    return (f'[site]\nname = "{site}"\nappliance = "{site}-box"\nregion = "{region}"\n'
            f'carbon_intensity = {grid}\n')


@pytest.fixture
def pair(daemon_factory, tmp_path):
    """(front, decode): daemon_factory's first two daemons live in tmp_path/d0 and d1."""
    decode_url = "http://decode-box:8000"
    box_ledger(tmp_path / "d0" / "state" / "ledger.db", "prefill", RUNS, START, END,
               Site("paris", "paris-box", "FR", PUE, CarbonIntensity(50.0)), decode_url)
    box_ledger(tmp_path / "d1" / "state" / "ledger.db", "decode", RUNS, START, END,
               Site("berlin", "berlin-box", "DE", PUE, CarbonIntensity(480.0)), decode_url)
    args = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "50")
    front = daemon_factory(*args, model=None, config=config("paris", "FR", 50.0))
    decode = daemon_factory(*args, model=None, config=config("berlin", "DE", 480.0))
    return front, decode


def report(d, **params) -> dict:
    code, _, body = http("GET", f"{d.url}/admin/v1/usage?" + urllib.parse.urlencode(
        {**WINDOW, **params}))
    assert code == 200, body
    return body


def test_two_boxes_join_into_one_report_counting_each_request_once(pair):
    front, decode = pair
    a, b = report(front, group_by="tenant"), report(decode, group_by="tenant")
    assert {r["tenant"]: r["requests"] for r in a["rows"]} == {"ta": 2, "tb": 1, "tc": 1}
    assert all(r["requests"] == 0 and r["gpu_seconds"] > 0 for r in b["rows"])
    out = cli("usage", "--url", front.url, "--url", decode.url, "--by", "tenant", "--json",
              "--since", WINDOW["since"], "--until", WINDOW["until"])
    assert out.returncode == 0, out.stderr
    joined = json.loads(out.stdout)
    rows = {r["tenant"]: r for r in joined["rows"]}
    assert set(rows) == {"ta", "tb", "tc"}
    for tenant, r in rows.items():
        pa = next(x for x in a["rows"] if x["tenant"] == tenant)
        pb = next(x for x in b["rows"] if x["tenant"] == tenant)
        for f in ("gpu_seconds", "energy_joules", "cost_usage", "cost_allocation", "co2e_grams"):
            assert r[f] == pytest.approx(pa[f] + pb[f]), (tenant, f)
        for f in ("requests", "prompt_tokens", "output_tokens"):
            assert r[f] == pa[f], (tenant, f)
    assert sum(r["requests"] for r in joined["rows"]) == 4
    # the pair's whole GPU time: 4 prefill devices, then 4 decode devices, per request
    assert sum(r["gpu_seconds"] for r in joined["rows"]) == pytest.approx(
        4 * sum(p + d for *_, p, d in RUNS))
    assert joined["totals"]["capacity_cost"] == pytest.approx(
        a["totals"]["capacity_cost"] + b["totals"]["capacity_cost"])
    # by phase: prefill from the front, decode from the decode box
    out = cli("usage", "--url", front.url, "--url", decode.url, "--by", "tenant,phase",
              "--json", "--since", WINDOW["since"], "--until", WINDOW["until"])
    phases = {(r["tenant"], r["phase"]): r for r in json.loads(out.stdout)["rows"]}
    assert phases[("ta", "prefill")]["boxes"] == [front.url]
    assert phases[("ta", "decode")]["boxes"] == [front.url, decode.url]
    assert phases[("ta", "decode")]["gpu_seconds"] == pytest.approx(4 * (2.0 + 1.0))
    # one row per request: both boxes' phases of it, counted once
    out = cli("usage", "--url", front.url, "--url", decode.url, "--by", "request_id,tenant",
              "--json", "--since", WINDOW["since"], "--until", WINDOW["until"])
    assert out.returncode == 0, out.stderr
    per_request = {r["request_id"]: r for r in json.loads(out.stdout)["rows"]}
    assert set(per_request) == {rid for rid, *_ in RUNS}
    for rid, tenant, _, p_s, d_s in RUNS:
        r = per_request[rid]
        assert (r["tenant"], r["requests"], r["boxes"]) == (tenant, 1, [front.url, decode.url])
        assert r["gpu_seconds"] == pytest.approx(4 * (p_s + d_s))
    # the table says which boxes it joined
    out = cli("usage", "--url", front.url, "--url", decode.url, "--since", WINDOW["since"],
              "--until", WINDOW["until"])
    assert out.returncode == 0 and f"boxes: {front.url}, {decode.url}" in out.stdout, out.stderr


def test_joined_focus_export_sums_both_boxes_without_double_counting(pair):
    front, decode = pair
    out = cli("usage", "--url", front.url, "--url", decode.url, "--focus",
              "--since", WINDOW["since"], "--until", WINDOW["until"])
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert {r["RegionId"] for r in rows} == {"paris", "berlin"}
    assert {r["BillingAccountId"] for r in rows} == {"paris-box", "berlin-box"}
    for sku in ("gpu-time:prefill", "gpu-time:decode"):
        assert sum(int(r["x_Requests"]) for r in rows if r["SkuId"] == sku) == 4
    capacity = sum(report(d, group_by="tenant")["totals"]["capacity_cost"] for d in pair)
    assert sum(float(r["EffectiveCost"]) for r in rows) == pytest.approx(capacity, rel=1e-4)
    csv_out = cli("usage", "--url", front.url, "--url", decode.url, "--csv",
                  "--since", WINDOW["since"], "--until", WINDOW["until"])
    got = list(csv.DictReader(io.StringIO(csv_out.stdout)))
    assert sum(int(r["requests"]) for r in got) == 4


def test_a_box_that_is_down_is_one_line_naming_it(pair):
    front, _ = pair
    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    out = cli("usage", "--url", front.url, "--url", dead, "--since", "2h")
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and dead in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert time.monotonic() - start < 60
    out = cli("usage", "--url", front.url, "--url", dead, "--focus", "--since", "2h")
    assert out.returncode != 0 and dead in out.stderr and len(out.stderr.strip().splitlines()) == 1
