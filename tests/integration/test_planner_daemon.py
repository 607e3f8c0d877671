"""`GET /admin/v1/plan`, the planner's gauge and `applianced plan` against a real daemon
on loopback (simulated 8xH100, Llama-3.1-70B FP8), with traffic from the openai client."""
from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys

from helpers.daemons import ROOT, http

ADMIN_KEY = "planner-test-admin"
CONFIG = f"""
[auth]
admin_keys = ["{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"]
"""
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_plan_endpoint_gauge_and_cli(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8",
                       "--sim-speed", "50", model=tiny_model, config=CONFIG)
    client = d.client(timeout=60)
    for i in range(12):     # long prompts, short answers: a prefill-heavy mix
        r = client.completions.create(model="llama-3.1-70b-fp8", prompt=f"def job_{i}(): " * 150,
                                      max_tokens=8)
        assert r.usage.completion_tokens == 8

    code, _, plan = http("GET", d.url + "/admin/v1/plan?horizon=2h", headers=AUTH)
    assert code == 200, plan
    assert plan["simulated"] is True and plan["model"] == "llama-3.1-70b-fp8"
    assert plan["horizon_s"] == 7200
    assert plan["current"]["split"] == "4+4"
    assert plan["current"]["prefill"]["gpus"] == 4 and plan["current"]["decode"]["device"] == "H100-SXM"
    rec = plan["recommended"]
    assert rec["prefill"]["workers"] + rec["decode"]["workers"] == 8
    assert {"workers", "gpus", "workers_needed", "gpus_needed", "headroom"} <= set(rec["prefill"])
    assert plan["workload"]["now"]["rate"] > 0
    assert plan["workload"]["now"]["prompt_tokens"] > 500
    assert plan["rho"]["now"] > 1 and rec["prefill"]["workers"] > rec["decode"]["workers"]
    assert plan["rho"]["forecast"] and "estimated" in plan["rho"]["source"]
    series = plan["forecast"]["rate"]
    assert series and all(p["lower"] <= p["mean"] <= p["upper"] for p in series)
    assert plan["bottleneck"]["phase"] in ("prefill", "decode") and plan["bottleneck"]["why"]
    assert plan["profile_source"]["prefill"]["source"] == "simulated"
    assert plan["tuning"]["prefill_token_budget"] <= plan["tuning"]["configured_max_batch_tokens"]

    # What-if: ten times the traffic needs more; an L40S cannot hold a 70B FP8 model.
    code, _, x10 = http("GET", d.url + "/admin/v1/plan?traffic_x=10&ttft_slo=1.5", headers=AUTH)
    assert code == 200 and x10["whatif"] == {"traffic_x": 10.0, "ttft_slo": 1.5}
    assert x10["workload"]["now"]["rate"] == 10 * plan["workload"]["now"]["rate"]
    code, _, l40s = http("GET", d.url + "/admin/v1/plan?gpu=L40S", headers=AUTH)
    assert code == 200 and l40s["profile_source"]["decode"]["device"] == "L40S"
    assert l40s["bottleneck"]["phase"] == "decode" and "KV pool" in l40s["bottleneck"]["why"]

    for query, param in [("horizon=soon", "horizon"), ("horizon=100w", "horizon"),
                         ("gpu=V100", "gpu"), ("ttft_slo=0", "ttft_slo"),
                         ("traffic_x=lots", "traffic_x"), ("colour=red", "colour")]:
        code, _, body = http("GET", d.url + "/admin/v1/plan?" + query, headers=AUTH)
        assert code == 400, (query, body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    code, _, body = http("GET", d.url + "/admin/v1/plan")         # admin keys configured
    assert code == 401 and "error" in body

    code, _, metrics = http("GET", d.url + "/metrics", headers=AUTH)
    text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
    line = next(l for l in text.splitlines()
                if l.startswith("applianced_planner_recommended_workers{") and 'group="prefill"' in l)
    assert 'simulated="true"' in line and 'site="local"' in line
    assert float(line.rsplit(" ", 1)[1]) == rec["prefill"]["workers"]
    assert 'applianced_group_workers{' in text

    # Trends in the state dir's ledger database, in the planner's own table.
    db = sqlite3.connect(d.log.parent / "state" / "ledger.db")
    assert db.execute("SELECT SUM(requests) FROM planner_minutes").fetchone()[0] == 12
    db.close()

    cli = [sys.executable, "-m", "appliance", "plan", "--url", d.url, "--admin-key", ADMIN_KEY]
    out = subprocess.run(cli + ["--json", "--horizon", "1h"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["horizon_s"] == 3600
    out = subprocess.run(cli + ["--gpu", "H200"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[SIMULATED]" in out.stdout and "bottleneck:" in out.stdout and "H200" in out.stdout
    out = subprocess.run(cli + ["--horizon", "later"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("applianced: GET /admin/v1/plan: HTTP 400")
