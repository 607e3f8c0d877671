"""Sliding-window attention over the paged pool, and Gemma 3, against transformers.

Every model here has a window shorter than its prompts, so a wrong mask, a block read
from before the window or a window off by one changes the logits. Blocks are 4 tokens,
so a window of 10 leaves whole blocks behind it."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers import attention
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.loader import load_model
from appliance.kv.blocks import copy_blocks
from appliance.models.shape import LlamaShape
from appliance.models.specs import spec_from_hf_config

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

BLOCK = 4
VOCAB = 300
W = 10
RTOL, ATOL = 1e-4, 3e-5


def _randomize(model: torch.nn.Module, seed: int, norm_mean: float = 1.0) -> None:
    """Weights large enough that attention is sharp (see test_torch_model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_mean + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _checkpoint(cls, cfg, path, seed: int, norm_mean: float = 1.0):
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    _randomize(ref, seed, norm_mean)
    ref.save_pretrained(path, safe_serialization=True)
    ref = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return path, ref


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager")


def _gemma_config(**kw):
    # Layers 0, 1 local (window W, rope base 10,000), layer 2 global (rope 1e6, linear x4),
    # query_pre_attn_scalar != head_dim, logit soft-capping on.
    return transformers.Gemma3TextConfig(**{
        **SMALL, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": W,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
        **kw})


CASES = {
    # every layer slides
    "mistral": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        **SMALL, num_hidden_layers=2, sliding_window=W), 1.0),
    # layer 0 full, layers 1 and 2 slide (max_window_layers), q/k/v biases
    "qwen2": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=W,
        max_window_layers=1), 1.0),
    # Gemma's norms are 1 + w: weights around 0
    "gemma3": lambda: (transformers.Gemma3ForCausalLM, _gemma_config(), 0.0),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def windowed(request, tmp_path_factory):
    cls, cfg, norm_mean = CASES[request.param]()
    return _checkpoint(cls, cfg, tmp_path_factory.mktemp(request.param), seed=3,
                       norm_mean=norm_mean)


class Pager:
    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], n_tokens: int) -> None:
        while len(table) * BLOCK < n_tokens:
            table.append(self.free.pop())


def run_step(model, kv, pager, tables, cached, new_tokens, num_prefill):
    ids, pos, slots = [], [], []
    for t, c, toks in zip(tables, cached, new_tokens):
        pager.grow(t, c + len(toks))
        ids += toks
        pos += range(c, c + len(toks))
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + len(toks))]
    batch = AttnBatch(num_prefill == len(tables), [len(t) for t in new_tokens],
                      [c + len(t) for c, t in zip(cached, new_tokens)],
                      [list(t) for t in tables], torch.tensor(slots), num_prefill=num_prefill)
    return model(torch.tensor(ids), torch.tensor(pos), batch, kv)


