"""Attention over the paged pool without materialized masks (issue 24 §2a), on the CPU:

- the bounded-memory path (queries and heads in chunks) and the FlashInfer wiring (against
  tests/fake_flashinfer.py, which follows FlashInfer's documented API and semantics) give
  transformers' logits on prefill, decode batches of mixed lengths, mixed chunked steps and
  prefills after a prefix hit;
- the chunk planner keeps one chunk's temporaries within the budget for a 32k-token
  prompt (by construction), and the largest allocation the bounded path makes, measured
  with the CPU profiler's memory hooks, stays under the budget.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from appliance.engines.layers import attention_backends
from appliance.engines.layers.attention_backends import (
    bounded_decode, bounded_prefill, chunk_temp_bytes, min_temp_bytes, plan_chunks,
    select_backend,
)
from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.loader import load_model

from helpers import fake_flashinfer
from test_torch_model import (  # noqa: F401 (the llama fixture)
    ATOL, BLOCK, RTOL, Pager, _prompts, llama, ref_last_logits, run_step,
)

torch.set_num_threads(1)


def with_backend(path, backend: str, monkeypatch):
    model = load_model(path)
    if backend == "flashinfer":
        module = fake_flashinfer.module()
        monkeypatch.setitem(sys.modules, "flashinfer", module)
        model.set_attention("flashinfer", flashinfer_module=module)
    elif backend == "bounded-tight":
        # Room for 3 rows of one head over 16 keys: every dimension is chunked.
        model.set_attention("bounded", chunk_temp_bytes(3, 1, 16, model.shape.head_dim, 4))
    else:
        model.set_attention(backend)
    return model


BACKENDS = ["bounded", "bounded-tight", "flashinfer"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_mixed_length_decode(llama, backend, monkeypatch):
    path, ref = llama
    model = with_backend(path, backend, monkeypatch)
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=3)
    seqs = _prompts([5, 17, 33], seed=7)
    tables: list[list[int]] = [[], [], []]
    logits = run_step(model, kv, pager, tables, [0, 0, 0], seqs, is_prefill=True)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, s), rtol=RTOL, atol=ATOL)
    for _ in range(3):
        nxt = logits.argmax(-1).tolist()
        cached = [len(s) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        logits = run_step(model, kv, pager, tables, cached, [[t] for t in nxt], is_prefill=False)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], ref_last_logits(ref, s), rtol=RTOL, atol=ATOL)
    if backend == "flashinfer":       # a pure decode batch went through the decode wrapper
        kinds = [name for name, _ in fake_flashinfer.calls]
        assert "decode.run" in kinds and "prefill.run" in kinds


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_step_and_prefix_hit(llama, backend, monkeypatch):
    """A chunk continuing over its earlier chunk (a prefix in the pool), a fresh prompt
    and two decoding sequences in one step; then a one-token prefill over a long cached
    prefix (the causal offset at its extreme)."""
    path, ref = llama
    model = with_backend(path, backend, monkeypatch)
    kv = allocate_kv_pool(model.shape, num_blocks=40, block_size=BLOCK)
    pager = Pager(40, seed=5)
    a, b, c, d = _prompts([7, 21, 60, 12], seed=9)
    tables: list[list[int]] = [[], [], [], []]
    logits = run_step(model, kv, pager, tables[:3], [0, 0, 0], [a, b, c[:10]], True)
    nxt = logits[:2].argmax(-1).tolist()
    logits = run_step(model, kv, pager, [tables[2], tables[3], tables[0], tables[1]],
                      [10, 0, len(a), len(b)], [c[10:45], d, [nxt[0]], [nxt[1]]], False,
                      num_prefill=2)
    for i, want in enumerate((c[:45], d, a + [nxt[0]], b + [nxt[1]])):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, want), rtol=RTOL, atol=ATOL)
    logits = run_step(model, kv, pager, [tables[2]], [45], [c[45:46]], True)
    torch.testing.assert_close(logits[0], ref_last_logits(ref, c[:46]), rtol=RTOL, atol=ATOL)
    if backend == "flashinfer":
        plans = [kw for name, kw in fake_flashinfer.calls if name == "prefill.plan"]
        assert plans and all(kw["causal"] and kw["pos_encoding_mode"] == "NONE" for kw in plans)


# --------------------------------------------------------------------------- the planner


def test_planner_bounds_a_32k_prompt_by_construction():
    """Llama-3.1-8B's attention shape, bf16, a 32k-token prompt after a 0-token prefix:
    the unchunked math kernel's fp32 scores alone would be 128 GiB; each chunk here is
    within the budget, and the chunks cover every row and head."""
    H, KVH, hd, elem, n = 32, 8, 128, 2, 32768
    budget = 256 << 20
    assert H * n * n * 4 == 128 << 30
    plan = plan_chunks(n, n, H // KVH, hd, elem, budget)
    assert plan.peak_bytes <= budget
    assert plan.peak_bytes == chunk_temp_bytes(plan.q_chunk, plan.head_chunk, plan.k_chunk,
                                               hd, elem)
    assert plan.head_chunk == H // KVH and plan.q_chunk >= 64     # not degenerate
    assert plan.k_chunk == attention_backends.MAX_K_CHUNK
    # Maximal: one more row would not fit.
    assert chunk_temp_bytes(plan.q_chunk + 1, plan.head_chunk, plan.k_chunk, hd, elem) > budget
    # A smaller budget gives smaller chunks, never a bigger peak.
    small = plan_chunks(n, n, H // KVH, hd, elem, 1 << 20)
    assert small.peak_bytes <= 1 << 20 and small.q_chunk * small.head_chunk < \
        plan.q_chunk * plan.head_chunk
    # Below one row over one key: refused with the number, not a silent overrun.
    with pytest.raises(ValueError, match="below the .* bytes the bounded attention needs"):
        plan_chunks(n, n, 4, hd, elem, min_temp_bytes(hd, elem) - 1)


@pytest.mark.parametrize("n,ctx,group,budget", [(1, 5, 1, 10_000), (300, 300, 4, 200_000),
                                                (17, 4000, 8, 300_000), (4000, 4000, 2, 10**7)])
def test_planner_peak_within_budget(n, ctx, group, budget):
    plan = plan_chunks(n, ctx, group, 64, 4, budget)
    assert plan.peak_bytes <= budget and 1 <= plan.q_chunk <= n and 1 <= plan.head_chunk <= group
    assert 1 <= plan.k_chunk <= ctx


def _largest_allocation(fn) -> int:
    """The largest single allocation made while fn runs (CPU profiler memory hooks)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0),
               default=0)


