"""Qwen3, Qwen3-MoE and Mixtral in the paged torch engine against `transformers`: logits of
prefill, decode, mixed and prefix-cached steps, and greedy tokens equal to `generate`; the
mixture-of-experts layer against a per-token reference; and the simulator's sizing of
the same config.json files (total weights for memory, active ones for a step)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.layers.linear import Linear
from appliance.engines.layers.moe import Router, SparseMoE
from appliance.engines.loader import SUPPORTED_ARCHITECTURES, load_model, servable_shape
from appliance.engines.roofline import StepTimeModel, DeviceShape
from appliance.models.shape import ARCHITECTURES, LlamaShape, ModelLoadError
from appliance.models.specs import lookup_model_spec, spec_from_hf_config

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

BLOCK = 16
VOCAB = 500
RTOL, ATOL = 1e-4, 3e-5      # as tests/test_torch_model.py (fused SDPA vs eager rounding)

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False)

# family -> (config class, model class, config kwargs beyond _COMMON)
FAMILIES = {
    # head_dim * heads != hidden; attention biases on.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True)),
    # 8 experts, top 2, renormalized; layer 1 dense (mlp_only_layers).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)),
    # transformers' default: top-k weights not renormalized; 3 layers, all sparse.
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                                norm_topk_prob=False, num_hidden_layers=3)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp and routing far from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def make_checkpoint(family: str, path: Path, seed: int = 1, **overrides):
    """A random `family` checkpoint saved with save_pretrained: (dir, transformers' model
    reloaded from it)."""
    cfg_cls, model_cls, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**(_COMMON | kw | overrides),
                                         attn_implementation="eager")
    cls = getattr(transformers, model_cls)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    _randomize(ref, seed)
    ref.save_pretrained(path, safe_serialization=True)
    return path, cls.from_pretrained(path, attn_implementation="eager",
                                     dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path, ref = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, ref


class Pager:
    """Shuffled, non-contiguous block ids."""

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


def ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# --------------------------------------------------------------------------- parity


def test_family_loads_as_its_own_layers(family):
    name, path, _ = family
    model = load_model(path)
    s = model.shape
    cfg = json.loads((path / "config.json").read_text())
    assert s.architecture == cfg["architectures"][0]
    assert s.qk_norm == name.startswith("qwen3")
    assert all((layer.q_norm is not None) == s.qk_norm for layer in model.layers)
    moe = [isinstance(layer.mlp, SparseMoE) for layer in model.layers]
    if name == "qwen3":
        assert not any(moe) and s.num_experts == 0
    elif name == "qwen3_moe":
        assert moe == [True, False] and s.dense_mlp_layers == (1,) and s.norm_topk_prob
    else:
        assert all(moe) and s.num_experts == len(model.layers[0].mlp.gate_up)
        assert s.norm_topk_prob == (name == "mixtral")


def test_prefill_decode_and_mixed_steps_match_transformers(family):
    """Batched prompts of 5, 17 and 33 tokens, four batched decode steps, then a mixed step
    (a prompt chunk continuing over its cached first chunk, a fresh prompt, decodes)."""
    _, path, ref = family
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, num_blocks=48, block_size=BLOCK)
    pager = Pager(48, seed=3)
    seqs = _prompts([5, 17, 33], seed=7)
    tables: list[list[int]] = [[], [], []]
    logits = run_step(model, kv, pager, tables, [0, 0, 0], seqs, is_prefill=True)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], ref_logits(ref, s), rtol=RTOL, atol=ATOL)
    for _ in range(4):
        nxt = logits.argmax(-1).tolist()
        cached = [len(s) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        logits = run_step(model, kv, pager, tables, cached, [[t] for t in nxt], False)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], ref_logits(ref, s), rtol=RTOL, atol=ATOL)

    c, d = _prompts([30, 12], seed=9)
    tc, td = [], []
    run_step(model, kv, pager, [tc], [0], [c[:10]], True)
    nxt = logits[:2].argmax(-1).tolist()
    logits = run_step(model, kv, pager, [tc, td, tables[0], tables[1]],
                      [10, 0, len(seqs[0]), len(seqs[1])],
                      [c[10:25], d, [nxt[0]], [nxt[1]]], False, num_prefill=2)
    for i, want in enumerate((c[:25], d, seqs[0] + [nxt[0]], seqs[1] + [nxt[1]])):
        torch.testing.assert_close(logits[i], ref_logits(ref, want), rtol=RTOL, atol=ATOL)


def test_prefix_cached_prefill_matches_transformers(family):
    _, path, ref = family
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, num_blocks=16, block_size=BLOCK)
    pager = Pager(16, seed=11)
    (full,) = _prompts([40], seed=5)
    t1: list[int] = []
    run_step(model, kv, pager, [t1], [0], [full[:BLOCK]], True)
    t2 = [t1[0]]      # shares the cached first block, computes the other 24 tokens
    logits = run_step(model, kv, pager, [t2], [BLOCK], [full[BLOCK:]], True)
    torch.testing.assert_close(logits[0], ref_logits(ref, full), rtol=RTOL, atol=ATOL)


def test_greedy_tokens_equal_generate(family):
    _, path, ref = family
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, num_blocks=16, block_size=BLOCK)
    pager = Pager(16, seed=2)
    (prompt,) = _prompts([21], seed=13)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
    table: list[int] = []
    logits = run_step(model, kv, pager, [table], [0], [prompt], True)
    got = [int(logits[0].argmax())]
    while len(got) < len(want):
        logits = run_step(model, kv, pager, [table], [len(prompt) + len(got) - 1],
                          [[got[-1]]], False)
        got.append(int(logits[0].argmax()))
    assert got == want
    assert len(set(got)) > 3         # it walks, it does not repeat one token


# --------------------------------------------------------------------------- MoE layer


def _moe(experts=6, top_k=2, renormalize=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    D, I = 24, 40
    gate_up = [torch.randn(2 * I, D, generator=g) * 0.3 for _ in range(experts)]
    down = [torch.randn(D, I, generator=g) * 0.3 for _ in range(experts)]
    router = torch.randn(experts, D, generator=g)
    moe = SparseMoE(Router(Linear(router.clone()), top_k, renormalize),
                    [Linear(w.clone()) for w in gate_up], [Linear(w.clone()) for w in down])
    return moe, (router, gate_up, down), g


def _per_token(x, router, gate_up, down, top_k, renormalize):
    """The definition, one token and one expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], -1)
        w, idx = probs.topk(top_k)
        if renormalize:
            w = w / w.sum()
        for wi, e in zip(w, idx.tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += wi * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 50])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sparse_moe_equals_the_per_token_definition(tokens, renormalize):
    moe, (router, gate_up, down), g = _moe(renormalize=renormalize)
    x = torch.randn(tokens, 24, generator=g)
    got = moe(x)
    torch.testing.assert_close(got, _per_token(x, router, gate_up, down, 2, renormalize),
                               rtol=1e-5, atol=1e-5)
    if tokens == 50:       # many tokens: every expert gets work, in one group each
        _, chosen = moe.router(x)
        assert set(chosen.flatten().tolist()) == set(range(6))
    weights, _ = moe.router(x)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    else:
        assert (weights.sum(-1) < 1).all()


