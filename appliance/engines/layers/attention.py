"""Attention over the paged KV pool: one step's batch metadata, the plan every layer
shares, and the backend that attends.

A step arrives as an `AttnBatch` (which sequences, how many new tokens each, their block
tables); `PagedAttention.begin` turns it once into index tensors (`_Plan`), and each layer
then calls the `PagedAttention` with its q, k, v. The backends:

- ``sdpa`` (the CPU's): prompts one by one through SDPA (causal, or masked over the cached
  prefix), decoding sequences in groups gathered from the pool (`DECODE_GROUP_BYTES`);
- ``bounded`` and ``flashinfer`` (the GPU's): see `attention_backends`.

On the CPU in bf16 a worker may hand its decode rows to a C kernel instead
(`set_decode_kernel`, `engines.cpu_kernels`): it reads K and V in place through the block
tables, with the rounding of `_grouped_decode`, which stays the reference and fallback
(in fp32 on a CPU without AVX-512, another kernel with SDPA's numbers);
and a prompt's plain causal attention (no cached prefix, no window) to another
(`set_prefill_kernel`), rounded as SDPA's flash kernel rounds, which stays the fallback.

Sliding windows: a layer called with ``window=W`` attends as `transformers` does for
Mistral, Qwen2 and Gemma 3 (a query at position p sees keys p-W+1 .. p, itself included).
The blocks wholly before a sequence's window are not read: decode gathers only the blocks
from the one holding position ctx-W on, and a prompt chunk after a cached prefix gathers
only the positions its first row can see. The plan for a window is made once per step
(on the first layer that asks for it) and shared by every layer with that window. The
FlashInfer backend's layers with a window run on the bounded path (NOT RUN ON HARDWARE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from appliance.engines.layers import attention_backends
from appliance.models.shape import LlamaShape

__all__ = ["AttnBatch", "DECODE_GROUP_BYTES", "PagedAttention"]


@dataclass(slots=True)
class AttnBatch:
    """One step's attention metadata, tokens flattened in sequence order.

    ``seq_lens_q[i]`` new tokens of sequence i; ``context_lens[i]`` = cached + new tokens;
    ``block_tables[i]`` covers ``context_lens[i]`` slots; ``slot_mapping[t]`` is where the
    K/V of flat token t is written. A decode batch has exactly one new token per sequence.
    A mixed batch (`num_prefill` set) has prompts (or chunks of them) first, attended one
    by one as in a prefill, then decoding sequences, one token each, attended in groups
    as in a decode: both share the step's matmuls.
    """

    is_prefill: bool
    seq_lens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    num_prefill: int | None = None    # mixed: sequences [0, num_prefill) are prompts
    # Rows whose final (normed) hidden states the caller wants besides the logits (prompt
    # logprobs); forward stores them in `hidden`, [len(hidden_rows), hidden_size].
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # The rows whose logits the step returns, in this order; None: each sequence's last
    # (a decode step carrying prompt rows as rows of their own reads only some).
    logit_rows: torch.Tensor | None = None

    def prompts(self) -> int:
        """How many leading sequences are prompts (the rest decode)."""
        if self.num_prefill is not None:
            return self.num_prefill
        return len(self.seq_lens_q) if self.is_prefill else 0


# A decode step attends over the K/V of its sequences in groups of at most this many bytes
# per layer: gathered block by block into a buffer kept between steps, then read back by
# SDPA while still in cache. Gathering the whole batch first sends it through DRAM twice:
# at 32 sequences of 600 tokens (20m model) one group per batch took 12.6 ms per layer,
# 4 MiB groups 6.0 ms; at batch 1 and short contexts both are one group.
DECODE_GROUP_BYTES = 4 << 20
# ... and a group is padded (to its longest sequence) by at most this share of its own
# blocks, or PAD_MIN_BLOCKS, whichever is more (see `_decode_groups`).
PAD_SHARE = 0.25
PAD_MIN_BLOCKS = 8


@dataclass(slots=True)
class _DecodeGroup:
    """Sequences ``first..end-1`` of a decode batch, attended together (or, where the
    grouping reordered them, the batch rows in `rows`). With a window, each sequence's
    gathered blocks start at the one holding its first visible position (`block_ids`
    lists the blocks from there) and the mask hides what precedes it."""

    first: int
    end: int
    block_ids: torch.Tensor  # [n * blocks], each sequence's first `blocks` blocks
    blocks: int
    context: int  # longest context in the group; shorter ones are masked
    mask: torch.Tensor | None  # [n, 1, 1, context] (True = attend), None if all equal
    rows: torch.Tensor | None = None  # [n] batch rows, when not first..end-1

    @property
    def size(self) -> int:
        return self.end - self.first if self.rows is None else self.rows.numel()


@dataclass(slots=True)
class _Plan:
    """Per-forward index tensors shared by all layers (computed once per step)."""

    last_token_idx: torch.Tensor  # [B] rows of the last new token of each sequence
    # prefill: per sequence (q_start, q_end, ctx_slots | None, mask | None)
    prefill: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]
    decoding: int                 # sequences decoding (after the prompts' rows)
    prefill_tokens: int = 0       # rows [0, prefill_tokens) belong to prompts
    # The same step planned for a sliding window W (see `_window_plan`), made on first use.
    windowed: dict[int, "_Plan"] = field(default_factory=dict)
    block_size: int = 0
    block_bytes: int = 0
    # The decode rows' inputs for a CPU decode kernel (`_kernel_inputs`), made on first use.
    kernel: "_KernelInputs | None" = None
    # torch's decode groups (`decode`), made on first use from `_decode_groups`' arguments:
    # a step whose layers all run the decode kernel never needs them (~0.2 ms a step of
    # Python and small tensors at 4 sequences, measured on the CPU decode worker).
    groups: "list[_DecodeGroup] | None" = None
    group_args: tuple = ()

    @property
    def decode(self) -> list[_DecodeGroup]:
        """The decoding sequences grouped for torch's decode path (first = 0)."""
        if self.groups is None:
            self.groups = _decode_groups(*self.group_args) if self.decoding else []
        return self.groups


