"""Qwen3 (dense): Llama's layer with a per-head RMSNorm on q and k before RoPE.

Checkpoint names are Llama's plus ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``
(``[head_dim]`` each, shared by the heads). Qwen3 has no q/k/v biases unless
``attention_bias``; its sliding window (``use_sliding_window``) is read by the shape.
"""

from __future__ import annotations

import torch

from appliance.engines.models.llama import DecoderLayer, Get, load_attention, load_dense_mlp
from appliance.models.shape import LlamaShape

__all__ = ["load_layer", "load_qk_norms"]


def load_qk_norms(get: Get, shape: LlamaShape, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    attn, hd = prefix + "self_attn.", (shape.head_dim,)
    return get(attn + "q_norm.weight", hd), get(attn + "k_norm.weight", hd)


def load_layer(get: Get, shape: LlamaShape, i: int) -> DecoderLayer:
    p, D = f"model.layers.{i}.", shape.hidden_size
    attn_norm = get(p + "input_layernorm.weight", (D,))
    qkv, o = load_attention(get, shape, p)
    q_norm, k_norm = load_qk_norms(get, shape, p)
    return DecoderLayer(attn_norm=attn_norm, qkv=qkv, o=o, q_norm=q_norm, k_norm=k_norm,
                        mlp_norm=get(p + "post_attention_layernorm.weight", (D,)),
                        mlp=load_dense_mlp(get, shape, p))
