"""gpt-oss in the paged torch engine against `transformers`' GptOssForCausalLM: attention
sinks, YaRN RoPE, biases, the top-k-then-softmax router and clamped-SwiGLU experts, and
MXFP4 experts dequantized at load; the simulator's sizing of the released configs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.layers.moe import SparseMoE, TopKSoftmaxRouter
from appliance.engines.loader import load_model, servable_shape
from appliance.engines.models.gpt_oss import dequantize_mxfp4
from appliance.models.shape import ModelLoadError
from appliance.models.specs import spec_from_hf_config

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

BLOCK = 16
VOCAB = 500
RTOL, ATOL = 1e-4, 3e-5
WINDOW = 12      # layers 0 (sliding) and 1 (full): prompts and decodes run past it

CASES = {
    # gpt-oss's own YaRN (factor 32 over 4,096 positions, not truncated); clamp at 7.
    "yarn-default": dict(),
    # a small original context and truncation move the YaRN ramp; a low clamp limit
    # makes the experts' clamps bite.
    "yarn-short-clamped": dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 64, "truncate": True,
                         "rope_theta": 10000.0},
        swiglu_limit=0.4),
}


def _config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
                tie_word_embeddings=False)
    return transformers.GptOssConfig(**(base | kw), attn_implementation="eager")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):          # sinks that take a real share
                p.copy_(torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _reload(path: Path):
    return transformers.GptOssForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def gpt_oss(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(_config(**CASES[request.param])).eval()
    _randomize(ref, seed=1)
    ref.save_pretrained(path, safe_serialization=True)
    return path, _reload(path)


class Pager:
    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], n_tokens: int) -> None:
        while len(table) * BLOCK < n_tokens:
            table.append(self.free.pop())


def run_step(model, kv, pager, tables, cached, new_tokens, is_prefill, num_prefill=None):
    ids, pos, slots = [], [], []
    for table, c, toks in zip(tables, cached, new_tokens):
        pager.grow(table, c + len(toks))
        ids += toks
        pos += range(c, c + len(toks))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + len(toks))]
    batch = AttnBatch(is_prefill=is_prefill, seq_lens_q=[len(t) for t in new_tokens],
                      context_lens=[c + len(t) for c, t in zip(cached, new_tokens)],
                      block_tables=[list(t) for t in tables], slot_mapping=torch.tensor(slots),
                      num_prefill=num_prefill)
    return model(torch.tensor(ids), torch.tensor(pos), batch, kv)


def ref_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _check_steps(model, ref):
    """Batched prompts, batched decodes, a mixed step, a cached-prefix prefill."""
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=3)
    seqs = _prompts([5, 17, 33], seed=7)
    tables: list[list[int]] = [[], [], []]
    logits = run_step(model, kv, pager, tables, [0, 0, 0], seqs, True)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], ref_logits(ref, s), rtol=RTOL, atol=ATOL)
    for _ in range(3):
        nxt = logits.argmax(-1).tolist()
        cached = [len(s) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        logits = run_step(model, kv, pager, tables, cached, [[t] for t in nxt], False)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], ref_logits(ref, s), rtol=RTOL, atol=ATOL)
    c, d = _prompts([30, 12], seed=9)
    tc: list[int] = []
    run_step(model, kv, pager, [tc], [0], [c[:BLOCK]], True)       # cached first block
    nxt = logits[:2].argmax(-1).tolist()
    logits = run_step(model, kv, pager, [tc, [], tables[0], tables[1]],
                      [BLOCK, 0, len(seqs[0]), len(seqs[1])],
                      [c[BLOCK:], d, [nxt[0]], [nxt[1]]], False, num_prefill=2)
    for i, want in enumerate((c, d, seqs[0] + [nxt[0]], seqs[1] + [nxt[1]])):
        torch.testing.assert_close(logits[i], ref_logits(ref, want), rtol=RTOL, atol=ATOL)


def _check_greedy(model, ref):
    (prompt,) = _prompts([13], seed=13)
    n = 30
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
    kv = allocate_kv_pool(model.shape, num_blocks=8, block_size=BLOCK)
    pager, table = Pager(8, seed=2), []
    assert len(prompt) + n > 3 * WINDOW
    logits = run_step(model, kv, pager, [table], [0], [prompt], True)
    got = [int(logits[0].argmax())]
    while len(got) < len(want):
        logits = run_step(model, kv, pager, [table], [len(prompt) + len(got) - 1],
                          [[got[-1]]], False)
        got.append(int(logits[0].argmax()))
    assert got == want and len(set(got)) > 3


# --------------------------------------------------------------------------- parity


def test_loads_as_gpt_oss(gpt_oss):
    path, ref = gpt_oss
    model = load_model(path)
    assert spec_from_hf_config(path).params == sum(p.numel() for p in ref.parameters())
    s = model.shape
    assert s.family == "gpt_oss" and s.attention_sinks and s.yarn is not None
    assert s.layer_windows == (WINDOW, None) and s.max_context == 256
    assert s.qkv_bias and s.o_bias and s.router_bias
    layer = model.layers[0]
    assert layer.sinks is not None and isinstance(layer.mlp, SparseMoE)
    assert isinstance(layer.mlp.router, TopKSoftmaxRouter)
    assert layer.mlp.gate_up[0].bias is not None and layer.mlp.down[0].bias is not None


def test_steps_match_transformers(gpt_oss):
    path, ref = gpt_oss
    _check_steps(load_model(path), ref)


def test_greedy_tokens_equal_generate(gpt_oss):
    path, ref = gpt_oss
    _check_greedy(load_model(path), ref)


def test_sinks_and_yarn_are_not_no_ops(gpt_oss, tmp_path):
    """The test would catch a model that ignored the sinks or YaRN's attention factor."""
    path, ref = gpt_oss
    model = load_model(path)
    (seq,) = _prompts([20], seed=1)
    kv = allocate_kv_pool(model.shape, num_blocks=4, block_size=BLOCK)
    base = run_step(model, kv, Pager(4), [[]], [0], [seq], True)[0]
    for layer in model.layers:
        layer.sinks = None
    no_sinks = run_step(model, kv, Pager(4), [[]], [0], [seq], True)[0]
    assert not torch.allclose(base, no_sinks, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(base, ref_logits(ref, seq), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- MXFP4


def test_dequantize_mxfp4_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)                      # [3, 10, 128]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # Byte 0x21: low nibble 1 -> 0.5, high nibble 2 -> 1.0, times 2^(128-127).
    one = dequantize_mxfp4(torch.full((1, 16), 0x21, dtype=torch.uint8),
                           torch.tensor([128], dtype=torch.uint8))
    assert one.shape == (32,) and one[:2].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3])


