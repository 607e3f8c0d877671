"""`applianced plan --url A --url B`: the roles of a two-box fleet (issue 29) on two
real simulated daemons of different shapes (8xH100 and 4xL40S) whose trends are seeded
decode-heavy (chat with long answers): the L40S box, relatively better at prefill
(FLOP/s per byte/s), takes prefill and the H100 box decode; the numbers, what one more
box changes and the [cluster] snippets come out as text and as JSON."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.accounting.records import RequestRecord
from appliance.config import PlannerConfig
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import lookup_gpu
from appliance.planner.fleet_roles import box_capacity, fleet_need
from appliance.planner.planner import BoxShape, Planner
from helpers.daemons import ROOT, http

MODEL = "llama-3.1-8b"


def seed_chat(state: Path, gpu: str, gpus: int, minutes: int = 15, rate: float = 3.0) -> None:
    """`minutes` of chat traffic up to now (short prompts, long answers, Poisson
    arrivals), written as the daemon's planner writes finished requests."""
    spec = lookup_gpu(gpu)
    box = BoxShape(lookup_model_spec(MODEL), spec, spec, gpus // 2, gpus // 2, 1, gpus, True)
    pl = Planner(PlannerConfig(), box, state / "ledger.db")
    rng = random.Random(11)
    now = time.time()
    t, i = now - minutes * 60, 0
    while True:
        t += rng.expovariate(rate)
        if t >= now - 1:
            break
        out = rng.randint(400, 800)
        pl.observe(RequestRecord(f"seed{i}", "t", MODEL, "chat", rng.randint(200, 400), out, 0,
                                 t, t + 0.1, t + 0.1 + 0.02 * out, "prefill0", "decode0", "ok",
                                 "length", simulated=True))
        i += 1
    pl.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "plan", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.fixture
def two_shapes(daemon_factory, tiny_model, tmp_path):
    seed_chat(tmp_path / "d0" / "state", "H100", 8)
    seed_chat(tmp_path / "d1" / "state", "L40S", 4)
    site = "[site]\nname = \"lab\"\nappliance = \"{}\"\n"
    h100 = daemon_factory("--devices", "sim:8xH100", "--model-spec", MODEL, "--sim-speed", "50",
                          model=tiny_model, config=site.format("h100-box"))
    l40s = daemon_factory("--devices", "sim:4xL40S", "--model-spec", MODEL, "--sim-speed", "50",
                          model=tiny_model, config=site.format("l40s-box"))
    return h100, l40s


def test_fleet_roles_on_two_daemons_of_different_shapes(two_shapes):
    h100, l40s = two_shapes
    plans = {}
    for d in (h100, l40s):
        code, _, plans[d.url] = http("GET", d.url + "/admin/v1/plan?horizon=7d")
        assert code == 200
    assert plans[h100.url]["box"]["workers"] == [{"device": "H100-SXM", "count": 8}]
    assert plans[l40s.url]["box"]["workers"] == [{"device": "L40S", "count": 4}]
    assert plans[l40s.url]["box"]["model_spec"] == MODEL
    assert plans[l40s.url]["cluster"] == {"role": "both", "peers": []}
    for p in plans.values():                         # the trend each box shows: decode-heavy
        assert p["rho"]["now"] is not None and p["rho"]["now"] < 1

    done = _cli("--url", h100.url, "--url", l40s.url, "--horizon", "7d", "--json")
    assert done.returncode == 0, done.stderr
    roles = json.loads(done.stdout)["roles"]
    by = {b["appliance"]: b for b in roles["roles"]}
    assert by["l40s-box"]["role"] == "prefill" and by["h100-box"]["role"] == "decode"
    assert by["h100-box"]["shape"].startswith("8xH100") and by["l40s-box"]["gpus"] == 4
    assert roles["simulated"] is True and roles["fits"] is True
    assert roles["need"]["horizon_s"] == 7 * 86400
    # The need is the two boxes' forecast peaks added up; the capacities are the sizing
    # model's on each GPU kind at that need (recomputed here from the plans the test got:
    # the CLI fetched its own a moment later, so allow the clock's drift).
    need = fleet_need(list(plans.values()))
    assert roles["need"]["rate"] == pytest.approx(need.rate, rel=0.25)
    cap = box_capacity(l40s.url, plans[l40s.url], need)
    assert by["l40s-box"]["prefill_rps"] == pytest.approx(cap.prefill_rps, rel=0.1)
    assert roles["capacity"]["prefill"] == pytest.approx(by["l40s-box"]["prefill_rps"])
    assert roles["capacity"]["decode"] == pytest.approx(by["h100-box"]["decode_tps"])
    assert roles["config"]["l40s-box"].startswith('[cluster]\nrole = "prefill"\n'
                                                  f'peers = ["{h100.url}"]')
    assert f'peers = ["{l40s.url}"]' in roles["config"]["h100-box"]
    added = {x["shape"]: x for x in roles["if_added"]}
    assert set(added) == {"8xH100-SXM tp1", "4xL40S tp1"}
    # the phase with the least headroom binds (which one depends on the seeded trend's
    # forecast at this moment): one more L40S box takes that phase
    bind = min(roles["headroom"], key=roles["headroom"].get)
    assert bind in ("prefill", "decode")
    assert added["4xL40S tp1"]["role"] == bind
    assert min(added["4xL40S tp1"]["headroom"].values()) > min(roles["headroom"].values())

    text = _cli("--url", h100.url, "--url", l40s.url, "--horizon", "7d")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "roles by box [SIMULATED]" in out and "within 168 h" in out
    assert "why: 1 prefill + 1 decode:" in out
    assert "with one more 8xH100-SXM tp1 box: it takes " in out
    assert f"with one more 4xL40S tp1 box: it takes {bind}" in out and 'role = "decode"' in out
    assert "config to apply" in out and "Traceback" not in text.stderr
