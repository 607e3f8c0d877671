"""The paged Llama forward pass against transformers' reference implementation."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from appliance.engines.kv_pool import allocate_kv_pool, kv_pool_bytes_per_block, layout_tag
from appliance.engines.layers import attention
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.loader import load_model, servable_shape
from appliance.engines.layers import linear as linear_layer
from appliance.engines.layers.linear import Linear
from appliance.engines.sampling import SamplingState, sample
from appliance.kv import blocks
from appliance.kv.blocks import copy_blocks
from appliance.models.shape import LlamaShape, ModelLoadError, RopeScaling

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

BLOCK = 16
VOCAB = 500
# atol: the fused SDPA kernel (4-d inputs, used for prompts) rounds differently from
# transformers' eager attention; observed |diff| up to 1.1e-5 on near-zero logits.
RTOL, ATOL = 1e-4, 3e-5


# --------------------------------------------------------------------------- fixtures


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp (default init makes it near-uniform,
    which would hide RoPE and masking bugs); non-trivial norms and biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _save(model: torch.nn.Module, path: Path, **kw) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


LLAMA_CASES = {
    # llama3 rope scaling; original_max 64 makes long wavelengths actually scaled.
    "llama3rope": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        head_dim=None,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=10000.0,
    ),
    # plain rope, 3 layers, head_dim * heads != hidden_size.
    "plainrope_hd32": dict(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        head_dim=32,
        rope_scaling=None,
        rope_theta=500000.0,
    ),
}


@pytest.fixture(scope="module", params=sorted(LLAMA_CASES))
def llama(request, tmp_path_factory):
    kw = dict(LLAMA_CASES[request.param])
    head_dim = kw.pop("head_dim")
    extra = {"head_dim": head_dim} if head_dim else {}
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        **extra,
        **kw,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    _randomize(ref, seed=1)
    path = _save(ref, tmp_path_factory.mktemp(request.param))
    ref = transformers.LlamaForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    return path, ref


class Pager:
    """Hands out shuffled, non-contiguous block ids and builds AttnBatches."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], n_tokens: int) -> None:
        while len(table) * BLOCK < n_tokens:
            table.append(self.free.pop())

    @staticmethod
    def slots(table: list[int], start: int, end: int) -> list[int]:
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


def run_step(model, kv, pager, tables, cached, new_tokens, is_prefill, num_prefill=None,
             hidden_rows=None):
    """Run one step: sequence i has `cached[i]` tokens in the pool and `new_tokens[i]` new
    (`hidden_rows`: rows whose final hidden states the step keeps, as prompt logprobs ask)."""
    ids, pos, slots = [], [], []
    for i, toks in enumerate(new_tokens):
        c = cached[i]
        pager.grow(tables[i], c + len(toks))
        ids += toks
        pos += range(c, c + len(toks))
        slots += Pager.slots(tables[i], c, c + len(toks))
    batch = AttnBatch(
        is_prefill=is_prefill,
        seq_lens_q=[len(t) for t in new_tokens],
        context_lens=[c + len(t) for c, t in zip(cached, new_tokens)],
        block_tables=[list(t) for t in tables],
        slot_mapping=torch.tensor(slots),
        num_prefill=num_prefill,
    )
    if hidden_rows is not None:
        batch.hidden_rows = torch.tensor(hidden_rows)
    out = model(torch.tensor(ids), torch.tensor(pos), batch, kv)
    run_step.batch = batch
    return out


def ref_last_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# --------------------------------------------------------------------------- numerics


