"""`engine.max_batch_tokens = 0`: the prefill token budget set from the profile's knee,
per worker device, resolved at start-up and reported by status, the plan and the CLI."""
from __future__ import annotations
import subprocess
import sys

from helpers.daemons import ROOT, http
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import lookup_gpu
from appliance.planner.profiles import simulated_profile


def test_daemon_applies_the_knee_of_the_simulated_profile(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8",
                       "--sim-speed", "10", model=tiny_model,
                       config="[engine]\nmax_batch_tokens = 0\n")
    knee = simulated_profile(lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100"),
                             1).prefill_knee_tokens()
    status = d.status()
    mbt = status["max_batch_tokens"]
    assert mbt["configured"] == 0 and mbt["value"] == knee and mbt["source"] == "simulated"
    assert mbt["workers"] == {w["worker"]: knee for w in status["workers"]}
    r = d.client(timeout=60).completions.create(model="llama-3.1-70b-fp8",
                                                prompt="def f(): " * 400, max_tokens=4)
    assert r.usage.completion_tokens == 4       # a prompt longer than the budget still runs
    code, _, plan = http("GET", d.url + "/admin/v1/plan?horizon=1h", timeout=60)
    assert code == 200, plan
    assert plan["tuning"]["max_batch_tokens"]["value"] == knee == plan["tuning"]["prefill_token_budget"]
    out = subprocess.run([sys.executable, "-m", "appliance", "plan", "--url", d.url],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"engine.max_batch_tokens: {knee} (auto), simulated: knee of the simulated" in out.stdout
