"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm)
with a sparse mixture of SwiGLU experts in place of the dense MLP.

Checkpoint names per layer: ``mlp.gate.weight`` (the router, ``[experts, hidden]``) and
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (``moe_intermediate_size`` wide). Routing:
softmax, top ``num_experts_per_tok``, renormalized only with ``norm_topk_prob`` (true in
the released checkpoints; `transformers`' default is false). Layers named in
``mlp_only_layers`` or skipped by ``decoder_sparse_step`` keep a dense MLP
(``intermediate_size``); the released checkpoints have none.
"""

from __future__ import annotations

from appliance.engines.layers.linear import Linear
from appliance.engines.layers.moe import Router, SparseMoE
from appliance.engines.models.llama import (DecoderLayer, Get, load_attention,
                                            load_dense_mlp, load_swiglu_experts)
from appliance.engines.models.qwen3 import load_qk_norms
from appliance.models.shape import LlamaShape

__all__ = ["load_layer", "load_moe"]


def load_moe(get: Get, shape: LlamaShape, prefix: str) -> SparseMoE:
    router = Router(Linear(get(prefix + "mlp.gate.weight", (shape.num_experts,
                                                          shape.hidden_size))),
                    shape.experts_per_token, renormalize=shape.norm_topk_prob,
                    weights_in_input_dtype=True)
    gate_up, down = load_swiglu_experts(get, shape, prefix + "mlp.experts.",
                                        ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    return SparseMoE(router, gate_up, down)


def load_layer(get: Get, shape: LlamaShape, i: int) -> DecoderLayer:
    p, D = f"model.layers.{i}.", shape.hidden_size
    attn_norm = get(p + "input_layernorm.weight", (D,))
    qkv, o = load_attention(get, shape, p)
    q_norm, k_norm = load_qk_norms(get, shape, p)
    mlp = load_moe(get, shape, p) if shape.is_moe_layer(i) else load_dense_mlp(get, shape, p)
    return DecoderLayer(attn_norm=attn_norm, qkv=qkv, o=o, q_norm=q_norm, k_norm=k_norm,
                        mlp_norm=get(p + "post_attention_layernorm.weight", (D,)), mlp=mlp)
