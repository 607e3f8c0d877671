"""gpt-oss (openai/gpt-oss-20b, -120b): attention with biases and per-head sinks,
alternating sliding-window (128) and full layers, YaRN RoPE, and a mixture of experts
with a biased top-k-then-softmax router and biased, clamped-SwiGLU experts.

Checkpoint names per layer: ``self_attn.{q,k,v,o}_proj.{weight,bias}``,
``self_attn.sinks`` (``[heads]``), ``mlp.router.{weight,bias}``, and the experts stacked
per layer, either as ``transformers`` saves them unquantized
(``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]``, ``down_proj`` ``[E, I, hidden]``) or
as OpenAI ships them, MXFP4 (``gate_up_proj_blocks`` ``[E, 2I, hidden/32, 16]`` uint8,
two 4-bit values a byte, low nibble first, and ``gate_up_proj_scales`` ``[E, 2I,
hidden/32]``, one power-of-two exponent + 127 per 32 values; likewise ``down_proj``),
with ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, hidden]``. The gate
and up outputs are interleaved (even rows gate, odd rows up); they are split at load.

MXFP4 experts are dequantized at load, one expert at a time, to the model's dtype (the
engine has no FP4 matmul). Load-time memory bound: the checkpoint's tensors as read
(about the safetensors files' size; each layer's blocks are freed once its experts are
built) + the model being built (4 bytes a parameter in fp32) + one expert's temporaries
(its dequantized gate/up matrix in fp32 and the nibble indices: about 2I x hidden x 12
bytes, 200 MB for gpt-oss's 2880 x 5760).

Sliding windows: the shape gives each layer its window (`LlamaShape.window`: 128 on
every other layer from the first, None on the rest), which the forward pass hands to the
attention with the layer's sinks.
"""

from __future__ import annotations

import torch

from appliance.engines.layers.linear import Linear
from appliance.engines.layers.moe import SparseMoE, TopKSoftmaxRouter, clamped_swiglu
from appliance.engines.models.llama import DecoderLayer, Get, load_attention
from appliance.models.shape import LlamaShape, ModelLoadError

__all__ = ["FP4_VALUES", "dequantize_mxfp4", "load_layer", "load_moe"]

# The 16 values of an FP4 (E2M1) code, by code (bit 3 is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., G, 16]`` uint8 blocks and ``[..., G]`` uint8 exponents -> ``[..., G * 32]``:
    value = FP4 code x 2^(scale - 127), the low nibble of each byte first."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int32)  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)                                            # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


class BiasAfter:
    """An expert's ``x @ W + b`` as gpt-oss's reference (`transformers`) computes it: the
    product rounded to the activations' dtype, then the bias added. A bias fused into the
    matmul rounds once instead of twice, which in bf16 moves an expert's output by a unit
    in the last place, enough to flip a later router's choice at a near-tie."""

    __slots__ = ("linear", "bias")

    def __init__(self, linear: Linear, bias: torch.Tensor) -> None:
        self.linear = linear
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias

    def dense(self) -> torch.Tensor:
        return self.linear.dense()


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) gate0, up0, gate1, up1, ... -> all gates, then all ups."""
    return torch.cat((t[0::2], t[1::2]))


def load_moe(get: Get, shape: LlamaShape, prefix: str, device: torch.device,
             dtype: torch.dtype) -> SparseMoE:
    D, I, E = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts
    mlp, ex = prefix + "mlp.", prefix + "mlp.experts."
    router = TopKSoftmaxRouter(Linear(get(mlp + "router.weight", (E, D)),
                                      get(mlp + "router.bias", (E,))), shape.experts_per_token)
    gu_bias = get(ex + "gate_up_proj_bias", (E, 2 * I))
    down_bias = get(ex + "down_proj_bias", (E, D))
    if get.has(ex + "gate_up_proj_blocks"):
        if D % 32 or I % 32:
            raise ModelLoadError(f"MXFP4 experts need hidden {D} and intermediate {I} "
                             "divisible by 32")
        gu_blocks = get(ex + "gate_up_proj_blocks", (E, 2 * I, D // 32, 16), raw=True)
        gu_scales = get(ex + "gate_up_proj_scales", (E, 2 * I, D // 32), raw=True)
        dn_blocks = get(ex + "down_proj_blocks", (E, D, I // 32, 16), raw=True)
        dn_scales = get(ex + "down_proj_scales", (E, D, I // 32), raw=True)

        def gate_up_of(e: int) -> torch.Tensor:                 # [2I, D]
            return dequantize_mxfp4(gu_blocks[e], gu_scales[e], dtype).to(device)

        def down_of(e: int) -> torch.Tensor:                    # [D, I]
            return dequantize_mxfp4(dn_blocks[e], dn_scales[e], dtype).to(device)
    else:
        gu_all = get(ex + "gate_up_proj", (E, D, 2 * I))         # x @ W layout
        dn_all = get(ex + "down_proj", (E, I, D))

        def gate_up_of(e: int) -> torch.Tensor:
            return gu_all[e].T

        def down_of(e: int) -> torch.Tensor:
            return dn_all[e].T

    gate_up = [BiasAfter(Linear(_deinterleave(gate_up_of(e)).contiguous()),
                         _deinterleave(gu_bias[e])) for e in range(E)]
    down = [BiasAfter(Linear(down_of(e).contiguous()), down_bias[e].clone()) for e in range(E)]
    return SparseMoE(router, gate_up, down, clamped_swiglu(shape.swiglu_limit,
                                                           shape.swiglu_alpha))


def load_layer(get: Get, shape: LlamaShape, i: int) -> DecoderLayer:
    p, D = f"model.layers.{i}.", shape.hidden_size
    attn_norm = get(p + "input_layernorm.weight", (D,))
    qkv, o = load_attention(get, shape, p)
    sinks = get(p + "self_attn.sinks", (shape.num_heads,))
    return DecoderLayer(attn_norm=attn_norm, qkv=qkv, o=o, sinks=sinks,
                        mlp_norm=get(p + "post_attention_layernorm.weight", (D,)),
                        mlp=load_moe(get, shape, p, attn_norm.device, attn_norm.dtype))
