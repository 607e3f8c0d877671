"""Mixtral (8x7B, 8x22B): Mistral's attention with a sparse mixture of SwiGLU experts.

Checkpoint names per layer: ``block_sparse_moe.gate.weight`` (the router,
``[experts, hidden]``) and ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up,
down; ``intermediate_size`` wide). Routing: softmax, top ``num_experts_per_tok``, always
renormalized, the weights kept in fp32. No attention biases; a sliding window only where
config.json sets one (the released checkpoints write null).
"""

from __future__ import annotations

from appliance.engines.layers.linear import Linear
from appliance.engines.layers.moe import Router, SparseMoE
from appliance.engines.models.llama import (DecoderLayer, Get, load_attention,
                                            load_swiglu_experts)
from appliance.models.shape import LlamaShape

__all__ = ["load_layer", "load_moe"]


def load_moe(get: Get, shape: LlamaShape, prefix: str) -> SparseMoE:
    moe = prefix + "block_sparse_moe."
    router = Router(Linear(get(moe + "gate.weight", (shape.num_experts, shape.hidden_size))),
                    shape.experts_per_token, renormalize=True)
    gate_up, down = load_swiglu_experts(get, shape, moe + "experts.",
                                        ("w1.weight", "w3.weight", "w2.weight"))
    return SparseMoE(router, gate_up, down)


def load_layer(get: Get, shape: LlamaShape, i: int) -> DecoderLayer:
    p, D = f"model.layers.{i}.", shape.hidden_size
    attn_norm = get(p + "input_layernorm.weight", (D,))
    qkv, o = load_attention(get, shape, p)
    return DecoderLayer(attn_norm=attn_norm, qkv=qkv, o=o,
                        mlp_norm=get(p + "post_attention_layernorm.weight", (D,)),
                        mlp=load_moe(get, shape, p))
