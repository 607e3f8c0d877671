"""Attention over the paged KV pool where SDPA would materialize too much (the GPU paths).

Why: a masked `scaled_dot_product_attention` (a prefill chunk after a prefix hit, a decode
batch of mixed lengths) cannot use CUDA's flash kernel and falls to the math kernel, which
expands K/V to every query head and builds fp32 ``[heads, q, ctx]`` scores: a 32k-token
prompt after a prefix hit is 32 x 32k x 32k x 4 B = 128 GiB. Two ways out, chosen once
per worker (`select_backend`):

- ``flashinfer``: FlashInfer's paged kernels (`BatchPrefillWithPagedKVCacheWrapper`,
  `BatchDecodeWithPagedKVCacheWrapper`) read K/V straight from the pool through the block
  tables, GQA and the causal mask inside the kernel, nothing materialized. An optional
  extra (``pip install applianced[flashinfer]``), imported lazily, only on CUDA.
- ``bounded``: plain torch ops in chunks of query rows and query heads, one KV head at a
  time (GQA by grouping that head's queries, never expanding K/V), sized by
  `plan_chunks` so that everything one chunk holds at once stays within a byte budget.
  Slower than a fused kernel, never out of memory.

On the CPU the engine keeps SDPA (its fused CPU kernel takes masks and GQA without
materializing scores); the bounded path runs there in tests, to check it against SDPA.

NOT RUN ON HARDWARE: the FlashInfer calls are written against its Python API
(flashinfer/prefill.py and decode.py @ fb28d724, docs.flashinfer.ai) and tested on the
CPU against tests/helpers/fake_flashinfer.py, which follows those signatures and semantics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = [
    "BACKENDS", "ChunkPlan", "DEFAULT_TEMP_BYTES", "FlashInferAttention", "bounded_decode",
    "bounded_prefill", "chunk_temp_bytes", "min_temp_bytes", "plan_chunks", "select_backend",
]

BACKENDS = ("sdpa", "bounded", "flashinfer")
DEFAULT_TEMP_BYTES = 256 << 20          # the bounded path's budget per attention call
FLASHINFER_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


# --------------------------------------------------------------------------- the planner


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How the bounded path cuts one sequence's attention: `q_chunk` query rows and
    `head_chunk` query heads (of one KV head's group) at a time, over `k_chunk` keys at a
    time (an online softmax carries the running maximum and sum from one key chunk to the
    next, as flash attention does)."""

    q_chunk: int
    head_chunk: int
    k_chunk: int
    peak_bytes: int         # what one chunk holds at once (chunk_temp_bytes), <= the budget


MAX_K_CHUNK = 4096          # keys per step: long enough to keep the matmuls efficient


def chunk_temp_bytes(q_chunk: int, head_chunk: int, k_chunk: int, head_dim: int,
                     elem: int) -> int:
    """Bytes alive at once while `bounded_prefill` computes one chunk, by construction of
    that function (every tensor it makes is counted; an upper bound):

    - the key chunk's K and V of this KV head, gathered from the pool (pool dtype) and
      their fp32 copies;
    - the fp32 scores ``[head_chunk, q_chunk, k_chunk]`` (exp runs in place on them) and
      the causal mask of the chunk, ``[q_chunk, k_chunk]`` bools;
    - the queries in fp32 (and a contiguous copy matmul may make), the fp32 accumulator
      and the product added to it, the output cast back to the pool dtype;
    - per row: running and new maximum, correction, running sum, the chunk's sum and a
      spare (fp32); the row and key positions (int64).
    """
    rows = q_chunk * head_chunk
    return (2 * k_chunk * head_dim * (elem + 4)
            + rows * k_chunk * 4 + q_chunk * k_chunk
            + rows * head_dim * (4 * 4 + elem)
            + rows * 4 * 6 + (q_chunk + k_chunk) * 8)


def min_temp_bytes(head_dim: int, elem: int) -> int:
    """The least budget the bounded path can work in (one row, one head, one key)."""
    return chunk_temp_bytes(1, 1, 1, head_dim, elem)