def test_a_loaded_model_keeps_nothing_of_the_checkpoints_mapping(llama, tmp_path):
    """Checkpoint and model in the same dtype: no tensor needs converting, and one uncopied
    slice of safetensors' mapping (a norm's weight) would keep the whole file mapped, every
    page the load read counted in the worker's memory. The model holds copies, equal to
    the checkpoint's tensors."""
    import gc

    from safetensors.torch import load_file

    path = shutil.copytree(llama[0], tmp_path / "ckpt")   # the fixture's own file: mapped by
    weights = path / "model.safetensors"                 # its transformers reference

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(str(weights) in line for line in f)
    model = load_model(path, dtype=torch.float32)
    gc.collect()
    assert not mapped()
    saved = load_file(str(weights))
    assert saved["model.norm.weight"].dtype == torch.float32    # so no cast copied it
    assert mapped()                                             # the check sees a mapping
    torch.testing.assert_close(model.norm, saved["model.norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(model.layers[0].attn_norm,
                               saved["model.layers.0.input_layernorm.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("group_blocks,lengths", [
    (None, [5, 17, 33]), (1, [5, 17, 33]), (6, [5, 17, 33]), (None, [17, 150, 5])])
def test_prefill_then_decode_matches_transformers(llama, group_blocks, lengths, monkeypatch):
    """Decode attends in groups of sequences bounded in gathered bytes: by default one
    group here; a bound of 1 block makes each sequence its own group; 6 blocks puts the
    two shorter sequences (1 and 2 blocks, different lengths: masked) together. With a
    150-token sequence between a 17- and a 5-token one, the padding bound leaves the long
    one alone and groups the two short ones out of the batch's order (rows 2 and 0)."""
    path, ref = llama
    model = load_model(path)
    if group_blocks is not None:
        per_layer = kv_pool_bytes_per_block(model.shape, BLOCK, torch.float32)
        per_layer //= model.shape.num_layers
        monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", group_blocks * per_layer)
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=3)
    seqs = _prompts(lengths, seed=7)
    tables: list[list[int]] = [[], [], []]
    made: list[list[tuple]] = []
    groups = attention._decode_groups
    monkeypatch.setattr(attention, "_decode_groups", lambda *a: made.append(
        [list(range(g.first, g.end)) if g.rows is None else g.rows.tolist()
         for g in groups(*a)]) or groups(*a))

    logits = run_step(model, kv, pager, tables, [0, 0, 0], seqs, is_prefill=True)
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, s), rtol=RTOL, atol=ATOL)
    # The blocks really are scattered.
    assert any(b2 != b1 + 1 for t in tables for b1, b2 in zip(t, t[1:]))

    for _ in range(4):
        nxt = sample(logits, [SamplingState.create(0.0)] * 3)
        cached = [len(s) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        logits = run_step(model, kv, pager, tables, cached, [[t] for t in nxt], is_prefill=False)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], ref_last_logits(ref, s), rtol=RTOL, atol=ATOL)
    if lengths[1] == 150:
        assert made and all(m == [[2, 0], [1]] for m in made), made


def test_mixed_step_of_prompt_chunks_and_decodes_matches_transformers(llama):
    """Chunked prefill's mixed batch: prompt chunks (one continuing over its earlier chunk,
    one fresh) and decoding sequences in one forward pass, attended each their own way."""
    path, ref = llama
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=5)
    a, b, c, d = _prompts([7, 21, 30, 12], seed=9)
    tables: list[list[int]] = [[], [], [], []]
    # a and b are decoding; c has its first 10 tokens in the pool; d is new.
    logits = run_step(model, kv, pager, tables[:3], [0, 0, 0], [a, b, c[:10]], True)
    nxt = logits[:2].argmax(-1).tolist()
    logits = run_step(model, kv, pager, [tables[2], tables[3], tables[0], tables[1]],
                      [10, 0, len(a), len(b)], [c[10:25], d, [nxt[0]], [nxt[1]]], False,
                      num_prefill=2)
    for i, want in enumerate((c[:25], d, a + [nxt[0]], b + [nxt[1]])):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, want), rtol=RTOL, atol=ATOL)


class _Rows:
    """An MLP that notes how many rows each call gets (`seen`, by layer)."""

    def __init__(self, mlp, li: int, seen: list):
        self.mlp, self.li, self.seen = mlp, li, seen

    def __call__(self, x, *a):
        self.seen.append((self.li, x.shape[0]))
        return self.mlp(x, *a)


