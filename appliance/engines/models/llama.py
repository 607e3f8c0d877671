"""The Llama-family model (Llama, Mistral, Qwen2): its weights and its forward pass.

This module only *runs* a batch. Which sequences run, and which KV blocks they own, is
decided elsewhere (scheduler / block manager); they arrive here as an `AttnBatch`, and the
attention over the paged KV pool is `layers.attention.PagedAttention`'s. The pool's layout
is `engines.kv_pool`'s; loading a checkpoint is `engines.loader`'s.

Sliding-window attention (Mistral v0.1, Qwen2 ``use_sliding_window``): each layer passes
its window (`LlamaShape.window`) to the attention, which attends over the last W tokens
as `transformers` does; the context is not capped at the window.

Weights are held in per-layer records (`Linear`, packed for the CPU; not registered
parameters): to move a model to another device or dtype, load it again with those
arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from appliance.engines.kv_pool import layout_tag
from appliance.engines.layers import attention_backends
from appliance.engines.layers.attention import AttnBatch, PagedAttention
from appliance.models.shape import LlamaShape

__all__ = ["Linear", "LlamaModel"]


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


class Linear:
    """``x @ weight.T + bias`` with the weight stored the way the CPU multiplies fastest.

    On the CPU in fp32 the weight is re-laid out once into oneDNN's blocked format
    (``mkldnn._reorder_linear_weight``, what inductor's freezing pass does): a plain
    ``F.linear`` re-packs the weight inside MKL on every call, which at decode batch sizes
    costs as much as the multiply itself (packing made the 20m model's matmuls 1.3-1.9x
    faster at batch 1-32). bf16 weights on the CPU are packed the same way (at batch 8 on an
    AVX512-BF16 core, 0.23 ms packed vs 0.75 ms for F.linear on a 768x2304 weight; the
    results are identical). Only the packed copy is kept. Elsewhere (CUDA, fp16, a torch
    build without oneDNN) the weight stays as is and ``F.linear`` runs.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        if (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and _onednn_ok(weight.dtype)):
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


_ONEDNN_OK: dict[torch.dtype, bool] = {}


def _onednn_ok(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build packs and multiplies oneDNN linear weights of `dtype`
    correctly (checked once per dtype against F.linear, so a build or CPU without the
    ops just runs unpacked)."""
    if dtype not in _ONEDNN_OK:
        try:
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
            w, x = w.to(dtype), x.to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            _ONEDNN_OK[dtype] = bool(torch.allclose(y.float(), F.linear(x, w).float(),
                                                    rtol=tol, atol=tol))
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN_OK[dtype] = False
    return _ONEDNN_OK[dtype]


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
        self.attn = PagedAttention(shape, embed.device, embed.dtype)

    @property
    def attention(self) -> str:
        """The attention backend in use (see `set_attention`)."""
        return self.attn.backend

    def set_attention(self, backend: str, budget: int = attention_backends.DEFAULT_TEMP_BYTES,
                      flashinfer_module: Any = None) -> None:
        """Choose the attention backend ("sdpa" | "bounded" | "flashinfer"); `budget`:
        bytes the bounded path's temporaries may take at once."""
        self.attn.set_backend(backend, budget, flashinfer_module)

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
        plan = self.attn.begin(batch, T, kv)
        kv_flat = kv.view(2, s.num_layers, kv.shape[2] * kv.shape[3], s.num_kv_heads, s.head_dim)
        slot_mapping = batch.slot_mapping.to(kv.device, torch.long)

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

            o = self.attn(li, q, k, v, kv, k_cache, v_cache, batch, plan, s.window(li))
            h = h + layer.o(o)

            x = F.rms_norm(h, (s.hidden_size,), layer.mlp_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)

        if batch.hidden_rows is not None:
            rows = batch.hidden_rows.to(h.device)
            batch.hidden = F.rms_norm(h.index_select(0, rows), (s.hidden_size,), self.norm, eps)
        last = F.rms_norm(h.index_select(0, plan.last_token_idx), (s.hidden_size,), self.norm, eps)
        return self.lm_head(last).float()