def plan_chunks(q_len: int, ctx: int, group: int, head_dim: int, elem: int,
                budget: int) -> ChunkPlan:
    """The largest chunks within `budget`: key chunks of up to MAX_K_CHUNK keys; all of a
    KV head's query heads together when a row of them fits (they share the K/V just
    gathered), else fewer; then as many query rows as fit. Raises ValueError when not
    even one row of one head over one key fits."""
    if min(q_len, ctx, group, head_dim, elem) < 1:
        raise ValueError(f"no attention to plan: q {q_len}, ctx {ctx}, group {group}, "
                         f"head_dim {head_dim}, elem {elem}")
    need = min_temp_bytes(head_dim, elem)
    if need > budget:
        raise ValueError(f"an attention budget of {budget} bytes is below the {need} bytes "
                         "the bounded attention needs at least; raise attention_temp_bytes")
    kc = min(ctx, MAX_K_CHUNK)
    heads = group
    # Shrink the key chunk, then the heads, until one row fits; then grow the rows.
    while chunk_temp_bytes(1, heads, kc, head_dim, elem) > budget:
        if kc > 64 or heads == 1:
            kc = max(1, kc // 2)
        else:
            heads = max(1, heads // 2)
    lo, hi = 1, q_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_temp_bytes(mid, heads, kc, head_dim, elem) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return ChunkPlan(lo, heads, kc, chunk_temp_bytes(lo, heads, kc, head_dim, elem))


# --------------------------------------------------------------------------- bounded path


def bounded_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx_slots: torch.Tensor, budget: int,
                    out: torch.Tensor | None = None, window: int | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's `q` rows (its last ``len(q)`` positions) over the
    K/V at `ctx_slots` of the flat pool, in chunks that keep within `budget` bytes.

    q: [n, H, hd]; k_cache, v_cache: [slots, KVH, hd]; ctx_slots: [ctx] (ctx >= n);
    returns [n, H, hd] in q's dtype. The causal mask is bottom-right aligned (query row i
    is position ctx - n + i), as a prefill after a prefix hit needs. Keys a chunk of rows
    cannot see (past its last row's position, or with a sliding `window` before its first
    row's window) are never read; a row at position p sees keys p-W+1 .. p. `scale`:
    the scores' factor (None: 1/sqrt(head_dim))."""
    n, H, hd = q.shape
    KVH = k_cache.shape[1]
    ctx = ctx_slots.numel()
    group = H // KVH
    elem = k_cache.element_size()
    plan = plan_chunks(n, ctx, group, hd, elem, budget)
    if out is None:
        out = q.new_empty(n, H, hd)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    first = ctx - n                                  # position of query row 0
    kc = plan.k_chunk
    for g in range(KVH):
        k_head, v_head = k_cache[:, g], v_cache[:, g]               # [slots, hd] views
        for h0 in range(g * group, (g + 1) * group, plan.head_chunk):
            h1 = min(h0 + plan.head_chunk, (g + 1) * group)
            for a in range(0, n, plan.q_chunk):
                b = min(a + plan.q_chunk, n)
                qc = q[a:b, h0:h1].transpose(0, 1).float()          # [h, rows, hd]
                pos = torch.arange(first + a, first + b, device=q.device)[:, None]
                run_max = run_sum = acc = None
                k_from = max(0, first + a - window + 1) if window else 0   # row a's first key
                for k0 in range(k_from, first + b, kc):          # keys the last row sees
                    k1 = min(k0 + kc, first + b)
                    idx = ctx_slots[k0:k1]
                    kb = k_head.index_select(0, idx).float()
                    vb = v_head.index_select(0, idx).float()
                    scores = torch.matmul(qc, kb.T)                 # [h, rows, keys]
                    scores.mul_(scale)
                    keys = None
                    if k1 - 1 > first + a:                          # the diagonal is here
                        keys = torch.arange(k0, k1, device=q.device)[None, :]
                        scores.masked_fill_(keys > pos, float("-inf"))
                    if window and k0 <= first + b - 1 - window:     # and a window's edge
                        keys = torch.arange(k0, k1, device=q.device)[None, :]
                        scores.masked_fill_(keys <= pos - window, float("-inf"))
                    del keys
                    new_max = scores.amax(-1, keepdim=True)
                    if run_max is not None:
                        new_max = torch.maximum(new_max, run_max)
                    # A row that sees no key of this chunk yet (a window) has a maximum of
                    # -inf: subtract 0 there instead, so its exps are 0, not NaN.
                    shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
                    scores.sub_(shift).exp_()
                    part = scores.sum(-1, keepdim=True)
                    if run_max is None:
                        run_sum, acc = part, torch.matmul(scores, vb)
                    else:
                        fix = (run_max - shift).exp_()
                        run_sum = run_sum.mul_(fix).add_(part)
                        acc = acc.mul_(fix).add_(torch.matmul(scores, vb))
                    run_max = new_max
                    del scores, kb, vb
                out[a:b, h0:h1] = acc.div_(run_sum).transpose(0, 1).to(out.dtype)
    return out


def decode_seq_bytes(ctx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     elem: int) -> int:
    """Bytes one sequence adds to a `bounded_decode` group: its K and V gathered
    ([ctx, KVH, hd] each, pool dtype), their fp32 copies and the permuted copies matmul
    may make of those, its scores over all heads (fp32), its padding mask."""
    return (2 * ctx * num_kv_heads * head_dim * (elem + 4 + 4) + num_heads * ctx * 4 + ctx
            + num_heads * head_dim * (4 + 4 + elem) + 2 * num_heads * 4)


def bounded_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], block_size: int,
                   budget: int, window: int | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """One new token per sequence over its paged context, sequences grouped so a group's
    temporaries (`decode_seq_bytes` x sequences, at the group's longest context) stay
    within `budget`; a sequence too long for that alone goes through `bounded_prefill`
    (heads in chunks). q: [B, H, hd]; k_cache, v_cache: [slots, KVH, hd]. With a sliding
    `window` only each sequence's last W positions are read."""
    B, H, hd = q.shape
    KVH = k_cache.shape[1]
    group = H // KVH
    elem = k_cache.element_size()
    out = q.new_empty(B, H, hd)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    starts = [max(0, c - window) if window else 0 for c in ctx_lens]
    full_lens = ctx_lens
    ctx_lens = [c - s0 for c, s0 in zip(full_lens, starts)]   # positions each one reads
    i = 0
    while i < B:
        j, longest = i, 0
        while j < B:
            need = max(longest, ctx_lens[j])
            if (j - i + 1) * decode_seq_bytes(need, H, KVH, hd, elem) > budget:
                break
            longest, j = need, j + 1
        if j == i:          # alone over the budget: heads in chunks
            slots = _slots(tables[i], full_lens[i], block_size, q.device, start=starts[i])
            bounded_prefill(q[i:i + 1], k_cache, v_cache, slots, budget, out[i:i + 1],
                            scale=scale)
            i += 1
            continue
        n = j - i
        slots = torch.stack([_slots(tables[s], full_lens[s], block_size, q.device, longest,
                                    start=starts[s])
                             for s in range(i, j)])                     # [n, longest]
        k = k_cache.index_select(0, slots.flatten()).view(n, longest, KVH, hd).float()
        v = v_cache.index_select(0, slots.flatten()).view(n, longest, KVH, hd).float()
        qg = q[i:j].float().view(n, KVH, group, hd)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1))                # [n, KVH, g, ctx]
        scores.mul_(scale)
        lens = torch.tensor(ctx_lens[i:j], device=q.device)
        pad = torch.arange(longest, device=q.device)[None, :] >= lens[:, None]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        peak = scores.amax(-1, keepdim=True)
        scores.sub_(peak).exp_()
        total = scores.sum(-1, keepdim=True)
        o = torch.matmul(scores, v.permute(0, 2, 1, 3)).div_(total)     # [n, KVH, g, hd]
        out[i:j] = o.view(n, H, hd).to(out.dtype)
        del k, v, scores
        i = j
    return out