def test_the_last_layer_carries_only_the_rows_whose_logits_are_read(llama):
    """Past the last layer's attention a step keeps only each prompt's last row and the
    decoding rows (the other rows' o-projection and MLP feed nothing): a mixed step of two
    prompt chunks (15 and 12 rows) and two decodes sends 29 rows through every MLP but the
    last, which gets 4; the logits still equal transformers', and so do the next decode's
    (every row's K and V was written). A step that keeps the prompt's hidden states
    (prompt logprobs) sends every row through."""
    path, ref = llama
    model = load_model(path)
    seen: list[tuple[int, int]] = []
    for li, layer in enumerate(model.layers):
        layer.mlp = _Rows(layer.mlp, li, seen)
    last = len(model.layers) - 1
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=5)
    a, b, c, d = _prompts([7, 21, 30, 12], seed=9)
    tables: list[list[int]] = [[], [], [], []]
    logits = run_step(model, kv, pager, tables[:3], [0, 0, 0], [a, b, c[:10]], True)
    assert seen[-1] == (last, 3) and seen[0] == (0, 7 + 21 + 10)
    nxt = logits[:2].argmax(-1).tolist()
    seen.clear()
    logits = run_step(model, kv, pager, [tables[2], tables[3], tables[0], tables[1]],
                      [10, 0, len(a), len(b)], [c[10:25], d, [nxt[0]], [nxt[1]]], False,
                      num_prefill=2)
    assert seen == [(li, 29) for li in range(last)] + [(last, 4)]
    for i, want in enumerate((c[:25], d, a + [nxt[0]], b + [nxt[1]])):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, want), rtol=RTOL, atol=ATOL)
    # the next step decodes d over the KV its prompt step wrote for all 12 rows
    tok = int(logits[1].argmax())
    logits = run_step(model, kv, pager, [tables[3]], [len(d)], [[tok]], False)
    torch.testing.assert_close(logits[0], ref_last_logits(ref, d + [tok]), rtol=RTOL, atol=ATOL)

    seen.clear()
    t5: list[int] = []
    (e,) = _prompts([9], seed=4)
    logits = run_step(model, kv, pager, [t5], [0], [e], True, hidden_rows=list(range(8)))
    assert seen[-1] == (last, 9) and run_step.batch.hidden.shape == (8, model.shape.hidden_size)
    torch.testing.assert_close(logits[0], ref_last_logits(ref, e), rtol=RTOL, atol=ATOL)


def test_decode_groups_bound_gathered_bytes(monkeypatch):
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 6)
    tables = [[7], [3, 9], [1, 2, 4], [5, 6, 8, 10, 11, 12, 13], [0]]
    groups = attention._decode_groups([6, 18, 34, 100, 16], tables, 16, 1, torch.device("cpu"))
    # Shortest first (ties in the batch's order): rows 0, 4 and 1 (2 blocks each once
    # padded: 6 bytes), then 2 and 3 alone.
    assert [(g.rows.tolist() if g.rows is not None else list(range(g.first, g.end)),
             g.blocks, g.context) for g in groups] == [
        ([0, 4, 1], 2, 18), ([2], 3, 34), ([3], 7, 100)]
    assert groups[0].size == 3 and groups[1].rows is None and groups[2].rows is None
    # Sequences 0 and 4 are padded with their own first block and masked past their tokens.
    assert groups[0].block_ids.tolist() == [7, 7, 0, 0, 3, 9]
    assert groups[0].mask[:, 0, 0].sum(1).tolist() == [6, 16, 18]
    assert all(g.mask is None for g in groups[1:])
    # Padding bounded: short and long contexts that fit one group's bytes are still
    # attended apart, each with its like; one group left keeps the batch's order.
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 4 << 20)
    long_tables = [list(range(100 * i, 100 * i + 80)) for i in range(4)]
    apart = attention._decode_groups([60, 1200, 61, 1207], long_tables, 16, 1, torch.device("cpu"))
    assert [g.rows.tolist() for g in apart] == [[0, 2], [1, 3]]
    assert [(g.blocks, g.context) for g in apart] == [(4, 61), (76, 1207)]
    near = attention._decode_groups([1207, 1000, 1200], long_tables, 16, 1, torch.device("cpu"))
    assert [(g.first, g.end, g.rows) for g in near] == [(0, 3, None)]
    # On a GPU (only the device type is looked at) the batch stays one group.
    one = attention._decode_groups([6, 18, 34, 100, 16], tables, 16, 1, torch.device("meta"))
    assert [(g.first, g.end, g.blocks, g.context) for g in one] == [(0, 5, 7, 100)]