# --------------------------------------------------------------------------- errors


def test_unsupported_architecture_names_every_supported_one():
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               vocab_size=VOCAB)
    with pytest.raises(ModelLoadError) as e:
        servable_shape(cfg)
    line = str(e.value)
    assert "\n" not in line and "unsupported architecture 'DeepseekV3ForCausalLM'" in line
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES and arch in line
    # The simulator's reader (which the daemon runs first) knows exactly what the engine runs.
    assert set(ARCHITECTURES.values()) == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_checkpoint_missing_an_expert_is_refused(name, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_checkpoint(name, tmp_path / "src")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    gone = next(k for k in sorted(tensors) if ".experts.3." in k)
    save_file({k: v for k, v in tensors.items() if k != gone}, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"lacks tensor '{gone}'"):
        load_model(d)
    cfg = json.loads((path / "config.json").read_text())
    key = "num_local_experts" if name == "mixtral" else "num_experts"
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9"):
        servable_shape({**cfg, "num_experts_per_tok": 9, key: 4})


# --------------------------------------------------------------------------- simulator


QWEN3_30B_A3B = {   # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {    # mistralai/Mixtral-8x7B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN3_8B = {        # Qwen/Qwen3-8B config.json
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("cfg, total, active", [
    (QWEN3_30B_A3B, 30.53e9, 3.35e9),   # model card: 30.5B total, 3.3B activated
    (MIXTRAL_8X7B, 46.70e9, 12.88e9),   # Mistral: 46.7B total, 12.9B active
    (QWEN3_8B, 8.19e9, 8.19e9),         # model card: 8.2B
], ids=["qwen3-30b-a3b", "mixtral-8x7b", "qwen3-8b"])
def test_model_spec_from_a_checkpoint_directory(cfg, total, active, tmp_path):
    """`--model-spec DIR` reads config.json like the engine: total parameters size the
    memory, active ones a step's compute and weight reads."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_hf_config(tmp_path)
    assert lookup_model_spec(str(tmp_path)) == spec == lookup_model_spec(
        str(tmp_path / "config.json"))
    assert spec.params == pytest.approx(total, rel=0.005)
    assert spec.active_params == pytest.approx(active, rel=0.005)
    shape = LlamaShape.from_hf_config(cfg)
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (
        shape.num_layers, shape.num_kv_heads, shape.head_dim)
    assert spec.weight_total_bytes() == spec.params * 2
    h100 = DeviceShape("h100", 989e12, 3.35e12, 80e9, 450e9)
    step = StepTimeModel(h100, 1, spec)
    # One decoding sequence reads its active weights; a large batch at most all of them.
    assert step._weight_bytes_read(1) == pytest.approx(spec.active_params * 2)
    assert step._weight_bytes_read(10_000) == spec.weight_total_bytes()
    # The KV pool gets what the *total* weights leave.
    free = 80e9 * 0.9 - spec.params * 2
    assert step.kv_capacity_tokens() == (int(free // spec.kv_bytes_per_token()) if free > 0
                                         else 0)


def test_moe_spec_matches_the_loaded_engine_model(family):
    """The simulator's total parameter count is what the engine actually holds."""
    _, path, ref = family
    spec = spec_from_hf_config(path)
    assert spec.params == sum(p.numel() for p in ref.parameters())
    model = load_model(path)
    held = model.embed.numel() + model.norm.numel() + model.lm_head.dense().numel()
    for layer in model.layers:
        held += layer.attn_norm.numel() + layer.mlp_norm.numel()
        held += layer.qkv.dense().numel() + layer.o.dense().numel()
        held += sum(t.numel() for t in (layer.qkv.bias, layer.o.bias, layer.q_norm,
                                        layer.k_norm) if t is not None)
        if isinstance(layer.mlp, SparseMoE):
            held += layer.mlp.router.gate.dense().numel()
            held += sum(w.dense().numel() for w in layer.mlp.gate_up + layer.mlp.down)
        else:
            held += layer.mlp.gate_up.dense().numel() + layer.mlp.down.dense().numel()
    assert held == spec.params
    if model.shape.num_experts:
        assert spec.active_params < spec.params


def test_model_spec_names_what_it_cannot_size(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'.*checkpoint directory"):
        lookup_model_spec("nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                      "hidden_size": 64}))
    with pytest.raises(ValueError, match="cannot size .*lacks"):
        lookup_model_spec(str(tmp_path))