def _slots(table: Sequence[int], n: int, block_size: int, device: torch.device,
           width: int | None = None, start: int = 0) -> torch.Tensor:
    """Flat pool slots of a sequence's positions start .. n-1, padded (with its first
    slot, masked out by the caller) to `width`."""
    blocks = torch.tensor(list(table[: -(-n // block_size)]), dtype=torch.long)
    pos = torch.arange(start, n)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    if width is not None and width > n - start:
        slots = torch.cat((slots, slots[:1].expand(width - n + start)))
    return slots.to(device)


# --------------------------------------------------------------------------- FlashInfer


def select_backend(device: torch.device, wanted: str = "auto") -> str:
    """The attention backend of a worker: `wanted` if not "auto"; on CUDA FlashInfer when
    it imports, else the bounded path; on the CPU SDPA."""
    if wanted != "auto":
        if wanted not in BACKENDS:
            raise ValueError(f"unknown attention backend {wanted!r}: expected auto or "
                             f"{', '.join(BACKENDS)}")
        return wanted
    if device.type != "cuda":
        return "sdpa"
    try:
        import flashinfer  # noqa: F401
    except Exception:       # not installed, or built for another CUDA/torch
        return "bounded"
    return "flashinfer"


class FlashInferAttention:
    """One step's FlashInfer plan, shared by every layer (NOT RUN ON HARDWARE).

    The pool's per-layer K and V, ``kv[0, layer]`` and ``kv[1, layer]``, are each
    ``[blocks, block_size, kv_heads, head_dim]``: FlashInfer's NHD paged layout with pages
    = our blocks, passed as a ``(k_cache, v_cache)`` tuple. A batch with any prompt goes
    through the prefill wrapper (decode rows are prompts of one token there: its causal
    mask is aligned bottom-right, ``tril(diagonal=kv_len - qo_len)``, so a chunk after a
    prefix hit sees its prefix); a pure decode batch through the decode wrapper. RoPE is
    applied before the K are stored, so ``pos_encoding_mode="NONE"`` (the default)."""

    def __init__(self, device: torch.device, module: Any | None = None):
        if module is None:
            import flashinfer as module
        self.fi = module
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = module.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode = module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.device = device
        self._wrapper: Any = None

    def plan(self, q_lens: Sequence[int], ctx_lens: Sequence[int],
             tables: Sequence[Sequence[int]], block_size: int, num_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             sm_scale: float | None = None) -> None:
        """The page tables in FlashInfer's CSR form (int32, as its docs require);
        `sm_scale`: the scores' factor (None: FlashInfer's 1/sqrt(head_dim))."""
        pages = [-(-c // block_size) for c in ctx_lens]
        indices = torch.tensor([b for t, p in zip(tables, pages) for b in t[:p]],
                               dtype=torch.int32, device=self.device)
        indptr = torch.tensor([0] + list(_cumsum(pages)), dtype=torch.int32, device=self.device)
        last = torch.tensor([c - (p - 1) * block_size for c, p in zip(ctx_lens, pages)],
                            dtype=torch.int32, device=self.device)
        if all(q == 1 for q in q_lens):
            self.decode.plan(indptr, indices, last, num_heads, num_kv_heads, head_dim,
                             block_size, q_data_type=dtype, kv_data_type=dtype,
                             sm_scale=sm_scale)
            self._wrapper = self.decode
        else:
            qo = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32,
                              device=self.device)
            self.prefill.plan(qo, indptr, indices, last, num_heads, num_kv_heads, head_dim,
                              block_size, causal=True, q_data_type=dtype, kv_data_type=dtype,
                              sm_scale=sm_scale)
            self._wrapper = self.prefill

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd] (this step's rows, sequence by sequence); k_cache, v_cache: one
        layer's ``[blocks, block_size, KVH, hd]``. Returns [T, H, hd]."""
        return self._wrapper.run(q.contiguous(), (k_cache, v_cache))


def _cumsum(values: Sequence[int]):
    total = 0
    for v in values:
        total += v
        yield total