def test_prefix_cached_prefill_matches_full_prefill(llama):
    path, ref = llama
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, num_blocks=24, block_size=BLOCK)
    pager = Pager(24, seed=11)
    full, other = _prompts([40, 9], seed=5)

    # Request 1 prefills only the first block (16 tokens).
    t1: list[int] = []
    run_step(model, kv, pager, [t1], [0], [full[:BLOCK]], is_prefill=True)
    # Request 2 shares that block and prefills the remaining 24 tokens, batched with an
    # uncached sequence.
    t2, t3 = [t1[0]], []
    logits = run_step(
        model, kv, pager, [t3, t2], [0, BLOCK], [other, full[BLOCK:]], is_prefill=True
    )
    torch.testing.assert_close(logits[0], ref_last_logits(ref, other), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logits[1], ref_last_logits(ref, full), rtol=RTOL, atol=ATOL)

    # A one-token prefill on a long cached prefix (the masking offset at its extreme).
    t4 = list(t2[:2])
    logits = run_step(model, kv, pager, [t4], [32], [full[32:33]], is_prefill=True)
    torch.testing.assert_close(logits[0], ref_last_logits(ref, full[:33]), rtol=RTOL, atol=ATOL)


def test_kv_handoff_between_pools_continues_decode(llama):
    """Prefill in one pool, copy the blocks to other ids in another pool, decode there."""
    path, ref = llama
    model = load_model(path)
    src = allocate_kv_pool(model.shape, 12, BLOCK).share_memory_()
    dst = allocate_kv_pool(model.shape, 20, BLOCK)
    (prompt,) = _prompts([21], seed=9)
    t_src: list[int] = []
    logits = run_step(model, src, Pager(12, seed=1), [t_src], [0], [prompt], is_prefill=True)
    first = int(logits.argmax())
    t_dst = [17, 4]
    copy_blocks(src, t_src, dst, t_dst)
    logits = run_step(model, dst, Pager(0), [t_dst], [21], [[first]], is_prefill=False)
    torch.testing.assert_close(
        logits[0], ref_last_logits(ref, prompt + [first]), rtol=RTOL, atol=ATOL
    )


def _checkpoint(cls, cfg, path: Path, seed: int):
    """A randomized `cls` checkpoint saved to `path`: (our model, transformers' reloaded)."""
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    _randomize(ref, seed=seed)
    _save(ref, path)
    ref = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return load_model(path), ref


def test_qwen2_bias_and_tied_embeddings(tmp_path):
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model, ref = _checkpoint(transformers.Qwen2ForCausalLM, cfg, tmp_path, seed=2)
    assert model.shape.qkv_bias and not model.shape.o_bias and model.shape.tie_word_embeddings
    kv = allocate_kv_pool(model.shape, 8, BLOCK)
    pager = Pager(8, seed=2)
    seqs = _prompts([19, 3], seed=4)
    tables: list[list[int]] = [[], []]
    logits = run_step(model, kv, pager, tables, [0, 0], seqs, is_prefill=True)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, s), rtol=RTOL, atol=ATOL)
    nxt = logits.argmax(-1).tolist()
    logits = run_step(model, kv, pager, tables, [19, 3], [[t] for t in nxt], is_prefill=False)
    for i, s in enumerate(seqs):
        ref_l = ref_last_logits(ref, s + [nxt[i]])
        torch.testing.assert_close(logits[i], ref_l, rtol=RTOL, atol=ATOL)


