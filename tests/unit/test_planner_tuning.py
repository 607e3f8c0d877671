"""`engine.max_batch_tokens = 0`: the prefill token budget set from the profile's knee,
per worker device, resolved at start-up and reported by status, the plan and the CLI."""
from __future__ import annotations

import json

import pytest

from appliance.config import ConfigError, parse
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import lookup_gpu
from appliance.planner.profiles import Profile, profile_filename, simulated_profile
from appliance.planner.tuning import (DEFAULT_MAX_BATCH_TOKENS, TokenBudget, batch_tokens_json,
                                      token_budget)

# Hand-built: tokens -> seconds. Throughput 6,400 / 10,667 / 12,800 / 13,474 / 13,653 tok/s;
# 90% of the best is 12,288, first reached at 256 tokens.
CURVE = [[64, 0.010], [128, 0.012], [256, 0.020], [512, 0.038], [1024, 0.075]]


def profile(curve, source="measured", device="cpu", model="tiny") -> Profile:
    return Profile(model=model, device=device, tp=1, source=source, created=1.7e9,
                   prefill=curve, decode=[[1, 128, 0.01]], kv_capacity_tokens=1000)


def test_knee_of_a_hand_built_curve():
    assert profile(CURVE).prefill_knee_tokens() == 256
    # a curve still climbing steeply at its end: the knee is its last point
    assert profile([[64, 0.01], [128, 0.01], [256, 0.01]]).prefill_knee_tokens() == 256
    # flat throughput from the start: the smallest batch already saturates
    assert profile([[64, 0.01], [128, 0.02], [256, 0.04]]).prefill_knee_tokens() == 64


def test_a_measured_profile_wins_then_the_roofline_then_the_default(tmp_path):
    m, h100 = lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100")
    sim = token_budget(m, h100, 1, tmp_path)
    assert sim == TokenBudget(simulated_profile(m, h100, 1).prefill_knee_tokens(), "simulated",
                              "H100-SXM", sim.why)
    assert 0 < sim.tokens < DEFAULT_MAX_BATCH_TOKENS and "simulated" in sim.why
    cpu = token_budget(m, None, 1, tmp_path)
    assert (cpu.tokens, cpu.source) == (DEFAULT_MAX_BATCH_TOKENS, "default")
    measured = profile(CURVE, device="H100-SXM", model=m.name)
    (tmp_path / profile_filename(m.name, "H100-SXM", 1)).write_text(json.dumps(measured.to_json()))
    got = token_budget(m, h100, 1, tmp_path)
    assert (got.tokens, got.source) == (256, "measured")
    floored = token_budget(m, h100, 1, tmp_path, floor=4096)
    assert floored.tokens == 4096 and "4096" in floored.why


def test_status_json_names_the_prefill_side_and_the_source():
    b = TokenBudget(256, "simulated", "H100-SXM", "knee")
    workers = {"prefill0": ("prefill", 256), "decode0": ("decode", 256)}
    auto = batch_tokens_json(0, workers, {"prefill0": b, "decode0": b})
    assert auto == {"configured": 0, "value": 256, "source": "simulated", "why": "knee",
                    "workers": {"prefill0": 256, "decode0": 256}}
    fixed = batch_tokens_json(8192, {"agg0": ("agg", 8192)}, {})
    assert fixed["value"] == 8192 and fixed["source"] == "configured"


def test_config_takes_zero_and_rejects_negative_in_one_line():
    assert parse("[engine]\nmax_batch_tokens = 0\n", "t.toml").engine.max_batch_tokens == 0
    with pytest.raises(ConfigError) as err:
        parse("[engine]\nmax_batch_tokens = -5\n", "t.toml")
    assert "engine.max_batch_tokens must be 0 (auto" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_worker_a_workflow_restarts_keeps_its_knee(tmp_path, tiny_model):
    """engine.max_batch_tokens = 0: a worker that a repartition or a model swap starts
    again gets the knee of its device's profile, as at start-up, not the fixed default."""
    from appliance.daemon.control import Control
    from appliance.daemon.router import Router
    from appliance.daemon.setup import plan_setup
    from appliance.daemon.state import ServedModel, ServingState
    from appliance.daemon.workers import WorkerPool
    from appliance.workflows.journal import Journal
    from appliance.workflows.machine import ModelRef
    cfg = parse(f'[devices]\nspec = "sim:8xH100"\n[engine]\nkind = "sim"\nmax_batch_tokens = 0\n'
                f'model = "{tiny_model}"\nmodel_spec = "llama-3.1-70b-fp8"\n', "t.toml")
    setup = plan_setup(cfg, tmp_path)
    knee = simulated_profile(lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100"),
                             1).prefill_knee_tokens()
    assert knee != DEFAULT_MAX_BATCH_TOKENS
    assert {s.max_batch_tokens for s in setup.specs} == {knee}
    pool = WorkerPool(setup.specs)
    state = ServingState(ServedModel(setup.model_name, setup.model_dir, "llama-3.1-70b-fp8",
                                     setup.max_context), setup.plan, 64)
    journal = Journal(tmp_path / "workflows.db")
    control = Control(cfg, setup, state, pool, Router(pool, setup.plan.mode, 0), journal,
                      profile_dir=tmp_path / "profiles")
    slot = setup.plan.workers()[0]
    same = control._spec(slot, state.model.ref)          # restarted where it ran
    swapped = control._spec(slot, ModelRef("other", str(tiny_model), "llama-3.1-70b-fp8"))
    journal.close()
    assert same.max_batch_tokens == swapped.max_batch_tokens == knee
