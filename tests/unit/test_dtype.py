"""`[engine] dtype`: which dtype a torch worker runs in, and bf16 parity with transformers
run in bf16."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from appliance.config import ConfigError, parse
from appliance.engines import dtypes
from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.loader import load_model
from appliance.engines.torch_engine import build_torch_engine
from appliance.worker.spec import WorkerSpec

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

VOCAB = 300
BLOCK = 8


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


def _llama(path):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM, cfg, 1.0


def _gemma(path):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, sliding_window=12, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM, cfg, 0.0


@pytest.mark.parametrize("make", [_llama, _gemma], ids=["llama", "gemma3"])
def test_bf16_greedy_parity_with_transformers_in_bf16(make, tmp_path):
    """Weights and KV in bf16 on both sides (transformers' eager attention, ours over the
    paged pool): prefill and 12 greedy decode steps give the same tokens, and the logits
    agree within what bf16 rounding allows: 3% of the logits' range (observed here: up to
    2% for Llama, 1% for Gemma 3)."""
    cls, cfg, norm_mean = make(tmp_path)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            mean = norm_mean if "norm" in name else 0.0
            p.copy_(mean + (0.2 if "norm" in name else 0.15) * torch.randn(p.shape, generator=g))
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ref = cls.from_pretrained(tmp_path, dtype=torch.bfloat16,
                              attn_implementation="eager").eval()
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    kv = allocate_kv_pool(model.shape, 16, BLOCK, dtype=torch.bfloat16)
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    table = list(range(16))[::-1]
    seq = list(prompt)
    ours = []
    cached = 0
    while len(seq) < len(prompt) + 12:
        new = seq[cached:]
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, len(seq))]
        batch = AttnBatch(cached == 0, [len(new)], [len(seq)], [table], torch.tensor(slots))
        logits = model(torch.tensor(new), torch.tensor(range(cached, len(seq))), batch, kv)
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0, -1].float()
        # 3% of the logits' range: bf16's 2^-8 steps, through every layer's rounding
        torch.testing.assert_close(logits[0], want, rtol=0.0,
                                   atol=0.03 * float(want.abs().max()))
        cached = len(seq)
        seq.append(int(logits[0].argmax()))
        ours.append(seq[-1])
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
