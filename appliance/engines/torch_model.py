"""Llama-family forward pass over a paged KV pool (the execution half of the torch engine).

This module only *runs* a batch. Which sequences run, and which KV blocks they own, is
decided elsewhere (scheduler / block manager); they arrive here as an `AttnBatch`.

KV pool layout (shared with the KV handoff, see `copy_blocks` and `layout_tag`):

    kv[2, layers, num_blocks, block_size, kv_heads, head_dim]     index 0 = K, 1 = V

Token slot ``s = block_id * block_size + offset``; K is stored *after* RoPE, so a cached
block is position-encoded once and reused as is (prefix caching, handoff between workers).

Supported checkpoints: HF ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
in safetensors (single file or sharded index). Sliding-window attention (Mistral v0.1,
Qwen2 ``use_sliding_window``) is not implemented; instead the served context is capped at
the window (`LlamaShape.max_context`), inside which full attention is the same thing. A
longer request is refused rather than answered by a different model.

Weights are held in per-layer records (`Linear`, packed for the CPU; not registered
parameters): to move a model to another device or dtype, load it again with those
arguments.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from appliance.engines import torch_attention
from appliance.kv.blocks import _copy_stretches, _stretches, copy_blocks  # noqa: F401 (re-exported)

__all__ = [
    "AttnBatch",
    "Linear",
    "LlamaModel",
    "LlamaShape",
    "ModelLoadError",
    "RopeScaling",
    "allocate_kv_pool",
    "copy_blocks",
    "kv_pool_bytes_per_block",
    "layout_tag",
    "load_model",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class ModelLoadError(ValueError):
    """A checkpoint cannot be served: unsupported config, missing/corrupt file or tensor."""


# --------------------------------------------------------------------------- shape


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1 ("llama3") frequency scaling of RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LlamaShape:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    o_bias: bool  # bias on the output projection (Llama attention_bias only)
    sliding_window: int | None = None  # tokens a query sees (itself included), if limited

    @property
    def max_context(self) -> int:
        """The longest context this engine computes exactly as `transformers` does."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaShape:
        """Parse an HF ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r} for {arch}; only 'silu'")
        if cfg.get("mlp_bias", False):
            raise ModelLoadError(f"unsupported mlp_bias=true for {arch}")

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelLoadError(f"config.json for {arch} lacks {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if head_dim % 2:
            raise ModelLoadError(f"head_dim {head_dim} must be even for RoPE")
        rope_theta, rope_scaling = _parse_rope(cfg)

        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "LlamaForCausalLM":
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        else:
            qkv_bias = o_bias = False
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=_sliding_window(arch, cfg),
        )


def _sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    """The attention window, as `transformers` applies it: a token sees itself and the
    W-1 before it. Mistral slides on every layer (MistralConfig defaults the window to
    4,096 when config.json has no key; v0.2 and later write null). Qwen2 slides only with
    ``use_sliding_window``, on the layers from ``max_window_layers`` on, or as
    ``layer_types`` says. Llama never slides."""
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window", 4096)
        return int(window) if window else None
    if arch != "Qwen2ForCausalLM":
        return None
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return None
    types = cfg.get("layer_types")
    if types is not None:
        slides = "sliding_attention" in types
    else:
        slides = int(cfg.get("max_window_layers", 28)) < int(cfg["num_hidden_layers"])
    return int(cfg["sliding_window"]) if slides else None


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes "rope_parameters" (with rope_theta inside); 4.x writes
    # "rope_theta" + "rope_scaling" (with "type" or "rope_type").
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"rope parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError("unsupported partial_rotary_factor != 1.0")
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: default, llama3")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"llama3 rope scaling lacks {e.args[0]!r}") from None
    return theta, scaling


def _rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    dim = shape.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (shape.rope_theta**exponents)
    rs = shape.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between.
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


# --------------------------------------------------------------------------- KV pool


def allocate_kv_pool(
    shape: LlamaShape,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Zeroed pool ``[2, layers, num_blocks, block_size, kv_heads, head_dim]``."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
    return torch.zeros(
        (2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
        device=device,
        dtype=dtype,
    )


def kv_pool_bytes_per_block(shape: LlamaShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * elem


def layout_tag(shape: LlamaShape, block_size: int, dtype: torch.dtype) -> str:
    """Identity of a pool's block layout; KV may only move between equal tags."""
    dname = str(dtype).removeprefix("torch.")
    return f"L{shape.num_layers}-kvh{shape.num_kv_heads}-hd{shape.head_dim}-bs{block_size}-{dname}"


# --------------------------------------------------------------------------- batch


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


