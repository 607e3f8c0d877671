"""engine.cpu_prefill_step_ms > 0 (500 by default): a torch CPU worker's prefill token budget
is capped so one step takes about that long (by its measured profile; 512 tokens without
one), so in disagg the decode worker gets prompts as each short step ends instead of after
one 8,192-token step, and both cores work. On by default since a quiet-machine measurement
(docs/benchmarks.md, "Against vLLM's CPU build"); 0 turns it off."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from appliance.config import Config, ConfigError, parse
from appliance.planner.profiles import Profile
from appliance.planner.tuning import CPU_DEFAULT_STEP_TOKENS, batch_tokens_json, cpu_step_tokens

# tokens -> seconds, ~13,650 tokens/s past 512 tokens
CURVE = [[64, 0.010], [128, 0.012], [256, 0.020], [512, 0.038], [1024, 0.075], [4096, 0.300]]


def _profile() -> Profile:
    return Profile(model="tiny", device="cpu", tp=1, source="measured", created=1.7e9,
                   prefill=CURVE, decode=[[1, 128, 0.01]], kv_capacity_tokens=1000)


def test_the_budget_from_the_profile_or_the_cpu_default():
    p = _profile()
    assert cpu_step_tokens(8192, 150, p) == 2048           # 0.150 s on the curve
    assert cpu_step_tokens(8192, 38, p) == 512
    assert cpu_step_tokens(320, 150, p) == 320             # the configured budget bounds it
    assert cpu_step_tokens(8192, 1, p) == 16               # slower than any: one block
    assert cpu_step_tokens(8192, 150, None) == CPU_DEFAULT_STEP_TOKENS
    assert cpu_step_tokens(256, 150, None) == 256          # a smaller configured budget stays
    assert cpu_step_tokens(8192, 0, p) == 8192             # 0: no cap


def _specs(mode: str, cfg: Config, engine: str = "torch", profiles: dict | None = None):
    from appliance.daemon.setup import worker_specs
    from appliance.partitions import discover, plan_partition
    inv = discover("cpu")
    inv = dataclasses.replace(inv, devices=(dataclasses.replace(inv.devices[0], cores=2),))
    plan = plan_partition(inv, mode=mode, cpu_threads=cfg.engine.cpu_threads)
    return {s.worker: s.max_batch_tokens
            for s in worker_specs(cfg, inv, plan, engine, Path("/m"), [0, 1], profiles=profiles)}


def test_cpu_prefill_workers_get_the_capped_budget_decode_keeps_its_own():
    assert Config().engine.cpu_prefill_step_ms == 500      # on by default
    assert _specs("disagg", Config()) == {"prefill0": CPU_DEFAULT_STEP_TOKENS, "decode0": 8192}
    off = Config()
    off.engine.cpu_prefill_step_ms = 0
    assert _specs("disagg", off) == {"prefill0": 8192, "decode0": 8192}
    cfg = Config()
    cfg.engine.cpu_prefill_step_ms = 150
    assert _specs("disagg", cfg) == {"prefill0": CPU_DEFAULT_STEP_TOKENS, "decode0": 8192}
    assert _specs("disagg", cfg, profiles={"prefill0": _profile()})["prefill0"] == 2048
    assert _specs("disagg", cfg, engine="sim") == {"prefill0": 8192, "decode0": 8192}
    cfg.engine.cpu_threads = 1       # agg workers keep theirs: no decode worker to hand to
    assert _specs("agg", cfg) == {"agg0": 8192, "agg1": 8192}


def test_status_says_why_the_budget_is_below_the_configured_one():
    got = batch_tokens_json(8192, {"prefill0": ("prefill", 1024), "decode0": ("decode", 8192)}, {})
    assert got["value"] == 1024 and got["source"] == "cpu step"
    assert "cpu_prefill_step_ms" in got["why"]


def test_config_rejects_a_negative_step_in_one_line():
    assert parse("[engine]\ncpu_prefill_step_ms = 0\n", "t.toml").engine.cpu_prefill_step_ms == 0
    with pytest.raises(ConfigError) as err:
        parse("[engine]\ncpu_prefill_step_ms = -1\n", "t.toml")
    assert "engine.cpu_prefill_step_ms must be 0" in str(err.value)