@dataclass(slots=True)
class _KernelInputs:
    """A step's decode rows as `cpu_kernels.PagedDecode` takes them (one step, all layers
    with the same window)."""

    tables: torch.Tensor    # [n, width] int64 block ids, padded with 0 past a table's end
    ctx_lens: torch.Tensor  # [n] int32
    starts: torch.Tensor    # [n] int32: first position read (a window's start, else 0)
    longest: int            # the longest span read (ctx - start)


def _kernel_inputs(batch: AttnBatch, first: int, window: int | None) -> _KernelInputs:
    """Sequences ``first..`` of `batch` (its decoding ones) for the decode kernel."""
    ctx = batch.context_lens[first:]
    tables = batch.block_tables[first:]
    width = max(len(t) for t in tables)
    flat = [b for t in tables for b in (*t, *([0] * (width - len(t))))]
    starts = [max(0, c - window) if window else 0 for c in ctx]
    return _KernelInputs(torch.tensor(flat, dtype=torch.long).view(len(ctx), width),
                         torch.tensor(ctx, dtype=torch.int32),
                         torch.tensor(starts, dtype=torch.int32),
                         max(c - s0 for c, s0 in zip(ctx, starts)))


def _context_slots(
    table: Sequence[int], n: int, block_size: int, device: torch.device, start: int = 0
) -> torch.Tensor:
    """Flat pool slots of positions ``start .. n-1`` of a sequence."""
    blocks = torch.tensor(table[: (n + block_size - 1) // block_size], dtype=torch.long)
    pos = torch.arange(start, n)
    return (blocks[pos // block_size] * block_size + pos % block_size).to(device)


def _decode_groups(ctx_lens: list[int], tables: list[list[int]], block_size: int,
                   block_bytes: int, device: torch.device,
                   window: int | None = None) -> list[_DecodeGroup]:
    """The decoding sequences in groups, each padded to its longest member and masked.

    On the CPU the sequences are taken shortest first and a group ends where its gathered
    K and V of one layer (sequences x its longest block count x `block_bytes`) would pass
    DECODE_GROUP_BYTES (a sequence longer than that is a group of its own), or where
    padding would pass PAD_SHARE of its own blocks (and PAD_MIN_BLOCKS): padded to a
    1,200-token neighbour, a 60-token sequence costs what the long one does (measured on
    the CPU: 4 long + 4 short, one group, 8.7 ms a step, as much as 8 long; their own
    blocks, 6.2 ms), and chargeback, fitting a step's cost on its summed contexts, would
    bill the short ones for the long one's length. One group keeps the batch's order. On
    a GPU the whole batch is one group: there one big kernel beats many small ones (NOT
    RUN ON HARDWARE).

    With a `window`, a sequence's blocks before the one holding position ctx-W are left
    out (never gathered) and the positions before ctx-W in that first block are masked."""
    skip = [max(0, c - window) // block_size if window else 0 for c in ctx_lens]
    lows = [max(0, c - window) - k * block_size if window else 0
            for c, k in zip(ctx_lens, skip)]
    ctx_lens = [c - k * block_size for c, k in zip(ctx_lens, skip)]
    tables = [t[k:] for t, k in zip(tables, skip)] if window else tables
    need = [-(-c // block_size) for c in ctx_lens]
    n = len(ctx_lens)
    spans: list[list[int]] = []
    if device.type == "cpu":
        order = sorted(range(n), key=need.__getitem__)
        i = 0
        while i < n:
            j, blocks, own = i, 0, 0
            while j < n:
                b, o, count = max(blocks, need[order[j]]), own + need[order[j]], j + 1 - i
                if j > i and (count * b * block_bytes > DECODE_GROUP_BYTES
                              or count * b - o > max(PAD_MIN_BLOCKS, PAD_SHARE * o)):
                    break
                blocks, own, j = b, o, j + 1
            spans.append(order[i:j])
            i = j
    if len(spans) <= 1:
        spans = [list(range(n))] if n else []
    groups: list[_DecodeGroup] = []
    for idx in spans:
        blocks = max(need[k] for k in idx)
        # Padding repeats the sequence's own first block: finite data, masked out.
        ids = [b for k in idx
               for b in tables[k][:blocks] + [tables[k][0]] * (blocks - len(tables[k]))]
        lens = [ctx_lens[k] for k in idx]
        lo = [lows[k] for k in idx]
        context, mask = max(lens), None
        if min(lens) != context or any(lo):
            pos = torch.arange(context)[None, :]
            mask = (pos < torch.tensor(lens)[:, None]) & (pos >= torch.tensor(lo)[:, None])
            mask = mask[:, None, None, :].to(device)
        contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
        groups.append(_DecodeGroup(
            idx[0], idx[0] + len(idx), torch.tensor(ids, device=device), blocks, context, mask,
            None if contiguous else torch.tensor(idx, device=device)))
    return groups


def _plan(batch: AttnBatch, num_tokens: int, block_size: int, block_bytes: int,
          device: torch.device) -> _Plan:
    plan = _full_plan(batch, num_tokens, block_size, block_bytes, device)
    plan.block_size, plan.block_bytes = block_size, block_bytes
    return plan


def _window_plan(plan: _Plan, batch: AttnBatch, window: int, device: torch.device) -> _Plan:
    """`plan` (the step's full-attention plan) for layers with a sliding `window`: each
    prompt chunk reads the positions from its first row's first visible key on (masked
    so row p sees p-W+1 .. p), decode groups as `_decode_groups` makes them for a window."""
    if window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    found = plan.windowed.get(window)
    if found is not None:
        return found
    steps: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
    bs = plan.block_size
    for (start, end, _slots, _mask), c, t in zip(plan.prefill, batch.context_lens,
                                                  batch.block_tables):
        q = end - start
        lo = max(0, c - q - window + 1)        # the first key row 0 (position c-q) sees
        if c == q and q <= window:             # the window hides nothing: plain causal
            steps.append((start, end, None, None))
            continue
        qpos = torch.arange(c - q, c, device=device)[:, None]
        kpos = torch.arange(lo, c, device=device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        # A fresh prompt attends over this step's own K/V (slots None), from position 0.
        slots = None if c == q else _context_slots(t, c, bs, device, start=lo)
        steps.append((start, end, slots, mask))
    P = len(plan.prefill)
    found = _Plan(plan.last_token_idx, steps, plan.decoding, plan.prefill_tokens,
                  block_size=bs, block_bytes=plan.block_bytes,
                  group_args=(batch.context_lens[P:], batch.block_tables[P:], bs,
                              plan.block_bytes, device, window))
    plan.windowed[window] = found
    return found


def _full_plan(batch: AttnBatch, num_tokens: int, block_size: int, block_bytes: int,
               device: torch.device) -> _Plan:
    q_lens, ctx_lens, tables = batch.seq_lens_q, batch.context_lens, batch.block_tables
    nseq = len(q_lens)
    if nseq == 0 or len(ctx_lens) != nseq or len(tables) != nseq:
        raise ValueError(
            f"AttnBatch lists differ in length: seq_lens_q {nseq}, context_lens "
            f"{len(ctx_lens)}, block_tables {len(tables)}"
        )
    if sum(q_lens) != num_tokens or batch.slot_mapping.numel() != num_tokens:
        raise ValueError(
            f"{num_tokens} input tokens, sum(seq_lens_q) {sum(q_lens)}, "
            f"slot_mapping {batch.slot_mapping.numel()}"
        )
    for i, (q, c, t) in enumerate(zip(q_lens, ctx_lens, tables)):
        if q <= 0 or c < q or len(t) * block_size < c:
            raise ValueError(
                f"sequence {i}: seq_len_q {q}, context_len {c}, {len(t)} blocks of {block_size}"
            )
    ends = torch.tensor(q_lens, dtype=torch.long).cumsum(0)
    last = (ends - 1).to(device)
    P = batch.prompts()
    if not 0 <= P <= nseq:
        raise ValueError(f"num_prefill {P} of {nseq} sequences")
    steps: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
    start = 0
    for q, c, t in zip(q_lens[:P], ctx_lens[:P], tables[:P]):
        if c == q:  # no cached prefix: attend over this step's own K/V, causal
            steps.append((start, start + q, None, None))
        else:
            slots = _context_slots(t, c, block_size, device)
            qpos = torch.arange(c - q, c, device=device)
            mask = torch.arange(c, device=device)[None, :] <= qpos[:, None]
            steps.append((start, start + q, slots, mask))
        start += q
    if P == nseq:
        return _Plan(last, steps, 0, start)
    if any(q != 1 for q in q_lens[P:]):
        raise ValueError(f"decode batch must have one new token per sequence, got {q_lens[P:]}")
    return _Plan(last, steps, nseq - P, start,
                 group_args=(ctx_lens[P:], tables[P:], block_size, block_bytes, device))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
          causal: bool = False, sinks: torch.Tensor | None = None,
          scale: float | None = None) -> torch.Tensor:
    """SDPA (GQA), causal or under a boolean mask (True = attend). With `sinks` (gpt-oss:
    a learned logit per head that each query's softmax also sums over, with no value):
    one more key whose K and V are zero and whose score is the sink, through a float mask,
    so the fused kernel still runs. q ``[B, H, n, hd]``, k and v ``[B, KVH, ctx, hd]``."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True, scale=scale)
    B, H, n, _ = q.shape
    ctx = k.shape[-2]
    if causal:
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
    bias = q.new_zeros(B, H, n, ctx + 1)
    if mask is not None:
        bias[..., :ctx].masked_fill_(~mask, float("-inf"))
    bias[..., ctx] = sinks.to(q.dtype).view(1, H, 1)
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    return F.scaled_dot_product_attention(q, torch.cat((k, zero), -2), torch.cat((v, zero), -2),
                                          attn_mask=bias, enable_gqa=True, scale=scale)


def _grouped_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """One query row per sequence in bf16/fp16 on the CPU, as transformers' eager attention
    computes it (scores and output as matmuls in the low dtype, softmax in fp32), each KV
    head's query heads together. torch 2.13's CPU SDPA in bf16 is 5-10x slower than in
    fp32 for a single query row (measured: 8 sequences x 512 tokens 10.5 ms vs 1.4 ms fp32;
    these matmuls 0.7 ms). q: [n, H, 1, hd]; k, v: [n, KVH, ctx, hd]; mask [n, 1, 1, ctx].

    K and V arrive as per-head views of the gathered blocks ([n, ctx, KVH, hd] underneath).
    They are made contiguous here, row by row: left to `matmul`, K's transposed view is
    copied into [n*KVH, hd, ctx] element by element, a true transpose (measured in CPU
    time, bf16, 12 heads / 4 KV heads of 64, contexts of 300: 0.90 -> 0.50 ms per layer
    at 8 sequences, 4.8 -> 3.1 ms at 32)."""
    n, H, _, hd = q.shape
    KVH = k.shape[1]
    k, v = k.contiguous(), v.contiguous()
    scores = torch.matmul(q.reshape(n, KVH, H // KVH, hd), k.transpose(-1, -2)).float()
    scores.mul_(hd**-0.5 if scale is None else scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, -1).to(q.dtype)
    return torch.matmul(probs, v).reshape(n, H, 1, hd)


class PagedAttention:
    """The attention of every layer of one model, over its paged KV pool. Holds what
    persists between steps: the backend choice and the decode gather buffer."""

    def __init__(self, shape: LlamaShape, device: torch.device, dtype: torch.dtype,
                 scale: float | None = None) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        # Scores are q.k times this (None: 1/sqrt(head_dim); Gemma 3: query_pre_attn_scalar^-0.5).
        self.scale = scale
        # Decode gathers K and V into this buffer, kept between steps and layers: a fresh
        # multi-MB tensor per layer would be newly mapped memory, page-faulted in each step.
        self._gather = torch.empty(2, 0, device=device, dtype=dtype)
        # SDPA on the CPU; on CUDA FlashInfer's paged kernels or the bounded path, so no
        # masked SDPA falls to the math kernel there.
        self.backend = "sdpa"
        self.budget = attention_backends.DEFAULT_TEMP_BYTES
        self._flashinfer: attention_backends.FlashInferAttention | None = None
        # C kernels on the CPU (`set_decode_kernel`, `set_prefill_kernel`): decode rows
        # and prompts with no cached prefix or window (bf16, or fp32 without AVX-512);
        # None: torch's path.
        self.decode_kernel: Any = None
        self.prefill_kernel: Any = None
        self._scratch = torch.empty(0, dtype=torch.float32)

    def set_decode_kernel(self, kernel: Any) -> bool:
        """Use `kernel` (a `cpu_kernels.PagedDecode`, or `PagedDecodeF32` for fp32) for
        decode rows of its dtype on the CPU, or torch's path with None. Returns whether it
        is used: not for shapes it does not support, nor where attention sinks (gpt-oss)
        need torch's path."""
        self.decode_kernel = kernel if self._takes(kernel) else None
        return self.decode_kernel is not None

    def set_prefill_kernel(self, kernel: Any) -> bool:
        """Use `kernel` (a `cpu_kernels.CausalPrefill` in bf16, `CausalPrefillF32` in fp32)
        for a prompt's causal attention over its own K/V on the CPU (no cached prefix, no
        window hiding keys), or SDPA with None. Returns whether it is used (see
        `set_decode_kernel`); a kernel of another dtype is not."""
        ok = self._takes(kernel) and kernel.DTYPE == self.dtype
        self.prefill_kernel = kernel if ok else None
        return self.prefill_kernel is not None

    def _takes(self, kernel: Any) -> bool:
        s = self.shape
        return (kernel is not None and self.device.type == "cpu" and not s.attention_sinks
                and kernel.supports(s.num_heads, s.num_kv_heads, s.head_dim))

    def score_scale(self) -> float:
        """The scores' factor as a number (``self.scale`` None means 1/sqrt(head_dim))."""
        return self.shape.head_dim ** -0.5 if self.scale is None else self.scale

    def set_backend(self, backend: str, budget: int = attention_backends.DEFAULT_TEMP_BYTES,
                    flashinfer_module: Any = None) -> None:
        """Choose the backend ("sdpa" | "bounded" | "flashinfer"); `budget`: bytes the
        bounded path's temporaries may take at once."""
        if backend not in attention_backends.BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}")
        if self.shape.attention_sinks and backend != "sdpa":
            raise ValueError(f"attention sinks (gpt-oss) run on the sdpa backend only, "
                             f"not {backend!r}")
        self.backend = backend
        self.budget = int(budget)
        self._flashinfer = (attention_backends.FlashInferAttention(self.device, flashinfer_module)
                            if backend == "flashinfer" else None)

    def begin(self, batch: AttnBatch, num_tokens: int, kv: torch.Tensor) -> _Plan:
        """Check and plan one step (once, for all layers)."""
        s = self.shape
        block_size = kv.shape[3]
        block_bytes = 2 * kv[0, 0, 0].numel() * kv.element_size()  # K and V, one layer
        plan = _plan(batch, num_tokens, block_size, block_bytes, kv.device)
        if self._flashinfer is not None and not s.all_layers_slide:  # (windows: bounded)
            self._flashinfer.plan(batch.seq_lens_q, batch.context_lens, batch.block_tables,
                                  block_size, s.num_heads, s.num_kv_heads, s.head_dim, kv.dtype,
                                  sm_scale=self.scale)
        return plan

    def __call__(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: AttnBatch, plan: _Plan, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `li`'s attention output ``[T, q_size]``; this step's K/V are already in
        the pool (`k_cache`, `v_cache`: the layer's slots, ``[slots, KVH, hd]``).
        `window`: the layer's sliding window (a query sees itself and the W-1 tokens
        before it), None for full attention. `sinks`: per-head attention-sink logits
        (gpt-oss), sdpa backend only."""
        T, Tp = q.shape[0], plan.prefill_tokens
        if window is not None and window >= max(batch.context_lens):
            window = None                      # every key is inside the window
        if self._flashinfer is not None and window is None:
            return self._flashinfer.run(q, kv[0, li], kv[1, li]).reshape(T, self.shape.q_size)
        if self.backend != "sdpa":             # bounded, or a windowed layer on FlashInfer
            return self._bounded_attention(q, k, v, k_cache, v_cache, batch, plan, kv.shape[3],
                                           window)
        if window is not None:
            plan = _window_plan(plan, batch, window, q.device)
        if not plan.decoding:
            return self._prefill_attention(q, k, v, k_cache, v_cache, plan, sinks)
        kernel = self.decode_kernel
        if kernel is not None and sinks is None and q.dtype == kernel.DTYPE:
            rows = self._kernel_decode(q[Tp:], kv[:, li], plan, batch, window)
        else:
            rows = self._decode_attention(q[Tp:], kv[:, li], plan, sinks)
        if not plan.prefill:
            return rows
        # mixed: prompt rows first, then one row per decoding sequence
        return torch.cat((
            self._prefill_attention(q[:Tp], k[:Tp], v[:Tp], k_cache, v_cache, plan, sinks),
            rows))

    def _prefill_attention(
        self,
        q: torch.Tensor,  # [T, H, hd]
        k: torch.Tensor,  # [T, KVH, hd]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [slots, KVH, hd]
        v_cache: torch.Tensor,
        plan: _Plan,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        s = self.shape
        out = torch.empty(q.shape[0], s.q_size, device=q.device, dtype=q.dtype)
        # 4-d inputs: with 3-d ones torch 2.13's CPU SDPA falls back to the math kernel
        # (materialized scores), 3-5x slower on long prompts than the fused kernel.
        kernel = self.prefill_kernel
        if kernel is not None and (sinks is not None or q.dtype != kernel.DTYPE):
            kernel = None
        for start, end, ctx_slots, mask in plan.prefill:
            if kernel is not None and ctx_slots is None and mask is None:   # plain causal
                o = kernel(q[start:end], k[start:end], v[start:end], self.score_scale())
                out[start:end] = o.view(end - start, s.q_size)
                continue
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if ctx_slots is None:   # this step's own K/V: causal, or a window's mask
                ki = k[start:end].transpose(0, 1).unsqueeze(0)
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
            else:
                ki = k_cache.index_select(0, ctx_slots).transpose(0, 1).unsqueeze(0)
                vi = v_cache.index_select(0, ctx_slots).transpose(0, 1).unsqueeze(0)
            oi = _sdpa(qi, ki, vi, mask=mask, causal=mask is None, sinks=sinks, scale=self.scale)
            out[start:end] = oi[0].transpose(0, 1).reshape(end - start, s.q_size)
        return out

    def _bounded_attention(self, q, k, v, k_cache, v_cache, batch: AttnBatch, plan: _Plan,
                           block_size: int, window: int | None = None) -> torch.Tensor:
        """The bounded-memory path (attention_backends): prompts one by one in chunks, decode
        rows in groups, every temporary within `attention_budget`. A prompt without a
        cached prefix goes to SDPA (causal, no mask) when even the math kernel's worst
        case for it fits the budget, which keeps short prompts on the fused kernels."""
        s = self.shape
        budget = self.budget
        out = q.new_empty(q.shape[0], s.num_heads, s.head_dim)
        for i, (start, end, ctx_slots, _mask) in enumerate(plan.prefill):
            n = end - start
            if ctx_slots is None and window is None and (s.num_heads * n * n * 4
                                      + 2 * s.num_heads * n * s.head_dim * q.element_size()
                                      <= budget):
                qi = q[start:end].transpose(0, 1).unsqueeze(0)
                ki = k[start:end].transpose(0, 1).unsqueeze(0)
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True,
                                                    scale=self.scale)
                out[start:end] = oi[0].transpose(0, 1)
                continue
            if ctx_slots is None:
                ctx_slots = _context_slots(batch.block_tables[i], batch.context_lens[i],
                                           block_size, q.device)
            attention_backends.bounded_prefill(q[start:end], k_cache, v_cache, ctx_slots, budget,
                                               out[start:end], window=window, scale=self.scale)
        Tp = plan.prefill_tokens
        if plan.decoding:
            P = len(plan.prefill)
            out[Tp:] = attention_backends.bounded_decode(
                q[Tp:], k_cache, v_cache, batch.block_tables[P:], batch.context_lens[P:],
                block_size, budget, window=window, scale=self.scale)
        return out.reshape(q.shape[0], s.q_size)

    def _decode_attention(
        self,
        q: torch.Tensor,  # [B, H, hd]
        kv_layer: torch.Tensor,  # [2, blocks, block_size, KVH, hd]
        plan: _Plan,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        s = self.shape
        B, block_size = q.shape[0], kv_layer.shape[2]
        blocks = kv_layer.view(2, kv_layer.shape[1], -1)  # whole blocks: one memcpy each
        q = q.unsqueeze(2)  # [B, H, 1, hd]
        out = None if len(plan.decode) == 1 else q.new_empty(B, s.num_heads, 1, s.head_dim)
        row = blocks.shape[2]
        buf = self._gather_buffer(max(g.block_ids.numel() for g in plan.decode) * row)
        for g in plan.decode:
            n, used = g.size, g.block_ids.numel() * row
            kb = torch.index_select(blocks[0], 0, g.block_ids, out=buf[0, :used].view(-1, row))
            vb = torch.index_select(blocks[1], 0, g.block_ids, out=buf[1, :used].view(-1, row))
            per_seq = (n, g.blocks * block_size, s.num_kv_heads, s.head_dim)
            ki = kb.view(per_seq)[:, : g.context].transpose(1, 2)  # [n, KVH, ctx, hd]
            vi = vb.view(per_seq)[:, : g.context].transpose(1, 2)
            qi = q[g.first:g.end] if g.rows is None else q.index_select(0, g.rows)
            if sinks is None and q.dtype != torch.float32 and q.device.type == "cpu":
                o = _grouped_decode(qi, ki, vi, g.mask, self.scale)
            else:
                o = _sdpa(qi, ki, vi, mask=g.mask, sinks=sinks, scale=self.scale)
            if out is None:
                return o.reshape(B, s.q_size)
            if g.rows is None:
                out[g.first:g.end] = o
            else:
                out.index_copy_(0, g.rows, o)
        assert out is not None
        return out.reshape(B, s.q_size)

    def _kernel_decode(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: _Plan,
                       batch: AttnBatch, window: int | None) -> torch.Tensor:
        """The decode rows through the C kernel, reading K and V where they lie in the pool
        (no gather, no copies); the same numbers as `_grouped_decode` but for summation
        order (paged_decode.c)."""
        s = self.shape
        args = self.kernel_inputs(plan, batch, window)
        q = q.contiguous()
        out = torch.empty_like(q)
        self.decode_kernel(q, kv_layer[0], kv_layer[1], args.tables, args.ctx_lens, args.starts,
                           self.score_scale(), self._scratch, out)
        return out.reshape(q.shape[0], s.q_size)

    def kernel_inputs(self, plan: _Plan, batch: AttnBatch,
                      window: int | None = None) -> _KernelInputs:
        """The step's decode rows as the decode kernel takes them (made once per step),
        and `scratch` grown to what the kernel needs for them."""
        if plan.kernel is None:
            plan.kernel = _kernel_inputs(batch, len(plan.prefill), window)
        # room for two workers: decode_layers.c splits the sequences with the matmul
        # kernel's helper thread, each with half
        need = 2 * self.shape.num_heads * plan.kernel.longest
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need + need // 2, dtype=torch.float32)
        return plan.kernel

    @property
    def scratch(self) -> torch.Tensor:
        """The decode kernel's fp32 scratch (sized by `kernel_inputs`)."""
        return self._scratch

    def _gather_buffer(self, elems: int) -> torch.Tensor:
        """``[2, elems]`` of the kept gather buffer, for a step's largest group (see
        DECODE_GROUP_BYTES). It grows by half again when too small, and is given back when
        a step needs under a quarter of it (after a sequence longer than a group's bound)."""
        cap = self._gather.shape[1]
        if elems > cap or elems * 4 < cap:
            cap = elems if elems * 4 < cap else max(elems, cap + cap // 2)
            self._gather = self._gather.new_empty(2, cap)
        return self._gather[:, :elems]