def ref_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", ["sdpa", "bounded", "flashinfer"])
def test_prompts_longer_than_the_window_then_decode(windowed, backend, monkeypatch):
    """Three prompts (shorter than, at, and well past the window) prefilled together,
    then decoded greedily in groups small enough to split them, each step's logits
    equal to transformers' on the whole sequence; the greedy tokens equal generate's.
    With FlashInfer (tests/fake_flashinfer.py) the full layers go through its kernels
    (with the model's score scale) and the windowed ones through the bounded path."""
    path, ref = windowed
    model = load_model(path)
    assert model.shape.max_context == 256          # not capped at the window
    if backend == "bounded":   # a budget that makes the bounded path chunk keys and rows
        model.set_attention("bounded", budget=24_000)
    if backend == "flashinfer":
        from helpers import fake_flashinfer
        module = fake_flashinfer.module()
        fake_flashinfer.calls.clear()
        monkeypatch.setitem(sys.modules, "flashinfer", module)
        model.set_attention("flashinfer", flashinfer_module=module)
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 4 * 2 * BLOCK * 2 * 16 * 4)
    kv = allocate_kv_pool(model.shape, num_blocks=64, block_size=BLOCK)
    pager = Pager(64, seed=1)
    seqs = _prompts([7, W, 37], seed=2)
    tables: list[list[int]] = [[], [], []]
    logits = run_step(model, kv, pager, tables, [0, 0, 0], seqs, 3)
    for i, s in enumerate(seqs):
        _close(logits[i], ref_logits(ref, s))
    prompts = [list(s) for s in seqs]
    for _ in range(8):
        nxt = logits.argmax(-1).tolist()
        cached = [len(s) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        logits = run_step(model, kv, pager, tables, cached, [[t] for t in nxt], 0)
        for i, s in enumerate(seqs):
            _close(logits[i], ref_logits(ref, s))
    ref.generation_config.eos_token_id = None      # greedy for all 8 tokens, as above
    if backend == "flashinfer":
        runs = [name for name, _ in fake_flashinfer.calls if name.endswith(".run")]
        full_layers = sum(model.shape.window(i) is None for i in range(model.shape.num_layers))
        assert len(runs) == 9 * full_layers         # 9 steps, only the unwindowed layers
    for p, s in zip(prompts, seqs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        assert s[len(p):] == want


@pytest.mark.parametrize("chunk", [3, 7, 13])
def test_chunked_prefill_across_the_window_is_exact(windowed, chunk):
    """A 40-token prompt in chunks that start before, at and after the window's edge,
    batched with a decoding sequence (the mixed step): each chunk's last logits equal
    transformers' on the prompt so far."""
    path, ref = windowed
    model = load_model(path)
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=chunk)
    prompt, other = _prompts([40, 15], seed=chunk)
    t_p: list[int] = []
    t_o: list[int] = []
    logits = run_step(model, kv, pager, [t_o], [0], [other], 1)
    done = 0
    while done < len(prompt):
        nxt = int(logits[-1].argmax())
        end = min(len(prompt), done + chunk)
        logits = run_step(model, kv, pager, [t_p, t_o], [done, len(other)],
                          [prompt[done:end], [nxt]], 1)
        other = other + [nxt]
        _close(logits[0], ref_logits(ref, prompt[:end]))
        _close(logits[1], ref_logits(ref, other))
        done = end


def test_prefix_cache_and_handoff_past_the_window(windowed):
    """A second request shares the first 6 blocks (24 tokens, past the window) from the
    pool and prefills the rest; then its blocks move to another pool at other ids, where
    decoding continues exactly."""
    path, ref = windowed
    model = load_model(path)
    src = allocate_kv_pool(model.shape, 30, BLOCK)
    pager = Pager(30, seed=4)
    (full,) = _prompts([33], seed=8)
    t1: list[int] = []
    run_step(model, src, pager, [t1], [0], [full[:24]], 1)
    t2 = t1[:6]
    logits = run_step(model, src, pager, [t2], [24], [full[24:]], 1)
    _close(logits[0], ref_logits(ref, full))
    dst = allocate_kv_pool(model.shape, 40, BLOCK)
    t_dst = list(range(39, 39 - len(t2), -1))
    copy_blocks(src, t2, dst, t_dst)
    seq = list(full)
    more = Pager(30, seed=5)        # ids below the copied blocks' (39 down to 31)
    for _ in range(5):
        nxt = int(logits[0].argmax())
        logits = run_step(model, dst, more, [t_dst], [len(seq)], [[nxt]], 0)
        seq.append(nxt)
        _close(logits[0], ref_logits(ref, seq))


def test_decode_reads_no_block_before_the_window():
    """The gathered blocks of a windowed decode group start at the block holding position
    ctx - W; the mask hides the positions of that block before it."""
    tables = [[9, 3, 7, 1, 5, 8], [2, 4]]
    groups = attention._decode_groups([23, 6], tables, BLOCK, 1, torch.device("cpu"), W)
    (g,) = groups
    # ctx 23: positions 13..22 visible -> blocks from index 3 (positions 12..15) on.
    assert g.blocks == 3 and g.block_ids.tolist() == [1, 5, 8, 2, 4, 2]
    visible = g.mask[:, 0, 0]
    assert visible[0].nonzero().flatten().tolist() == list(range(1, 11))  # 13..22
    assert visible[1].nonzero().flatten().tolist() == list(range(6))      # all 6 tokens
    full = attention._decode_groups([23, 6], tables, BLOCK, 1, torch.device("cpu"))
    assert full[0].block_ids.tolist()[:6] == tables[0]


# --------------------------------------------------------------------------- config reading


def test_shape_reads_layer_windows():
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_hidden_layers=12)
    g = LlamaShape.from_hf_config({**base, "architectures": ["Gemma3ForCausalLM"],
                                   "model_type": "gemma3_text", "sliding_window": 512,
                                   "sliding_window_pattern": 6})
    assert g.layer_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert (g.head_dim, g.tie_word_embeddings, g.rope_theta, g.max_context) == (
        256, True, 1e6, 131072)
    assert g.qk_norm and not g.all_layers_slide and g.hidden_act == "gelu_pytorch_tanh"
    typed = LlamaShape.from_hf_config({**base, "model_type": "gemma3_text", "sliding_window": 64,
                                       "layer_types": ["full_attention"] + ["sliding_attention"] * 11})
    assert typed.window(0) is None and typed.window(11) == 64
    m = LlamaShape.from_hf_config({**base, "model_type": "mistral", "sliding_window": 32})
    assert m.all_layers_slide and m.max_context == 2048
    q = LlamaShape.from_hf_config({**base, "model_type": "qwen2", "use_sliding_window": True,
                                   "sliding_window": 32, "max_window_layers": 8})
    assert q.layer_windows == (None,) * 8 + (32,) * 4
    assert LlamaShape.from_hf_config({**base, "model_type": "llama"}).layer_windows == ()