def _quantize_checkpoint(src: Path, dst: Path, seed: int):
    """`src`'s checkpoint with its experts replaced by random MXFP4 blocks (as OpenAI ships
    them), and transformers' model with the same experts dequantized by transformers."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    dense: dict[str, torch.Tensor] = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, rows_in, cols_out = tensors.pop(name).shape               # x @ W layout
        blocks = torch.randint(0, 256, (E, cols_out, rows_in // 32, 16), generator=g,
                               dtype=torch.uint8)
        scales = torch.randint(122, 126, (E, cols_out, rows_in // 32), generator=g,
                               dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors")
    ref = _reload(src)
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in dense.items():
            params[name].copy_(w)
    return ref


def test_mxfp4_experts_dequantized_at_load_match_transformers(gpt_oss, tmp_path):
    path, _ = gpt_oss
    ref = _quantize_checkpoint(path, tmp_path / "mxfp4", seed=4)
    model = load_model(tmp_path / "mxfp4")
    _check_steps(model, ref)
    _check_greedy(model, ref)
    spec = spec_from_hf_config(tmp_path / "mxfp4")
    assert spec.weight_bytes < 4          # experts counted at 4.25 bits, the rest fp32


def test_mxfp4_checkpoint_with_a_missing_scale_is_refused(gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = gpt_oss
    _quantize_checkpoint(path, tmp_path / "q", seed=5)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    gone = "model.layers.1.mlp.experts.down_proj_scales"
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"lacks tensor '{gone}'"):
        load_model(tmp_path / "q")


def test_sinks_need_the_sdpa_backend(gpt_oss):
    path, _ = gpt_oss
    model = load_model(path)
    with pytest.raises(ValueError, match="sinks .* sdpa backend only"):
        model.set_attention("bounded")


# --------------------------------------------------------------------------- simulator


def _released(layers: int, experts: int) -> dict:
    """openai/gpt-oss-{20b,120b} config.json (the fields the reader uses)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": experts,
        "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "rope_theta": 150000, "attention_bias": True, "swiglu_limit": 7.0,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"},
    }


@pytest.mark.parametrize("layers, experts, total, active, gib", [
    (24, 32, 20.91e9, 3.61e9, 12.8),     # model card Table 1: 20.91B / 3.61B, 12.8 GiB
    (36, 128, 116.83e9, 5.13e9, 60.8),   # 116.83B / 5.13B, 60.8 GiB
], ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_released_configs_are_sized_like_the_model_card(layers, experts, total, active, gib):
    cfg = _released(layers, experts)
    spec = spec_from_hf_config(cfg)
    assert spec.params == pytest.approx(total, rel=0.001)
    # The card's active count leaves out the embedding table (a lookup, not a matmul).
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    assert spec.active_params - embed == pytest.approx(active, rel=0.002)
    assert spec.weight_total_bytes() / 2**30 == pytest.approx(gib, rel=0.01)
    shape = servable_shape(cfg)
    assert shape.layer_windows == (128, None) * (layers // 2) and shape.yarn.factor == 32.0
