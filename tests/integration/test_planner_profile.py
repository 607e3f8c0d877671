"""`applianced profile`: a measured sweep of the real torch engine on the CPU, stored
where the planner finds it, and preferred by the planner over the roofline's."""
from __future__ import annotations

import json
import subprocess
import sys

from helpers.daemons import ROOT

from appliance.config import EngineConfig, PlannerConfig
from appliance.models.specs import spec_from_hf_config
from appliance.planner.planner import BoxShape, Planner
from appliance.planner.profiles import load_profile


def test_profile_command_measures_and_planner_uses_it(tmp_path, tiny_model):
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "appliance", "profile", "--model", str(tiny_model),
         "--state-dir", str(state), "--quick", "--repeats", "1", "--threads", "1", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "[1/10] prefill 16 tokens" in done.stderr and "[10/10] decode" in done.stderr
    out = json.loads(done.stdout)
    assert out["source"] == "measured" and out["device"] == "cpu" and out["tp"] == 1
    assert [p[0] for p in out["prefill"]] == [16, 64, 256, 1024]
    assert all(p[1] > 0 for p in out["prefill"]) and all(p[2] > 0 for p in out["decode"])
    assert len(out["decode"]) == 6 and out["kv_capacity_tokens"] > 0

    model = spec_from_hf_config(tiny_model / "config.json")
    prof = load_profile(state / "profiles", model.name, "cpu", 1)
    assert prof is not None and prof.source == "measured"
    assert prof.prefill_knee_tokens() == out["prefill_knee_tokens"]

    box = BoxShape(model, None, None, 1, 1, 1, 2, False, kv_cache_bytes=1 << 30)
    pl = Planner(PlannerConfig(), box, tmp_path / "ledger.db", EngineConfig(),
                 profile_dir=state / "profiles")
    plan = pl.plan(now=1_700_000_000.0, use_statsmodels=False)
    assert plan["profile_source"]["prefill"]["source"] == "measured"
    assert plan["current"]["split"] == "1+1" and plan["recommended"]["split"] == "1+1"
    pl.close()
    # Without a measured one, the roofline's (the simulator's CPU shape) answers.
    pl = Planner(PlannerConfig(), box, tmp_path / "ledger2.db", EngineConfig(),
                 profile_dir=tmp_path / "none")
    assert pl.plan(now=1_700_000_000.0, use_statsmodels=False)["profile_source"]["decode"][
        "source"] == "simulated"
    pl.close()
