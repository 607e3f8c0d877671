"""`[engine] dtype`: which dtype a torch worker runs in, and bf16 parity with transformers
run in bf16."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from appliance.config import ConfigError, parse
from appliance.engines import dtypes
from appliance.engines.torch_engine import build_torch_engine
from appliance.worker.spec import WorkerSpec
from helpers import bf16_parity

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

def test_resolve_by_device_and_cpu_flags():
    bf16_cpu = frozenset({"avx2", "avx512f", "avx512_bf16"})
    amx = frozenset({"amx_tile", "amx_bf16"})
    plain = frozenset({"avx2", "avx512f"})
    assert dtypes.resolve("auto", "cpu", bf16_cpu) == (torch.float32, None)
    assert dtypes.resolve("bfloat16", "cpu", bf16_cpu) == (torch.bfloat16, None)
    assert dtypes.resolve("bfloat16", "cpu", amx) == (torch.bfloat16, None)
    dtype, note = dtypes.resolve("bfloat16", "cpu", plain)
    assert dtype == torch.float32 and "AVX512-BF16" in note and "float32" in note
    dtype, note = dtypes.resolve("float16", "cpu", bf16_cpu)      # bf16 is not fp16
    assert dtype == torch.float32 and "AVX512-FP16" in note
    assert dtypes.resolve("float32", "cpu", plain) == (torch.float32, None)
    assert dtypes.resolve("auto", "gpu", plain) == (torch.bfloat16, None)
    assert dtypes.resolve("float16", "gpu", plain) == (torch.float16, None)
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        dtypes.resolve("bf16", "cpu", plain)


def test_auto_follows_the_checkpoints_dtype_where_the_cpu_has_it():
    bf16_cpu = frozenset({"avx512f", "avx512_bf16"})
    plain = frozenset({"avx2", "avx512f"})
    bf16 = dtypes.checkpoint_dtype({"torch_dtype": "bfloat16"})
    assert bf16 == torch.bfloat16
    assert dtypes.checkpoint_dtype({"dtype": "torch.float16"}) == torch.float16  # 5.x spelling
    assert dtypes.checkpoint_dtype({"torch_dtype": "float32"}) == torch.float32
    assert dtypes.checkpoint_dtype({}) is None
    assert dtypes.checkpoint_dtype({"torch_dtype": "int8"}) is None
    assert dtypes.resolve("auto", "cpu", bf16_cpu, stored=torch.bfloat16) == (torch.bfloat16, None)
    # No instructions: fp32, and no note (nothing was asked for).
    assert dtypes.resolve("auto", "cpu", plain, stored=torch.bfloat16) == (torch.float32, None)
    assert dtypes.resolve("auto", "cpu", bf16_cpu, stored=torch.float16) == (torch.float32, None)
    assert dtypes.resolve("auto", "cpu", bf16_cpu, stored=torch.float32) == (torch.float32, None)
    assert dtypes.resolve("float32", "cpu", bf16_cpu, stored=torch.bfloat16) == (torch.float32, None)


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu\n")
    assert dtypes.cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert dtypes.cpu_supports(torch.bfloat16, dtypes.cpu_flags(arm))
    assert dtypes.cpu_flags(tmp_path / "missing") == frozenset()


def test_config_key_is_checked():
    assert parse("[engine]\ndtype = \"bfloat16\"\n").engine.dtype == "bfloat16"
    assert parse("").engine.dtype == "auto"
    with pytest.raises(ConfigError, match="engine.dtype must be auto, float32, bfloat16"):
        parse("[engine]\ndtype = \"bf16\"\n")


def _spec(model_dir, dtype: str) -> WorkerSpec:
    return WorkerSpec(worker="agg0", role="agg", engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(model_dir), block_size=16,
                      kv_cache_bytes=8 << 20, max_batch_tokens=256, dtype=dtype)


def test_worker_loads_weights_and_kv_in_the_configured_dtype(tiny_model, monkeypatch, capfd):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))
    e = build_torch_engine(_spec(tiny_model, "bfloat16"), tiny_model)
    assert e.model.dtype == torch.bfloat16 and e.kv.dtype == torch.bfloat16
    fp32 = build_torch_engine(_spec(tiny_model, "auto"), tiny_model)
    assert fp32.model.dtype == torch.float32
    # Half the bytes per element: twice the blocks in the same budget.
    assert e.blocks.num_blocks == 2 * fp32.blocks.num_blocks
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2"}))
    capfd.readouterr()
    fallback = build_torch_engine(_spec(tiny_model, "bfloat16"), tiny_model)
    assert fallback.model.dtype == torch.float32
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["applianced worker agg0: dtype bfloat16 asked for, but this CPU lacks "
                   "AVX512-BF16/AMX-BF16 (Arm: BF16): running in float32"]


def test_auto_worker_runs_a_bf16_checkpoint_in_bf16(tiny_model, tmp_path, monkeypatch):
    """A checkpoint whose config.json says bfloat16 (as released ones do) loads in bf16
    under `auto` on a CPU with the instructions, in fp32 on one without."""
    model = tmp_path / "bf16-model"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))
    e = build_torch_engine(_spec(model, "auto"), model)
    assert e.model.dtype == torch.bfloat16 and e.kv.dtype == torch.bfloat16
    assert build_torch_engine(_spec(tiny_model, "auto"), tiny_model).model.dtype == torch.float32
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2"}))
    assert build_torch_engine(_spec(model, "auto"), model).model.dtype == torch.float32


# --------------------------------------------------------------------------- bf16 parity


@pytest.mark.parametrize("make", [bf16_parity.llama, bf16_parity.gemma3], ids=["llama", "gemma3"])
def test_bf16_greedy_parity_with_transformers_in_bf16(make, tmp_path):
    """Weights and KV in bf16 on both sides, torch's attention (`bf16_parity`)."""
    bf16_parity.check_bf16_greedy_parity(make, tmp_path)