def test_bounded_prefill_measured_under_budget_and_equal_to_sdpa():
    """A 1,536-token prompt after a 512-token prefix (a masked SDPA case), 8 query heads
    over 2 KV heads: the bounded path's largest allocation stays under a 1 MiB budget
    (the scores alone would be 8 x 1536 x 2048 x 4 B = 96 MiB unchunked) and its output
    equals SDPA's. (The profiler reports each op's allocations; the sum of what one
    chunk holds at once is bounded by construction, test_planner_*.)"""
    g = torch.Generator().manual_seed(0)
    H, KVH, hd, ctx, n = 8, 2, 32, 2048, 1536
    slots_total = ctx + 64
    k_cache = torch.randn(slots_total, KVH, hd, generator=g)
    v_cache = torch.randn(slots_total, KVH, hd, generator=g)
    slots = torch.randperm(slots_total, generator=g)[:ctx]
    q = torch.randn(n, H, hd, generator=g)
    budget = 1 << 20
    assert H * n * ctx * 4 > 90 * budget
    plan = plan_chunks(n, ctx, H // KVH, hd, 4, budget)
    assert plan.q_chunk < n             # it really is chunked
    out = [torch.empty_like(q)]         # the result is not a temporary: made outside
    largest = _largest_allocation(lambda: bounded_prefill(q, k_cache, v_cache, slots, budget,
                                                          out[0]))
    assert 0 < largest <= budget, largest
    k = k_cache[slots].transpose(0, 1)[None]
    v = v_cache[slots].transpose(0, 1)[None]
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-5)


def test_bounded_decode_groups_within_budget_and_equal_to_sdpa():
    g = torch.Generator().manual_seed(1)
    H, KVH, hd, bs = 4, 2, 16, 16
    lens = [3, 200, 47, 900, 16]
    blocks = 200
    k_cache = torch.randn(blocks * bs, KVH, hd, generator=g)
    v_cache = torch.randn(blocks * bs, KVH, hd, generator=g)
    order = torch.randperm(blocks, generator=g).tolist()
    tables, k0 = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(order[k0:k0 + need])
        k0 += need
    q = torch.randn(len(lens), H, hd, generator=g)
    budget = attention_backends.decode_seq_bytes(250, H, KVH, hd, 4) * 2   # groups of 1-2
    out: list[torch.Tensor] = []
    largest = _largest_allocation(lambda: out.append(
        bounded_decode(q, k_cache, v_cache, tables, lens, bs, budget)))
    assert largest <= budget
    for i, n in enumerate(lens):
        slots = attention_backends._slots(tables[i], n, bs, q.device)
        want = F.scaled_dot_product_attention(
            q[i][None, :, None], k_cache[slots].transpose(0, 1)[None],
            v_cache[slots].transpose(0, 1)[None], enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[0][i], want, rtol=1e-4, atol=1e-5)


def test_backend_selection(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert select_backend(cpu) == "sdpa"
    monkeypatch.setitem(sys.modules, "flashinfer", None)          # not installed
    assert select_backend(cuda) == "bounded"
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    assert select_backend(cuda) == "flashinfer"
    assert select_backend(cuda, "bounded") == "bounded"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(cuda, "triton")