def test_simulator_spec_reads_gemma3(tmp_path):
    """The simulator sizes Gemma 3 from its config.json: parameters as transformers counts
    them (four norms a layer, q/k norms, tied head), its window and its local layers."""
    cfg = _gemma_config(sliding_window=512)
    model = transformers.Gemma3ForCausalLM(cfg)
    cfg.save_pretrained(tmp_path)
    spec = spec_from_hf_config(tmp_path)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert (spec.sliding_window, spec.sliding_layers, spec.layers) == (512, 2, 3)
    per_layer = 2 * 2 * 16 * spec.kv_bytes
    assert spec.kv_bytes_for_context(100) == 3 * 100 * per_layer
    assert spec.kv_bytes_for_context(4096) == (2 * 512 + 4096) * per_layer


# --------------------------------------------------------------------------- freeing blocks


def _engine(path, num_blocks: int, chunk: int = 0):
    import json

    from appliance.engines.kv_pool import kv_pool_bytes_per_block
    from appliance.engines.loader import servable_shape
    from appliance.engines.torch_engine import build_torch_engine
    from appliance.worker.spec import WorkerSpec

    shape = servable_shape(json.loads((path / "config.json").read_text()))
    per_block = kv_pool_bytes_per_block(shape, BLOCK, torch.float32)
    spec = WorkerSpec(worker="agg0", role="agg", engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(path), block_size=BLOCK,
                      kv_cache_bytes=num_blocks * per_block, max_batch_tokens=512,
                      max_seqs=8, prefill_chunk_tokens=chunk)
    eng = build_torch_engine(spec, path)
    eng.eos_token_ids = ()
    return eng


def test_blocks_behind_every_window_are_freed_only_when_every_layer_slides(windowed):
    """An engine decoding 24 tokens after a 30-token prompt (chunked by 8): with every
    layer windowed (Mistral) the blocks behind the window go back to the pool as it
    decodes, the sequence never holding more than the window's blocks plus two; with a
    full-attention layer (Qwen2 here, Gemma 3) none does. Either way the greedy tokens are
    transformers', every block comes back at the end, and a second request with the same
    prompt is served from the prefix cache (freed blocks keep their hashes) with the same
    tokens."""
    from appliance.engines.messages import Prefill, RequestFailed, SamplingParams, Tokens

    path, ref = windowed
    eng = _engine(path, num_blocks=48, chunk=8)
    all_slide = eng.model.shape.all_layers_slide
    assert (eng.kv_window == W) == all_slide and (eng.kv_window is None) != all_slide
    (prompt,) = _prompts([30], seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()

    def run(rid):
        out, cached, held = [], None, []
        assert eng.add(Prefill(rid, prompt, params, handoff=False)) == []
        while eng.has_work():
            for ev in eng.step():
                assert not isinstance(ev, RequestFailed), ev
                if isinstance(ev, Tokens) and ev.request_id == rid:
                    out += ev.tokens
                    cached = ev.cached_tokens if cached is None else cached
            seq = eng._seqs.get(rid)
            if seq is not None and seq.num_output:
                held.append((sum(b >= 0 for b in seq.block_table), len(seq.block_table)))
        return out, cached, held

    out, _, held = run("a")
    assert out == want
    assert held[-1][1] == -(-(len(prompt) + 22) // BLOCK)   # the table covers the context
    if all_slide:
        assert max(h for h, _ in held[5:]) <= -(-W // BLOCK) + 2 < held[-1][1]
    else:
        assert all(h == n for h, n in held)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    out2, cached2, _ = run("b")
    assert out2 == want and cached2 >= 6 * BLOCK


def test_gemma_numerics_both_config_spellings_and_refusals():
    from appliance.engines.loader import servable_shape
    from appliance.engines.models.gemma3 import GemmaNumerics
    from appliance.models.shape import ModelLoadError

    # transformers 4.x (google/gemma-3-1b-it's config.json): flat rope keys
    v4 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
          "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 256, "query_pre_attn_scalar": 256, "rope_theta": 1000000,
          "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
          "sliding_window_pattern": 6, "final_logit_softcapping": None,
          "max_position_embeddings": 32768}
    n = GemmaNumerics.from_hf_config(v4)
    assert n == GemmaNumerics(256.0, 10000.0, 1.0, None)
    s = servable_shape(v4)
    assert (s.rope_theta, s.sliding_window, s.window(5), s.window(4)) == (1e6, 512, None, 512)
    # transformers 5: rope_parameters per layer type; the 4B's linear x8 on global layers
    v5 = {**v4, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}},
        "final_logit_softcapping": 30.0}
    del v5["rope_theta"], v5["rope_local_base_freq"]
    assert GemmaNumerics.from_hf_config(v5) == GemmaNumerics(256.0, 5000.0, 8.0, 30.0)
    assert servable_shape(v5).rope_theta == 1e6
    for bad, why in ((dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                     (dict(use_bidirectional_attention=True), "bidirectional"),
                     (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'")):
        with pytest.raises(ModelLoadError, match=why):
            servable_shape({**v4, **bad})
    # The multimodal checkpoints are refused with the supported list.
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration.*Gemma3ForCausalLM"):
        servable_shape({"architectures": ["Gemma3ForConditionalGeneration"],
                        "model_type": "gemma3", "text_config": v4})
