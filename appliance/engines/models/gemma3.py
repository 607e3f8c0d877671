"""Gemma 3, text only (``Gemma3ForCausalLM``, config.json ``model_type: gemma3_text``):
its weights and its forward pass over the paged KV pool.

What differs from Llama, each as `transformers`' Gemma3 modeling does it:

- RMSNorm scales by ``1 + w`` and computes in fp32 (cast back after the scale), on the
  layer input, on the attention output (post-attention norm), before and after the MLP,
  on q and k per head, and at the end;
- the embedding is multiplied by sqrt(hidden) (rounded to the weights' dtype);
- scores are scaled by ``query_pre_attn_scalar ** -0.5``, not 1/sqrt(head_dim);
- local layers (``layer_types`` / ``sliding_window_pattern``) attend over a sliding window
  with their own RoPE base (``rope_local_base_freq``, 10,000); global layers attend over
  everything with ``rope_theta`` (1e6) and, when configured, linear RoPE scaling;
- the MLP is GELU (tanh approximation) gated;
- logits are soft-capped (``cap * tanh(x / cap)``) when ``final_logit_softcapping`` is set.

The multimodal ``Gemma3ForConditionalGeneration`` checkpoints (model_type ``gemma3``) are
refused by the loader: their text weights sit under other names beside a vision tower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from appliance.engines.kv_pool import layout_tag
from appliance.engines.layers.attention import AttnBatch, PagedAttention
from appliance.engines.models.llama import Linear, LlamaModel
from appliance.models.shape import LlamaShape, ModelLoadError

__all__ = ["Gemma3Model", "GemmaNumerics", "SoftcapHead", "build"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True, slots=True)
class GemmaNumerics:
    """Gemma 3's numbers beyond the shape every family shares (`LlamaShape`)."""

    query_pre_attn_scalar: float
    local_rope_theta: float
    global_rope_factor: float            # linear RoPE scaling of the global layers (1 = none)
    final_logit_softcapping: float | None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> GemmaNumerics:
        """From config.json in transformers 4.x spelling (``rope_local_base_freq``,
        ``rope_scaling``) or 5.x (``rope_parameters`` per layer type)."""
        if cfg.get("attn_logit_softcapping"):
            raise ModelLoadError("unsupported attn_logit_softcapping for Gemma3ForCausalLM "
                                 "(Gemma 3 checkpoints do not set it)")
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError("unsupported use_bidirectional_attention=true (an encoder)")
        params = cfg.get("rope_parameters") or {}
        local = params.get("sliding_attention") if isinstance(params, dict) else None
        local_theta = float((local or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
                            or 10000.0)
        if local and (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"unsupported rope type {local.get('rope_type')!r} on "
                                 "Gemma 3's local layers")
        glob = params.get("full_attention") if isinstance(params, dict) else None
        glob = glob or cfg.get("rope_scaling") or {}
        kind = glob.get("rope_type") or glob.get("type") or "default"
        if kind not in ("default", "linear"):
            raise ModelLoadError(f"unsupported rope type {kind!r} for Gemma3ForCausalLM; "
                                 "supported: default, linear")
        factor = float(glob.get("factor") or 1.0) if kind == "linear" else 1.0
        cap = cfg.get("final_logit_softcapping")
        return cls(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                   local_rope_theta=local_theta, global_rope_factor=factor,
                   final_logit_softcapping=float(cap) if cap else None)


class SoftcapHead:
    """The vocabulary projection, then ``cap * tanh(logits / cap)`` (Gemma's final logit
    soft-capping), so prompt logprobs through `lm_head` are capped too."""

    __slots__ = ("linear", "cap")

    def __init__(self, linear: Linear, cap: float) -> None:
        self.linear, self.cap = linear, cap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) / self.cap) * self.cap

    def dense(self) -> torch.Tensor:
        return self.linear.dense()


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor         # every norm weight here is 1 + w, fp32
    qkv: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: Linear
    post_attn_norm: torch.Tensor
    pre_mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    post_mlp_norm: torch.Tensor


def _rope_tables(theta: float, factor: float, head_dim: int, positions: int,
                 device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos and (-sin, sin) tables, as `LlamaModel` keeps them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents) / factor
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat((cos, cos), -1).to(device, dtype),
            torch.cat((-sin, sin), -1).to(device, dtype))


