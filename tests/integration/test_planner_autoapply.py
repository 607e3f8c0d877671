"""Auto-apply on a real daemon: the planner, seeing a prefill-heavy history in the
ledger database, starts the repartition workflow through the daemon's workflow engine
(no HTTP), exactly once; the workflow completes and the live partition becomes the
recommended split. With auto_apply off nothing starts, though the plan differs.

A simulated 8xH100 serving Llama-3.1-70B FP8; the trends are seeded in the state
directory's ledger.db before the daemon starts (the planner's own table, written by
the planner's own TrendStore), so the test needs no minutes of traffic."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from appliance.accounting.records import RequestRecord
from appliance.config import PlannerConfig
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import lookup_gpu
from appliance.planner.planner import BoxShape, Planner
from helpers.daemons import http, start_daemon

MODEL = "llama-3.1-70b-fp8"
SIM = ("--devices", "sim:8xH100", "--model-spec", MODEL, "--sim-speed", "50")
CONFIG = """
[planner]
auto_apply = {auto}
auto_apply_after_s = 2.0
horizon = "1h"
[workflows]
drain_timeout_s = 10.0
[workers]
restart_backoff_s = 0.1
"""


def seed_trends(state: Path, minutes: int = 15, rate: float = 4.0, model: str = MODEL,
                devices: int = 8) -> None:
    """`minutes` of code-completion traffic up to now (long prompts, short answers,
    Poisson arrivals), written as the daemon's planner writes finished requests."""
    h100 = lookup_gpu("H100")
    box = BoxShape(lookup_model_spec(model), h100, h100, devices // 2, devices // 2, 1,
                   devices, True)
    pl = Planner(PlannerConfig(), box, state / "ledger.db")
    rng = random.Random(7)
    now = time.time()
    t, i = now - minutes * 60, 0
    while True:
        t += rng.expovariate(rate)
        if t >= now - 1:
            break
        out = rng.randint(10, 40)
        pl.observe(RequestRecord(f"seed{i}", "t", model, "completions", rng.randint(1500, 2600),
                                 out, 0, t, t + 0.3, t + 0.3 + 0.03 * out, "prefill0", "decode0",
                                 "ok", "length", simulated=True))
        i += 1
    pl.close()


def get(d, path: str) -> dict:
    code, _, body = http("GET", d.url + path)
    assert code == 200, body
    return body


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.parametrize("auto", [True, False], ids=["auto_apply_on", "auto_apply_off"])
def test_auto_apply_starts_the_repartition_once(tmp_path, tiny_model, auto):
    root = tmp_path / "d"
    seed_trends(root / "state")
    t0 = time.monotonic()
    d = start_daemon(root, tiny_model, *SIM, config=CONFIG.format(auto=str(auto).lower()))
    try:
        plan = get(d, "/admin/v1/plan")
        assert plan["current"]["split"] == "4+4"
        target = plan["recommended"]["split"]
        p, dd = map(int, target.split("+"))
        assert p > dd and p + dd == 8, plan["recommended"]          # prefill-heavy history
        assert plan["auto_apply"]["enabled"] is auto

        if auto:
            wf = wait(lambda: next(iter(get(d, "/admin/v1/workflows")["data"]), None), 30,
                      "the planner to start a workflow")
            assert wf["kind"] == "repartition" and wf["params"] == {"split": target}
            done = wait(lambda: (w := get(d, f"/admin/v1/workflows/{wf['id']}"))["status"]
                        in ("succeeded", "failed", "compensated") and w, 90,
                        "the repartition to finish")
            assert done["status"] == "succeeded", done
            status = get(d, "/admin/v1/status")
            assert status["partition"] == target
            roles = [w["role"] for w in status["workers"] if w["state"] == "ready"]
            assert roles.count("prefill") == p and roles.count("decode") == dd
            # A few more ticks: the planner now sees the new split as current, so nothing
            # else starts, and it lists the one attempt it made.
            time.sleep(3 * 0.5 + 1.5)
            after = get(d, "/admin/v1/plan")
            assert after["current"]["split"] == target
            assert after["recommended"]["split"] == target
            assert [a["split"] for a in after["auto_apply"]["applied"]] == [target]
            assert after["auto_apply"]["applied"][0]["workflow"]["id"] == wf["id"]
            assert len(get(d, "/admin/v1/workflows")["data"]) == 1
        else:
            # The difference is noticed (its clock runs) and outlasts auto_apply_after_s,
            # yet nothing starts.
            since = wait(lambda: get(d, "/admin/v1/plan")["auto_apply"]["differs_since"], 30,
                         "the planner to notice the difference")
            wait(lambda: time.time() - since > 2.0 + 3.0, 30, "auto_apply_after_s to pass")
            assert get(d, "/admin/v1/workflows")["data"] == []
            assert get(d, "/admin/v1/status")["partition"] == "4+4"
            assert get(d, "/admin/v1/plan")["auto_apply"]["applied"] == []
    finally:
        d.stop()
    assert time.monotonic() - t0 < 240