def test_mistral_sliding_window_is_attended_past_the_window(tmp_path):
    # Mistral v0.1 slides a 4,096-token window on every layer; the engine attends over the
    # window (tests/test_sliding_window.py has the rest), and serves the whole context.
    W = 20
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=W, attn_implementation="eager",
    )
    model, ref = _checkpoint(transformers.MistralForCausalLM, cfg, tmp_path, seed=3)
    assert (model.shape.sliding_window, model.shape.max_context) == (W, 128)
    (seq,) = _prompts([W + 6], seed=5)
    kv = allocate_kv_pool(model.shape, 8, BLOCK)
    logits = run_step(model, kv, Pager(8, seed=3), [[]], [0], [seq], is_prefill=True)
    torch.testing.assert_close(logits[0], ref_last_logits(ref, seq), rtol=RTOL, atol=ATOL)
    # Past the window transformers masks the oldest tokens: full attention gives other logits.
    full = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not torch.allclose(logits[0], ref_last_logits(full, seq), rtol=1e-2, atol=1e-2)


def test_sharded_checkpoint_loads(llama, tmp_path):
    path, ref = llama
    sharded = _save(ref, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_model(path), load_model(sharded)
    torch.testing.assert_close(a.layers[-1].mlp.gate_up.dense(), b.layers[-1].mlp.gate_up.dense(), rtol=0, atol=0)
    torch.testing.assert_close(a.lm_head.dense(), b.lm_head.dense(), rtol=0, atol=0)


# --------------------------------------------------------------------------- config / errors


def _hf(**kw):
    base = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        hidden_act="silu",
    )
    base.update(kw)
    return base