class Gemma3Model(LlamaModel):
    """A `LlamaModel` in interface (shape, lm_head, attention backends, forward's
    arguments and result); its own layers and forward."""

    def __init__(self, shape: LlamaShape, numerics: GemmaNumerics, embed: torch.Tensor,
                 layers: list[_Layer], norm: torch.Tensor, lm_head: Linear | SoftcapHead
                 ) -> None:
        super().__init__(shape, embed, layers, norm, lm_head)  # type: ignore[arg-type]
        self.numerics = numerics
        dev, dt, P = embed.device, embed.dtype, shape.max_position_embeddings
        self.rope_cos, self.rope_sin = _rope_tables(
            shape.rope_theta, numerics.global_rope_factor, shape.head_dim, P, dev, dt)
        self.local_cos, self.local_sin = _rope_tables(
            numerics.local_rope_theta, 1.0, shape.head_dim, P, dev, dt)
        self.attn = PagedAttention(shape, dev, dt, scale=numerics.query_pre_attn_scalar**-0.5)
        # transformers multiplies by a tensor of the weights' dtype: sqrt(hidden), rounded.
        self.embed_scale = torch.tensor(math.sqrt(shape.hidden_size), dtype=dt)
        self.act = _ACTIVATIONS[shape.hidden_act]

    def set_glue_kernel(self, kernel) -> bool:
        """Gemma's norms (times 1 + w, in fp32), embedding scale and activation are not
        `LayerGlue`'s: its forward keeps torch's ops."""
        return kernel is None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma3RMSNorm: in fp32, times (1 + w), cast back."""
        eps = self.shape.rms_norm_eps
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttnBatch,
        kv: torch.Tensor,
    ) -> torch.Tensor:
        """One step; fp32 logits ``[B, vocab]`` of each sequence's last new token."""
        s = self.shape
        H, KVH, hd = s.num_heads, s.num_kv_heads, s.head_dim
        T = input_ids.numel()
        expected = (2, s.num_layers, kv.shape[2] if kv.dim() == 6 else -1)
        if kv.dim() != 6 or kv.shape[:3] != expected or kv.shape[4:] != (KVH, hd):
            raise ValueError(
                f"KV pool shape {tuple(kv.shape)} does not fit {layout_tag(s, 0, kv.dtype)}")
        if kv.dtype != self.dtype or not kv.is_contiguous():
            raise ValueError(f"KV pool must be a contiguous {self.dtype} tensor, got {kv.dtype}")
        input_ids = input_ids.to(self.device)
        positions = positions.to(self.device)
        plan = self.attn.begin(batch, T, kv)
        kv_flat = kv.view(2, s.num_layers, kv.shape[2] * kv.shape[3], KVH, hd)
        slot_mapping = batch.slot_mapping.to(kv.device, torch.long)
        rope = {False: (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)),
                True: (self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1))}

        h = self.embed[input_ids] * self.embed_scale
        # As LlamaModel.forward: past the last attention only the rows whose logits are read.
        keep = plan.last_token_idx if plan.prefill and batch.hidden_rows is None else None
        last_layer = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            window = s.window(li)
            x = self._norm(h, layer.attn_norm)
            qkv = layer.qkv(x).view(T, H + 2 * KVH, hd)
            q = self._norm(qkv[:, :H], layer.q_norm)
            k = self._norm(qkv[:, H:H + KVH], layer.k_norm)
            cos, sin = rope[window is not None]
            qk = torch.cat((q, k), 1)
            swapped = qk.view(T, H + KVH, 2, hd // 2).flip(2).view(T, H + KVH, hd)
            qk.mul_(cos).addcmul_(swapped, sin)
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH:]
            kv_layer = kv_flat[:, li]
            kv_layer.index_copy_(1, slot_mapping, torch.stack((k, v)))
            o = self.attn(li, q, k, v, kv, kv_layer[0], kv_layer[1], batch, plan, window)
            if li == last_layer and keep is not None:
                o, h = o.index_select(0, keep), h.index_select(0, keep)
            h = h + self._norm(layer.o(o), layer.post_attn_norm)

            x = self._norm(h, layer.pre_mlp_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + self._norm(layer.down(self.act(gate) * up), layer.post_mlp_norm)

        if batch.hidden_rows is not None:
            rows = batch.hidden_rows.to(h.device)
            batch.hidden = self._norm(h.index_select(0, rows), self.norm)
        last = self._norm(h if keep is not None else h.index_select(0, plan.last_token_idx),
                          self.norm)
        return self.lm_head(last).float()


def build(shape: LlamaShape, cfg: dict[str, Any],
          get: Callable[[str, tuple[int, ...]], torch.Tensor]) -> Gemma3Model:
    """The model from its tensors (`get(name, shape)` returns one, checked, in the load
    dtype; the loader's)."""
    numerics = GemmaNumerics.from_hf_config(cfg)
    if shape.hidden_act not in _ACTIVATIONS:
        raise ModelLoadError(f"unsupported hidden_activation {shape.hidden_act!r} for "
                             f"Gemma3ForCausalLM; supported: {', '.join(_ACTIVATIONS)}")
    D, I, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim

    def norm(name: str, size: int) -> torch.Tensor:
        return 1.0 + get(name, (size,)).float()

    embed = get("model.embed_tokens.weight", (shape.vocab_size, D))
    head = Linear(embed if shape.tie_word_embeddings
                  else get("lm_head.weight", (shape.vocab_size, D)))
    layers: list[_Layer] = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_b = None
        if shape.qkv_bias:
            qkv_b = torch.cat([get(a + "q_proj.bias", (shape.q_size,)),
                               get(a + "k_proj.bias", (shape.kv_size,)),
                               get(a + "v_proj.bias", (shape.kv_size,))])
        layers.append(_Layer(
            attn_norm=norm(p + "input_layernorm.weight", D),
            qkv=Linear(torch.cat([get(a + "q_proj.weight", (shape.q_size, D)),
                                  get(a + "k_proj.weight", (shape.kv_size, D)),
                                  get(a + "v_proj.weight", (shape.kv_size, D))]), qkv_b),
            q_norm=norm(a + "q_norm.weight", hd),
            k_norm=norm(a + "k_norm.weight", hd),
            o=Linear(get(a + "o_proj.weight", (D, shape.q_size)),
                     get(a + "o_proj.bias", (D,)) if shape.o_bias else None),
            post_attn_norm=norm(p + "post_attention_layernorm.weight", D),
            pre_mlp_norm=norm(p + "pre_feedforward_layernorm.weight", D),
            gate_up=Linear(torch.cat([get(p + "mlp.gate_proj.weight", (I, D)),
                                      get(p + "mlp.up_proj.weight", (I, D))])),
            down=Linear(get(p + "mlp.down_proj.weight", (D, I))),
            post_mlp_norm=norm(p + "post_feedforward_layernorm.weight", D),
        ))
    final = norm("model.norm.weight", D)
    cap = numerics.final_logit_softcapping
    return Gemma3Model(shape, numerics, embed, layers, final,
                       SoftcapHead(head, cap) if cap else head)