@dataclass(slots=True)
class _DecodeGroup:
    """Sequences ``first..end-1`` of a decode batch, attended together."""

    first: int
    end: int
    block_ids: torch.Tensor  # [(end-first) * blocks], each sequence's first `blocks` blocks
    blocks: int
    context: int  # longest context in the group; shorter ones are masked
    mask: torch.Tensor | None  # [n, 1, 1, context] (True = attend), None if all equal


@dataclass(slots=True)
class _Plan:
    """Per-forward index tensors shared by all layers (computed once per step)."""

    last_token_idx: torch.Tensor  # [B] rows of the last new token of each sequence
    # prefill: per sequence (q_start, q_end, ctx_slots | None, mask | None)
    prefill: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]
    decode: list[_DecodeGroup]    # over the decoding sequences only (first = 0)
    prefill_tokens: int = 0       # rows [0, prefill_tokens) belong to prompts


def _context_slots(
    table: Sequence[int], n: int, block_size: int, device: torch.device
) -> torch.Tensor:
    blocks = torch.tensor(table[: (n + block_size - 1) // block_size], dtype=torch.long)
    pos = torch.arange(n)
    return (blocks[pos // block_size] * block_size + pos % block_size).to(device)


def _decode_groups(ctx_lens: list[int], tables: list[list[int]], block_size: int,
                   block_bytes: int, device: torch.device) -> list[_DecodeGroup]:
    """Consecutive sequences grouped so each group's gathered K and V of one layer
    (sequences x its longest block count x `block_bytes`) stay within DECODE_GROUP_BYTES;
    a sequence longer than that is a group of its own. On a GPU the whole batch is one
    group: there one big kernel beats many small ones (NOT RUN ON HARDWARE)."""
    bound = DECODE_GROUP_BYTES if device.type == "cpu" else float("inf")
    groups: list[_DecodeGroup] = []
    first = 0
    while first < len(ctx_lens):
        end, blocks = first, 0
        while end < len(ctx_lens):
            need = max(blocks, -(-ctx_lens[end] // block_size))
            if end > first and (end + 1 - first) * need * block_bytes > bound:
                break
            blocks, end = need, end + 1
        lens = ctx_lens[first:end]
        # Padding repeats the sequence's own first block: finite data, masked out.
        ids = [b for t in tables[first:end] for b in t[:blocks] + [t[0]] * (blocks - len(t))]
        context, mask = max(lens), None
        if min(lens) != context:
            pos = torch.arange(context)
            mask = (pos[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].to(device)
        groups.append(_DecodeGroup(first, end, torch.tensor(ids, device=device), blocks,
                                   context, mask))
        first = end
    return groups


def _plan(batch: AttnBatch, num_tokens: int, block_size: int, block_bytes: int,
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
        return _Plan(last, steps, [], start)
    if any(q != 1 for q in q_lens[P:]):
        raise ValueError(f"decode batch must have one new token per sequence, got {q_lens[P:]}")
    groups = _decode_groups(ctx_lens[P:], tables[P:], block_size, block_bytes, device)
    return _Plan(last, steps, groups, start)


# --------------------------------------------------------------------------- model


class Linear:
    """``x @ weight.T + bias`` with the weight stored the way the CPU multiplies fastest.

    On the CPU in fp32 the weight is re-laid out once into oneDNN's blocked format
    (``mkldnn._reorder_linear_weight``, what inductor's freezing pass does): a plain
    ``F.linear`` re-packs the weight inside MKL on every call, which at decode batch sizes
    costs as much as the multiply itself (packing made the 20m model's matmuls 1.3-1.9x
    faster at batch 1-32). Only the packed copy is kept. Elsewhere
    (CUDA, bf16, a torch build without oneDNN) the weight stays as is and ``F.linear`` runs.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_ok():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary [out, in] layout (a copy when packed)."""
        if self.packed is not None:
            return self.packed.to_dense()
        assert self.weight is not None
        return self.weight


_ONEDNN_OK: bool | None = None


def _onednn_ok() -> bool:
    """Whether this torch build packs and multiplies oneDNN linear weights correctly
    (checked once against F.linear, so a build without the ops just runs unpacked)."""
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        try:
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _ONEDNN_OK = bool(torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN_OK = False
    return _ONEDNN_OK


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear  # [q + 2*kv, hidden] (q, k, v projections stacked)
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # [2*intermediate, hidden]
    down: Linear


class LlamaModel(torch.nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        embed: torch.Tensor,
        layers: list[_Layer],
        norm: torch.Tensor,
        lm_head: Linear,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        # RoPE tables for every position, [max_pos, head_dim/2], computed in fp32 once.
        pos = torch.arange(shape.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * _rope_inv_freq(shape)[None, :]
        # Full-width tables so RoPE is three ops per layer: with h = (x1, x2),
        # rotate(h) = h * (cos, cos) + (x2, x1) * (-sin, sin)  (HF's rotate-half convention).
        cos, sin = freqs.cos(), freqs.sin()
        self.rope_cos = torch.cat((cos, cos), -1).to(embed.device, embed.dtype)
        self.rope_sin = torch.cat((-sin, sin), -1).to(embed.device, embed.dtype)
        # Decode gathers K and V into this buffer, kept between steps and layers: a fresh
        # multi-MB tensor per layer would be newly mapped memory, page-faulted in each step.
        self._gather = torch.empty(2, 0, device=embed.device, dtype=embed.dtype)
        # Attention backend (torch_attention): SDPA on the CPU; on CUDA FlashInfer's paged
        # kernels or the bounded path, so no masked SDPA falls to the math kernel there.
        self.attention = "sdpa"
        self.attention_budget = torch_attention.DEFAULT_TEMP_BYTES
        self._flashinfer: torch_attention.FlashInferAttention | None = None

    def set_attention(self, backend: str, budget: int = torch_attention.DEFAULT_TEMP_BYTES,
                      flashinfer_module: Any = None) -> None:
        """Choose the attention backend ("sdpa" | "bounded" | "flashinfer"); `budget`:
        bytes the bounded path's temporaries may take at once."""
        if backend not in torch_attention.BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}")
        self.attention = backend
        self.attention_budget = int(budget)
        self._flashinfer = (torch_attention.FlashInferAttention(self.device, flashinfer_module)
                            if backend == "flashinfer" else None)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttnBatch,
        kv: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[B, vocab]`` of each sequence's last new token.

        ``positions`` must be below ``shape.max_position_embeddings`` (the RoPE table size).
        """
        s = self.shape
        H, KVH, hd = s.num_heads, s.num_kv_heads, s.head_dim
        T = input_ids.numel()
        expected = (2, s.num_layers, kv.shape[2] if kv.dim() == 6 else -1)
        if kv.dim() != 6 or kv.shape[:3] != expected or kv.shape[4:] != (KVH, hd):
            raise ValueError(
                f"KV pool shape {tuple(kv.shape)} does not fit {layout_tag(s, 0, kv.dtype)}"
            )
        if kv.dtype != self.dtype or not kv.is_contiguous():
            raise ValueError(f"KV pool must be a contiguous {self.dtype} tensor, got {kv.dtype}")
        input_ids = input_ids.to(self.device)
        positions = positions.to(self.device)
        block_size = kv.shape[3]
        block_bytes = 2 * kv[0, 0, 0].numel() * kv.element_size()  # K and V, one layer
        plan = _plan(batch, T, block_size, block_bytes, kv.device)
        kv_flat = kv.view(2, s.num_layers, kv.shape[2] * block_size, s.num_kv_heads, s.head_dim)
        slot_mapping = batch.slot_mapping.to(kv.device, torch.long)

        fi = self._flashinfer
        if fi is not None:
            fi.plan(batch.seq_lens_q, batch.context_lens, batch.block_tables, block_size,
                    H, KVH, hd, self.dtype)
        bounded = self.attention == "bounded"

        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, hd]
        sin = self.rope_sin[positions].unsqueeze(1)
        eps = s.rms_norm_eps

        h = self.embed[input_ids]  # [T, D]
        for li, layer in enumerate(self.layers):
            x = F.rms_norm(h, (s.hidden_size,), layer.attn_norm, eps)
            qkv = layer.qkv(x).view(T, H + 2 * KVH, hd)
            # RoPE on the q and k heads together, in place (see rope_cos / rope_sin).
            qk = qkv[:, : H + KVH]
            swapped = qk.view(T, H + KVH, 2, hd // 2).flip(2).view(T, H + KVH, hd)
            qk.mul_(cos).addcmul_(swapped, sin)
            q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
            # K and V of this layer side by side: [2, T, KVH, hd] -> [2, slots, KVH, hd].
            kv_layer = kv_flat[:, li]
            kv_layer.index_copy_(1, slot_mapping, qkv[:, H:].view(T, 2, KVH, hd).transpose(0, 1))
            k_cache, v_cache = kv_layer[0], kv_layer[1]

            Tp = plan.prefill_tokens
            if fi is not None:
                o = fi.run(q, kv[0, li], kv[1, li]).reshape(T, s.q_size)
            elif bounded:
                o = self._bounded_attention(q, k, v, k_cache, v_cache, batch, plan, block_size)
            elif not plan.decode:
                o = self._prefill_attention(q, k, v, k_cache, v_cache, plan)
            elif not plan.prefill:
                o = self._decode_attention(q, kv[:, li], plan)
            else:   # mixed: prompt rows first, then one row per decoding sequence
                o = torch.cat((
                    self._prefill_attention(q[:Tp], k[:Tp], v[:Tp], k_cache, v_cache, plan),
                    self._decode_attention(q[Tp:], kv[:, li], plan)))
            h = h + layer.o(o)

            x = F.rms_norm(h, (s.hidden_size,), layer.mlp_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)

        if batch.hidden_rows is not None:
            rows = batch.hidden_rows.to(h.device)
            batch.hidden = F.rms_norm(h.index_select(0, rows), (s.hidden_size,), self.norm, eps)
        last = F.rms_norm(h.index_select(0, plan.last_token_idx), (s.hidden_size,), self.norm, eps)
        return self.lm_head(last).float()

    def _prefill_attention(
        self,
        q: torch.Tensor,  # [T, H, hd]
        k: torch.Tensor,  # [T, KVH, hd]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [slots, KVH, hd]
        v_cache: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        s = self.shape
        out = torch.empty(q.shape[0], s.q_size, device=q.device, dtype=q.dtype)
        # 4-d inputs: with 3-d ones torch 2.13's CPU SDPA falls back to the math kernel
        # (materialized scores), 3-5x slower on long prompts than the fused kernel.
        for start, end, ctx_slots, mask in plan.prefill:
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if ctx_slots is None:
                ki = k[start:end].transpose(0, 1).unsqueeze(0)
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
                ki = k_cache.index_select(0, ctx_slots).transpose(0, 1).unsqueeze(0)
                vi = v_cache.index_select(0, ctx_slots).transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            out[start:end] = oi[0].transpose(0, 1).reshape(end - start, s.q_size)
        return out

    def _bounded_attention(self, q, k, v, k_cache, v_cache, batch: AttnBatch, plan: _Plan,
                           block_size: int) -> torch.Tensor:
        """The bounded-memory path (torch_attention): prompts one by one in chunks, decode
        rows in groups, every temporary within `attention_budget`. A prompt without a
        cached prefix goes to SDPA (causal, no mask) when even the math kernel's worst
        case for it fits the budget, which keeps short prompts on the fused kernels."""
        s = self.shape
        budget = self.attention_budget
        out = q.new_empty(q.shape[0], s.num_heads, s.head_dim)
        for i, (start, end, ctx_slots, _mask) in enumerate(plan.prefill):
            n = end - start
            if ctx_slots is None and (s.num_heads * n * n * 4
                                      + 2 * s.num_heads * n * s.head_dim * q.element_size()
                                      <= budget):
                qi = q[start:end].transpose(0, 1).unsqueeze(0)
                ki = k[start:end].transpose(0, 1).unsqueeze(0)
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
                out[start:end] = oi[0].transpose(0, 1)
                continue
            if ctx_slots is None:
                ctx_slots = _context_slots(batch.block_tables[i], batch.context_lens[i],
                                           block_size, q.device)
            torch_attention.bounded_prefill(q[start:end], k_cache, v_cache, ctx_slots, budget,
                                            out[start:end])
        Tp = plan.prefill_tokens
        if plan.decode:
            P = len(plan.prefill)
            out[Tp:] = torch_attention.bounded_decode(
                q[Tp:], k_cache, v_cache, batch.block_tables[P:], batch.context_lens[P:],
                block_size, budget)
        return out.reshape(q.shape[0], s.q_size)

    def _decode_attention(
        self,
        q: torch.Tensor,  # [B, H, hd]
        kv_layer: torch.Tensor,  # [2, blocks, block_size, KVH, hd]
        plan: _Plan,
    ) -> torch.Tensor:
        s = self.shape
        B, block_size = q.shape[0], kv_layer.shape[2]
        blocks = kv_layer.view(2, kv_layer.shape[1], -1)  # whole blocks: one memcpy each
        q = q.unsqueeze(2)  # [B, H, 1, hd]
        out = None if len(plan.decode) == 1 else q.new_empty(B, s.num_heads, 1, s.head_dim)
        row = blocks.shape[2]
        buf = self._gather_buffer(max(g.block_ids.numel() for g in plan.decode) * row)
        for g in plan.decode:
            n, used = g.end - g.first, g.block_ids.numel() * row
            kb = torch.index_select(blocks[0], 0, g.block_ids, out=buf[0, :used].view(-1, row))
            vb = torch.index_select(blocks[1], 0, g.block_ids, out=buf[1, :used].view(-1, row))
            per_seq = (n, g.blocks * block_size, s.num_kv_heads, s.head_dim)
            o = F.scaled_dot_product_attention(
                q[g.first:g.end],
                kb.view(per_seq)[:, : g.context].transpose(1, 2),  # [n, KVH, ctx, hd]
                vb.view(per_seq)[:, : g.context].transpose(1, 2),
                attn_mask=g.mask,
                enable_gqa=True,
            )
            if out is None:
                return o.reshape(B, s.q_size)
            out[g.first:g.end] = o
        assert out is not None
        return out.reshape(B, s.q_size)

    def _gather_buffer(self, elems: int) -> torch.Tensor:
        """``[2, elems]`` of the kept gather buffer, for a step's largest group (see
        DECODE_GROUP_BYTES). It grows by half again when too small, and is given back when
        a step needs under a quarter of it (after a sequence longer than a group's bound)."""
        cap = self._gather.shape[1]
        if elems > cap or elems * 4 < cap:
            cap = elems if elems * 4 < cap else max(elems, cap + cap // 2)
            self._gather = self._gather.new_empty(2, cap)
        return self._gather[:, :elems]


# --------------------------------------------------------------------------- loading


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"missing {path}") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"unreadable {path}: {e}") from None


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file (sharded index or a single model.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"unreadable {index}: {e!r}") from None
        return {name: model_dir / fname for name, fname in weight_map.items()}
    if single.exists():
        return {}  # resolved lazily from the file's own header
    raise ModelLoadError(f"no weights in {model_dir}: neither model.safetensors nor {index.name}")


def _load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    mapping = _tensor_files(model_dir)
    files = sorted(set(mapping.values())) if mapping else [model_dir / "model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if not path.exists():
            raise ModelLoadError(f"missing weight shard {path}")
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from None
    return tensors


def load_model(
    model_dir: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaModel:
    """Load an HF Llama/Mistral/Qwen2 safetensors checkpoint; raises ModelLoadError."""
    model_dir = Path(model_dir)
    shape = LlamaShape.from_hf_config(_read_config(model_dir))
    raw = _load_tensors(model_dir)
    D, I = shape.hidden_size, shape.intermediate_size

    def get(name: str, expected: tuple[int, ...]) -> torch.Tensor:
        t = raw.pop(name, None)  # consumed once: freed as soon as it is packed or fused
        if t is None:
            raise ModelLoadError(f"checkpoint {model_dir} lacks tensor {name!r}")
        if tuple(t.shape) != expected:
            raise ModelLoadError(
                f"tensor {name!r} in {model_dir} has shape {tuple(t.shape)}, expected {expected}"
            )
        return t.to(device=device, dtype=dtype)

    embed = get("model.embed_tokens.weight", (shape.vocab_size, D))
    if shape.tie_word_embeddings:
        lm_head = Linear(embed)
    else:
        lm_head = Linear(get("lm_head.weight", (shape.vocab_size, D)))
    layers: list[_Layer] = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        w_qkv = torch.cat([get(attn + "q_proj.weight", (shape.q_size, D)),
                           get(attn + "k_proj.weight", (shape.kv_size, D)),
                           get(attn + "v_proj.weight", (shape.kv_size, D))])
        b_qkv = None
        if shape.qkv_bias:
            b_qkv = torch.cat([get(attn + "q_proj.bias", (shape.q_size,)),
                               get(attn + "k_proj.bias", (shape.kv_size,)),
                               get(attn + "v_proj.bias", (shape.kv_size,))])
        w_gate_up = torch.cat([get(p + "mlp.gate_proj.weight", (I, D)),
                               get(p + "mlp.up_proj.weight", (I, D))])
        layers.append(
            _Layer(
                attn_norm=get(p + "input_layernorm.weight", (D,)),
                qkv=Linear(w_qkv, b_qkv),
                o=Linear(get(attn + "o_proj.weight", (D, shape.q_size)),
                         get(attn + "o_proj.bias", (D,)) if shape.o_bias else None),
                mlp_norm=get(p + "post_attention_layernorm.weight", (D,)),
                gate_up=Linear(w_gate_up),
                down=Linear(get(p + "mlp.down_proj.weight", (D, I))),
            )
        )
    norm = get("model.norm.weight", (D,))
    raw.clear()  # tensors the model does not use (e.g. rotary caches in old checkpoints)
    return LlamaModel(shape, embed, layers, norm, lm_head)