def test_shape_parsing_variants():
    s = LlamaShape.from_hf_config(_hf())
    assert (s.head_dim, s.rope_theta, s.rope_scaling) == (16, 10000.0, None)
    assert not s.tie_word_embeddings
    # transformers 4.x spelling: top-level rope_theta, rope_scaling with "type".
    s = LlamaShape.from_hf_config(
        _hf(
            rope_theta=500000.0,
            rope_scaling={
                "type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    assert s.rope_theta == 500000.0
    assert s.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    s = LlamaShape.from_hf_config(_hf(architectures=["MistralForCausalLM"], sliding_window=4096))
    assert not s.qkv_bias and (s.sliding_window, s.max_context) == (4096, 2048)
    mistral = _hf(architectures=["MistralForCausalLM"], max_position_embeddings=32768)
    m = LlamaShape.from_hf_config(mistral)   # MistralConfig's default window, not a cap
    assert (m.sliding_window, m.max_context, m.all_layers_slide) == (4096, 32768, True)
    assert LlamaShape.from_hf_config({**mistral, "sliding_window": None}).layer_windows == ()
    qwen = _hf(architectures=["Qwen2ForCausalLM"], max_position_embeddings=32768,
               sliding_window=4096, num_hidden_layers=24, max_window_layers=21)
    assert LlamaShape.from_hf_config(qwen).sliding_window is None   # use_sliding_window off
    on = {**qwen, "use_sliding_window": True}
    assert LlamaShape.from_hf_config(on).layer_windows == (None,) * 21 + (4096,) * 3
    assert LlamaShape.from_hf_config({**on, "max_window_layers": 24}).sliding_window is None
    assert LlamaShape.from_hf_config(
        {**on, "layer_types": ["full_attention"] * 24}).sliding_window is None
    assert LlamaShape.from_hf_config(_hf(sliding_window=16)).sliding_window is None  # Llama
    s = LlamaShape.from_hf_config(_hf(attention_bias=True))
    assert s.qkv_bias and s.o_bias
    s = LlamaShape.from_hf_config(_hf(num_key_value_heads=None, head_dim=32))
    assert (s.num_kv_heads, s.head_dim) == (4, 32)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (_hf(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
        (_hf(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
        (_hf(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "unsupported rope scaling"),
        (_hf(rope_scaling={"rope_type": "llama3", "factor": 4.0}), "lacks 'low_freq_factor'"),
        (_hf(num_key_value_heads=3), "not a multiple"),
        (_hf(hidden_size=None), "lacks 'hidden_size'"),
    ],
)
def test_shape_rejects(cfg, message):
    """What the torch engine cannot run is refused before any weight is read."""
    with pytest.raises(ModelLoadError, match=message):
        servable_shape(cfg)


def _copy_ckpt(llama, tmp_path) -> Path:
    src, _ = llama
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_load_errors(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_ckpt(llama, tmp_path)
    weights = d / "model.safetensors"
    tensors = load_file(weights)

    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'FalconForCausalLM'"):
        load_model(d)
    (d / "config.json").write_text(json.dumps(cfg))

    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, weights)
    with pytest.raises(ModelLoadError, match=f"lacks tensor '{name}'"):
        load_model(d)

    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, weights)
    with pytest.raises(ModelLoadError, match=f"tensor '{name}'.*has shape"):
        load_model(d)

    weights.write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="corrupt safetensors file .*model.safetensors"):
        load_model(d)

    weights.unlink()
    with pytest.raises(ModelLoadError, match="no weights in"):
        load_model(d)

    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing .*config.json"):
        load_model(d)


def test_missing_shard(llama, tmp_path):
    _, ref = llama
    d = _save(ref, tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing weight shard .*{shard.name}"):
        load_model(d)


def test_bad_batch_is_rejected(llama):
    path, _ = llama
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, 4, BLOCK)
    bad = AttnBatch(False, [2], [2], [[0]], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="one new token per sequence"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), bad, kv)
    short_table = AttnBatch(True, [20], [20], [[0]], torch.arange(20))
    with pytest.raises(ValueError, match="1 blocks of 16"):
        model(torch.arange(20), torch.arange(20), short_table, kv)


# --------------------------------------------------------------------------- KV pool


def test_linear_packed_for_the_cpu_and_plain_elsewhere(monkeypatch):
    """fp32 CPU weights are kept only in oneDNN's packed layout; the product is F.linear's
    (to fp32 rounding) for any batch, with and without bias; without oneDNN (or on
    another dtype) the plain weight is kept and F.linear runs."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = Linear(w.clone(), b)
    if linear_layer._onednn_ok():
        assert packed.packed is not None and packed.weight is None
    for shape in ((1, 64), (7, 64), (64, 64), (3, 5, 64)):
        x = torch.randn(shape, generator=g)
        torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Linear(w.clone())(x), torch.nn.functional.linear(x, w),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.dense(), w)

    half = Linear(w.to(torch.float64))
    assert half.packed is None and half.weight.dtype == torch.float64
    bf = Linear(w.to(torch.bfloat16))           # bf16 is packed too, where oneDNN takes it
    assert (bf.packed is not None) == linear_layer._onednn_ok(torch.bfloat16)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    torch.testing.assert_close(bf(xb), torch.nn.functional.linear(xb, wb), rtol=1e-2, atol=2e-2)
    monkeypatch.setattr(linear_layer, "_ONEDNN_OK",
                        {torch.float32: False, torch.bfloat16: False})
    plain = Linear(w, b)
    assert plain.packed is None and plain.dense() is w
    assert torch.equal(plain(x), torch.nn.functional.linear(x, w, b))


def test_pool_layout_and_copy_blocks():
    shape = LlamaShape.from_hf_config(_hf())
    src = allocate_kv_pool(shape, 6, BLOCK)
    assert src.shape == (2, 2, 6, BLOCK, 2, 16)
    assert kv_pool_bytes_per_block(shape, BLOCK, torch.float32) == src[:, :, 0].nbytes
    assert kv_pool_bytes_per_block(shape, BLOCK, torch.bfloat16) == src[:, :, 0].nbytes // 2
    assert layout_tag(shape, BLOCK, torch.float32) == "L2-kvh2-hd16-bs16-float32"
    assert layout_tag(shape, 32, torch.bfloat16) == "L2-kvh2-hd16-bs32-bfloat16"

    src.copy_(torch.randn(src.shape))
    dst = allocate_kv_pool(shape, 9, BLOCK)
    before = dst.clone()
    copy_blocks(src, [4, 1, 5], dst, [0, 8, 3])
    for s, d in ((4, 0), (1, 8), (5, 3)):
        assert torch.equal(dst[:, :, d], src[:, :, s])  # K and V, every layer
    untouched = [b for b in range(9) if b not in (0, 8, 3)]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])

    # Destination runs filled from scattered, consecutive, and reversed sources, in any
    # order of the pairs: every block lands where a block-by-block copy would put it.
    rng = random.Random(5)
    big_src = torch.randn(2, 2, 40, BLOCK, 2, 16)
    for case in range(20):
        n = rng.randint(1, 30)
        s_ids = rng.sample(range(40), n) if case % 3 else list(range(7, 7 + n))
        start = rng.randint(0, 40 - n)
        d_ids = list(range(start, start + n)) if case % 2 else rng.sample(range(40), n)
        if case % 5 == 0:
            s_ids.reverse()
        pairs = list(zip(s_ids, d_ids))
        rng.shuffle(pairs)
        got, want = torch.zeros_like(big_src), torch.zeros_like(big_src)
        copy_blocks(big_src, [p[0] for p in pairs], got, [p[1] for p in pairs])
        for s, d in pairs:
            want[:, :, d] = big_src[:, :, s]
        assert torch.equal(got, want), f"case {case}: {pairs}"
        # What runs between GPUs (peer pool on another device), here on CPU tensors:
        # slice copies per stretch, strided over all rows or one per row.
        _, stretches, _ = blocks._stretches([p[1] for p in pairs], [p[0] for p in pairs])
        for per_row in (False, True):
            alt = torch.zeros_like(big_src)
            blocks._copy_stretches(big_src.view(4, 40, -1), alt.view(4, 40, -1),
                                        stretches, per_row)
            assert torch.equal(alt, want), f"case {case}, per_row={per_row}: {pairs}"

    # Within one pool, sources and destinations overlapping: as if read before written.
    pool = torch.randn(2, 2, 8, BLOCK, 2, 16)
    want = pool.clone()
    want[:, :, [3, 4, 5]] = pool[:, :, [2, 3, 4]]
    copy_blocks(pool, [2, 3, 4], pool, [3, 4, 5])
    assert torch.equal(pool, want)

    copy_blocks(src, [], dst, [])  # no-op
    with pytest.raises(ValueError, match="layouts differ"):
        copy_blocks(src, [0], allocate_kv_pool(shape, 6, 32), [0])
    with pytest.raises(ValueError, match="dtypes differ"):
        copy_blocks(src, [0], allocate_kv_pool(shape, 6, BLOCK, dtype=torch.float64), [0])
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(src, [6], dst, [0])
    with pytest.raises(ValueError, match="duplicate"):
        copy_blocks(src, [0, 1], dst, [2, 2])
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        copy_blocks(src, [0, 1], dst, [2])


# --------------------------------------------------------------------------- sampling


def test_sampling_seeded_independent_of_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g)

    def run(rows, seeds, steps=8):
        states = [SamplingState.create(0.9, 0.8, seed=s) for s in seeds]
        return [sample(logits[rows], states) for _ in range(steps)]

    alone = run([2], [1234])
    mixed = run([0, 2, 3], [5, 1234, 6])
    assert [s[0] for s in alone] == [s[1] for s in mixed]
    assert len({s[0] for s in alone}) > 1  # it does sample, not argmax every time
    assert run([2], [1234]) == alone
    assert run([2], [99]) != alone or run([2], [98]) != alone


def test_sampling_greedy_and_tiny_top_p():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = logits[1, 300] = logits[1].max() + 1.0  # tie -> lowest id
    greedy = [SamplingState.create(0.0) for _ in range(3)]
    assert sample(logits, greedy) == logits.argmax(-1).tolist()
    assert sample(logits, greedy)[1] == 7
    tiny = [SamplingState.create(1.0, top_p=1e-6, seed=i) for i in range(3)]
    assert sample(logits, tiny) == [int(logits[0].argmax()), 7, int(logits[2].argmax())]
    mixed = [SamplingState.create(0.0), SamplingState.create(1.0, 1.0, seed=3), greedy[2]]
    out = sample(logits, mixed)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert 0 <= out[1] < VOCAB
    for bad in (dict(temperature=-1.0), dict(temperature=1.0, top_p=0.0)):
        with pytest.raises(ValueError):
            SamplingState.create(**bad)
