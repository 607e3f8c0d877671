"""The decoder every family runs (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral): its
weights and its forward pass, and how a Llama/Mistral/Qwen2 checkpoint's layers load.

The families differ only in what a layer holds: Qwen3 adds a per-head RMSNorm on q and k
(`DecoderLayer.q_norm`), the MoE families replace the dense MLP by a `layers.moe.SparseMoE`.
Each family's module (`models.qwen3`, `models.qwen3_moe`, `models.mixtral`) builds its
layers from its checkpoint's tensor names with the pieces here; one forward runs them all.

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
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from appliance.engines.kv_pool import layout_tag
from appliance.engines.layers import attention_backends
from appliance.engines.layers.attention import AttnBatch, PagedAttention
from appliance.engines.layers.glue import Glue, eager_glue
from appliance.engines.layers.linear import Linear
from appliance.engines.layers.norm import head_rms_norm_
from appliance.models.shape import LlamaShape

__all__ = ["DecoderLayer", "DenseMLP", "Get", "Linear", "LlamaModel", "load_attention",
           "load_dense_mlp", "load_layer"]


def _rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    dim = shape.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (shape.rope_theta**exponents)
    if shape.yarn is not None:
        return _yarn_inv_freq(shape, inv_freq)[0]
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


def _yarn_inv_freq(shape: LlamaShape, extrapolated: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss): (frequencies, the factor cos and sin are scaled by), as
    `transformers`' ``_compute_yarn_parameters`` computes them."""
    y, dim, base = shape.yarn, shape.head_dim, shape.rope_theta
    assert y is not None

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = y.attention_factor
    if factor is None:
        factor = (mscale(y.factor, y.mscale) / mscale(y.factor, y.mscale_all_dim)
                  if y.mscale and y.mscale_all_dim else mscale(y.factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp          # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = extrapolated / y.factor * (1 - keep) + extrapolated * keep
    return inv_freq, float(factor)


def _rope_scale(shape: LlamaShape) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; else 1)."""
    return 1.0 if shape.yarn is None else _yarn_inv_freq(shape, torch.ones(1))[1]


class Get(Protocol):
    """How a family's loader asks for a checkpoint tensor: by name and expected shape (the
    loader checks the shape and converts it to the model's device and dtype, unless
    `raw`), each tensor once; `has` says whether the checkpoint holds one."""

    def __call__(self, name: str, expected: tuple[int, ...], *,
                 raw: bool = False) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


# A CPU prefill step runs its MLP this many rows at a time. Each row's result is the same
# (the rows are independent), but a whole 8,192-token step's gate/up output (64 MiB in
# bf16 for the 82m model) goes through DRAM three times (written, read by silu, read by
# the product); 1,024 rows stay in the caches. Measured in CPU time, one thread, bf16,
# hidden 768 / intermediate 2,048: 455 -> 392 ms per layer-MLP at 8,192 rows, 106 -> 99
# at 2,048 (`bench/profile_prefill_step.py` for the whole step).
MLP_ROWS = 1024


@dataclass(slots=True)
class DenseMLP:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up fused into one matmul; on
    the CPU in slices of `MLP_ROWS` rows."""

    gate_up: Linear  # [2*intermediate, hidden]
    down: Linear

    def __call__(self, x: torch.Tensor, glue=None) -> torch.Tensor:
        """`glue`: a `cpu_kernels.LayerGlue` for the activation, else torch's ops."""
        T = x.shape[0]
        if T <= MLP_ROWS or x.device.type != "cpu":
            return self._rows(x, glue)
        out = torch.empty_like(x)       # down maps back to the hidden size
        for a in range(0, T, MLP_ROWS):
            out[a:a + MLP_ROWS] = self._rows(x[a:a + MLP_ROWS], glue)
        return out

    def _rows(self, x: torch.Tensor, glue=None) -> torch.Tensor:
        if glue is not None:
            return self.down(glue.silu_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        h = F.silu(gate)
        return self.down(h.mul_(up))


@dataclass(slots=True)
class DecoderLayer:
    """One pre-norm decoder layer: attention, then an MLP (dense or mixture of experts).
    `q_norm`/`k_norm`: a per-head RMSNorm on q and k before RoPE (Qwen3), else None."""

    attn_norm: torch.Tensor
    qkv: Linear  # [q + 2*kv, hidden] (q, k, v projections stacked)
    o: Linear
    mlp_norm: torch.Tensor
    mlp: Callable[[torch.Tensor], torch.Tensor]  # DenseMLP | layers.moe.SparseMoE
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [heads] attention-sink logits (gpt-oss)


def load_attention(get: Get, shape: LlamaShape, prefix: str) -> tuple[Linear, Linear]:
    """(fused qkv, o) from ``{prefix}self_attn.{q,k,v,o}_proj``, with the biases the shape
    says the family has."""
    D, attn = shape.hidden_size, prefix + "self_attn."
    w_qkv = torch.cat([get(attn + "q_proj.weight", (shape.q_size, D)),
                       get(attn + "k_proj.weight", (shape.kv_size, D)),
                       get(attn + "v_proj.weight", (shape.kv_size, D))])
    b_qkv = None
    if shape.qkv_bias:
        b_qkv = torch.cat([get(attn + "q_proj.bias", (shape.q_size,)),
                           get(attn + "k_proj.bias", (shape.kv_size,)),
                           get(attn + "v_proj.bias", (shape.kv_size,))])
    o = Linear(get(attn + "o_proj.weight", (D, shape.q_size)),
               get(attn + "o_proj.bias", (D,)) if shape.o_bias else None)
    return Linear(w_qkv, b_qkv), o


def load_dense_mlp(get: Get, shape: LlamaShape, prefix: str) -> DenseMLP:
    """``{prefix}mlp.{gate,up,down}_proj``, gate and up fused."""
    D, I = shape.hidden_size, shape.intermediate_size
    w_gate_up = torch.cat([get(prefix + "mlp.gate_proj.weight", (I, D)),
                           get(prefix + "mlp.up_proj.weight", (I, D))])
    return DenseMLP(Linear(w_gate_up), Linear(get(prefix + "mlp.down_proj.weight", (D, I))))


def load_swiglu_experts(get: Get, shape: LlamaShape, experts: str,
                        names: tuple[str, str, str]) -> tuple[list[Linear], list[Linear]]:
    """The experts under ``{experts}{e}.``, each a SwiGLU stored as three matrices named
    `names` (gate, up, down; ``moe_intermediate_size`` wide): gate and up fused per
    expert, as the dense MLP fuses them. Mixtral and Qwen3-MoE differ only in the names."""
    D, I = shape.hidden_size, shape.moe_intermediate_size
    gate, up, down = names
    gate_up, downs = [], []
    for e in range(shape.num_experts):
        ex = f"{experts}{e}."
        gate_up.append(Linear(torch.cat([get(ex + gate, (I, D)), get(ex + up, (I, D))])))
        downs.append(Linear(get(ex + down, (D, I))))
    return gate_up, downs


def load_layer(get: Get, shape: LlamaShape, i: int) -> DecoderLayer:
    """Layer `i` of a Llama, Mistral or Qwen2 checkpoint."""
    p, D = f"model.layers.{i}.", shape.hidden_size
    attn_norm = get(p + "input_layernorm.weight", (D,))
    qkv, o = load_attention(get, shape, p)
    return DecoderLayer(attn_norm=attn_norm, qkv=qkv, o=o,
                        mlp_norm=get(p + "post_attention_layernorm.weight", (D,)),
                        mlp=load_dense_mlp(get, shape, p))


class LlamaModel(torch.nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
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
        scale = _rope_scale(shape)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.rope_cos = torch.cat((cos, cos), -1).to(embed.device, embed.dtype)
        self.rope_sin = torch.cat((-sin, sin), -1).to(embed.device, embed.dtype)
        self.attn = PagedAttention(shape, embed.device, embed.dtype)
        # Residual adds and norms: eager, or compiled for decode steps (`layers.glue`).
        self.glue = eager_glue()
        self.decode_glue: Glue = self.glue
        # A step's elementwise work in C (`set_glue_kernel`), or None: torch's ops.
        self.glue_kernel = None
        # A decode step's layers in one C call (`set_decode_layers`), or None.
        self.decode_layers = None
        self._decode_weights: Any = None

    def set_glue_kernel(self, kernel) -> bool:
        """Run every step's residual adds and norms (Qwen3's q/k norms too), RoPE with the
        KV write, and a dense MLP's activation through `kernel` (`engines.cpu_kernels.
        LayerGlue` in bf16, `LayerGlueF32` in fp32, on the CPU; it rounds as the torch ops
        it replaces), or torch's ops again with None. False (nothing changed) for a model it
        does not fit."""
        if kernel is not None and (self.device.type != "cpu" or self.dtype != kernel.DTYPE):
            return False
        self.glue_kernel = kernel
        return True

    def set_decode_layers(self, kernel) -> bool:
        """Run a decode-only step's layers through `kernel` (`cpu_kernels.DecodeLayers`:
        the kernels the forward calls one by one, in one call, the same numbers), or one
        by one again with None. False (nothing changed) unless every layer already runs on
        the kernels: the glue kernel, the decode attention kernel (no sinks, no sliding
        window), a dense MLP and all four matmuls on the matmul kernel."""
        if kernel is None:
            self.decode_layers, self._decode_weights = None, None
            return True
        s = self.shape
        if self.glue_kernel is None or self.attn.decode_kernel is None or s.attention_sinks \
                or any(s.window(li) is not None for li in range(s.num_layers)):
            return False
        weights = []
        for li, layer in enumerate(self.layers):
            mlp = layer.mlp
            if not isinstance(mlp, DenseMLP):
                return False
            lins = (layer.qkv, layer.o, mlp.gate_up, mlp.down)
            if any(lin.pairs is None for lin in lins) or mlp.gate_up.rows != 2 * s.intermediate_size:
                return False
            nxt = self.layers[li + 1].attn_norm if li + 1 < len(self.layers) else None
            weights.append(dict(
                qkv=layer.qkv.pairs, o=layer.o.pairs, gate_up=mlp.gate_up.pairs,
                down=mlp.down.pairs, qkv_bias=layer.qkv.bias32, o_bias=layer.o.bias32,
                gate_up_bias=mlp.gate_up.bias32, down_bias=mlp.down.bias32,
                mlp_norm=layer.mlp_norm, next_norm=nxt, q_norm=layer.q_norm,
                k_norm=layer.k_norm))
        self._decode_weights = (kernel.layers(weights), weights)   # the tensors kept alive
        self.decode_layers = kernel
        return True

    def _run_decode_layers(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor, kv: torch.Tensor, batch: AttnBatch,
                           plan) -> None:
        """Every layer of a decode-only step in one call (`set_decode_layers`); h, x in place."""
        s = self.shape
        args = self.attn.kernel_inputs(plan, batch)
        self.decode_layers(
            self._decode_weights[0], h, x, heads=s.num_heads, kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, inter=s.intermediate_size, eps=s.rms_norm_eps,
            scale=self.attn.score_scale(), cos=self.rope_cos, sin=self.rope_sin,
            positions=positions, slots=slots.contiguous(), kv=kv, tables=args.tables,
            ctx_lens=args.ctx_lens, starts=args.starts, scratch=self.attn.scratch)

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
        positions = positions.to(self.device, torch.long)
        plan = self.attn.begin(batch, T, kv)
        kv_flat = kv.view(2, s.num_layers, kv.shape[2] * kv.shape[3], s.num_kv_heads, s.head_dim)
        slot_mapping = batch.slot_mapping.to(kv.device, torch.long)

        eps = s.rms_norm_eps
        fused = self.glue_kernel                          # C for the elementwise work
        if fused is not None:
            glue = fused                                  # its norms are a Glue's
        else:
            glue = self.decode_glue if batch.prompts() == 0 else self.glue
            cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, hd]
            sin = self.rope_sin[positions].unsqueeze(1)
        h = self.embed[input_ids]  # [T, D]
        # Each residual add is done with the norm after it (one compiled loop, `glue`).
        x = glue.rms_norm(h, self.layers[0].attn_norm, eps)
        last_layer = len(self.layers) - 1
        one_call = (self.decode_layers is not None and fused is not None and not plan.prefill
                    and plan.decoding > 0 and self.attn.backend == "sdpa")
        if one_call:        # every layer in one C call: the same kernels, in the same order
            self._run_decode_layers(h, x, positions, slot_mapping, kv, batch, plan)
        # The rows the last layer carries past its attention: only those whose logits are
        # read (a prompt's last token, each decoding sequence's), unless some step asks
        # for the prompt's hidden states. Every row's K and V are written before; what
        # follows in that layer (o-projection, MLP) only feeds the logits, and on a
        # 256-token prompt of the 82m model it is ~7% of the prompt's FLOPs.
        keep = plan.last_token_idx if plan.prefill and batch.hidden_rows is None else None
        for li, layer in enumerate(() if one_call else self.layers):
            qkv = layer.qkv(x).view(T, H + 2 * KVH, hd)
            if layer.q_norm is not None:
                if fused is not None:
                    fused.head_rms_norm_(qkv, 0, H, layer.q_norm, eps)
                    fused.head_rms_norm_(qkv, H, KVH, layer.k_norm, eps)
                else:
                    head_rms_norm_(qkv[:, :H], layer.q_norm, eps)
                    head_rms_norm_(qkv[:, H : H + KVH], layer.k_norm, eps)
            kv_layer = kv_flat[:, li]
            k_cache, v_cache = kv_layer[0], kv_layer[1]
            if fused is not None:
                fused.rope_kv(qkv, H, KVH, self.rope_cos, self.rope_sin, positions,
                              slot_mapping, k_cache, v_cache)
            else:
                # RoPE on the q and k heads together, in place (see rope_cos / rope_sin).
                qk = qkv[:, : H + KVH]
                swapped = qk.view(T, H + KVH, 2, hd // 2).flip(2).view(T, H + KVH, hd)
                qk.mul_(cos).addcmul_(swapped, sin)
                # K and V of this layer side by side: [2, T, KVH, hd] -> [2, slots, KVH, hd].
                kv_layer.index_copy_(1, slot_mapping,
                                     qkv[:, H:].view(T, 2, KVH, hd).transpose(0, 1))
            q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]

            o = self.attn(li, q, k, v, kv, k_cache, v_cache, batch, plan, window=s.window(li),
                          sinks=layer.sinks)
            if li == last_layer and keep is not None:
                o, h = o.index_select(0, keep), h.index_select(0, keep)
            h, x = glue.add_rms_norm(h, layer.o(o), layer.mlp_norm, eps)
            mlp = layer.mlp
            delta = mlp(x, fused) if fused is not None and isinstance(mlp, DenseMLP) else mlp(x)
            if li < last_layer:
                h, x = glue.add_rms_norm(h, delta, self.layers[li + 1].attn_norm, eps)
            else:
                h = h + delta

        # The final norm through the glue kernel too where it runs (torch's rms_norm took
        # ~0.25 ms of a 7 ms decode step of 4 rows), else eager (`self.glue`: torch's
        # rms_norm); a decode-only step's last tokens are all of h's rows, in order.
        final_norm = (fused if fused is not None else self.glue).rms_norm
        if batch.hidden_rows is not None:
            batch.hidden = final_norm(h.index_select(0, batch.hidden_rows.to(h.device)),
                                      self.norm, eps)
        if batch.logit_rows is not None:
            last = final_norm(h.index_select(0, batch.logit_rows.to(h.device)), self.norm, eps)
        else:
            last = final_norm(h if keep is not None or not plan.prefill
                              else h.index_select(0, plan.last_token_idx), self.norm, eps)
        return self.lm_head(last).float()
