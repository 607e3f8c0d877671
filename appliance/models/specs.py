"""Model shapes for the timing simulator: sizes that set weight traffic and KV footprint.

A `ModelSpec` holds only what a roofline needs. Dense models are described by their
Hugging Face config.json and counted from shapes (`spec_from_hf_config`, reading the
config with the torch engine's own `models.shape` reader), so the catalogue and a user's
checkpoint go through the same arithmetic. MoE entries whose
checkpoints mix precisions are written out by hand from their model cards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.models.shape import LlamaShape
from appliance.models.tiny import DEFAULT_MODEL_NAME, tiny_config


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float            # total parameters
    active_params: float     # parameters touched per token (MoE: active experts only; dense: = params)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: float      # bytes per weight (bf16=2, fp8=1, mxfp4≈0.53)
    kv_bytes: float          # bytes per KV element
    max_context: int
    sliding_window: int | None = None   # tokens a windowed layer attends over
    sliding_layers: int = 0             # layers with that window (the rest attend fully)

    def kv_bytes_per_token(self) -> float:
        """K and V for one token across all layers. For models with sliding-window
        layers (gpt-oss, Gemma 3) this is the full-attention upper bound."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def kv_bytes_for_context(self, tokens: int) -> float:
        """K and V one sequence of `tokens` needs: windowed layers keep at most their
        window. (The torch engine keeps every block while any layer attends fully, and
        reads only the window's; this is what a windowed cache needs.)"""
        per_layer = 2 * self.kv_heads * self.head_dim * self.kv_bytes
        windowed = min(tokens, self.sliding_window or tokens) * self.sliding_layers
        return (windowed + tokens * (self.layers - self.sliding_layers)) * per_layer

    def weight_total_bytes(self) -> float:
        return self.params * self.weight_bytes


# --- reading Hugging Face configs --------------------------------------------------

_DTYPE_BYTES = {
    "float32": 4.0, "float": 4.0,
    "bfloat16": 2.0, "float16": 2.0, "half": 2.0,
    "float8_e4m3fn": 1.0, "float8_e5m2": 1.0,
}
# MXFP4: 4-bit elements plus one 8-bit scale per 32 -> 4.25 bits = 0.53 bytes.
_MXFP4_BYTES = 4.25 / 8
# NVFP4: 4-bit elements plus one FP8 scale per 16 -> 4.5 bits.
_NVFP4_BYTES = 4.5 / 8


def spec_from_hf_config(path_or_dict: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
    """A ModelSpec from an HF config.json (a dict, the file, or its directory), read by
    the same `LlamaShape.from_hf_config` the torch engine loads a checkpoint with.

    Parameter counts are computed from shapes and match
    `sum(p.numel() for p in model.parameters())` of the transformers model. For a mixture
    of experts (Mixtral, Qwen3-MoE) `params` counts every expert (what memory holds) and
    `active_params` only the experts a token runs through (what a step computes and
    reads per token; the roofline caps the read at all of them).
    """
    if isinstance(path_or_dict, dict):
        cfg = path_or_dict
        default_name = str(cfg.get("_name_or_path") or cfg.get("model_type") or "model")
    else:
        path = Path(path_or_dict)
        if path.is_dir():
            path = path / "config.json"
        cfg = json.loads(path.read_text(encoding="utf-8"))
        default_name = path.parent.name
    shape = LlamaShape.from_hf_config(cfg)
    hidden, inter, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_dim, kv_dim = shape.q_size, shape.kv_size

    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if shape.qkv_bias:
        attn += q_dim + 2 * kv_dim
    if shape.o_bias:
        attn += hidden
    if shape.qk_norm:
        attn += 2 * head_dim                        # q_norm, k_norm
    if shape.attention_sinks:
        attn += shape.num_heads                     # one sink logit per head (gpt-oss)

    def swiglu(width: int) -> int:                  # gate, up, down
        return 3 * hidden * width + ((2 * width + hidden) if shape.mlp_bias else 0)

    dense = swiglu(inter)
    # MoE layers: the router and every expert are held (memory), but a token runs
    # through the router and only its experts_per_token experts (compute, bandwidth).
    expert = swiglu(shape.moe_intermediate_size)
    router = hidden * shape.num_experts + (shape.num_experts if shape.router_bias else 0)
    moe_layers = sum(shape.is_moe_layer(i) for i in range(shape.num_layers))
    dense_layers = shape.num_layers - moe_layers

    norms = (4 if shape.family == "gemma3_text" else 2) * hidden   # Gemma: pre/post MLP too
    embed = shape.vocab_size * hidden
    head = 0 if shape.tie_word_embeddings else shape.vocab_size * hidden
    outside = embed + head + hidden                 # + final norm
    per_layer = attn + norms
    params = (outside + shape.num_layers * per_layer + dense_layers * dense
              + moe_layers * (router + shape.num_experts * expert))
    active = (outside + shape.num_layers * per_layer + dense_layers * dense
              + moe_layers * (router + shape.experts_per_token * expert))

    weight_bytes, kv_bytes = _bytes_per_element(cfg)
    quant = cfg.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "mxfp4" and moe_layers:
        # gpt-oss: only the experts' matrices are MXFP4; everything else (attention,
        # router, embeddings, the experts' biases) keeps the compute dtype.
        compute, _ = _bytes_per_element({k: v for k, v in cfg.items()
                                         if k != "quantization_config"})
        fp4 = moe_layers * shape.num_experts * 3 * hidden * shape.moe_intermediate_size
        weight_bytes = (fp4 * weight_bytes + (params - fp4) * compute) / params
    return ModelSpec(
        name=name or default_name,
        params=float(params),
        active_params=float(active),
        layers=shape.num_layers,
        hidden=hidden,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        head_dim=head_dim,
        vocab=shape.vocab_size,
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        max_context=shape.max_position_embeddings,
        sliding_window=shape.sliding_window,
        sliding_layers=sum(w is not None for w in shape.layer_windows),
    )


def _bytes_per_element(cfg: dict[str, Any]) -> tuple[float, float]:
    """(weight bytes, KV bytes). KV is kept in the compute dtype unless the checkpoint
    says it is quantized. Quantized checkpoints usually keep embeddings and lm_head
    in 16 bits; that few-percent difference is ignored here."""
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} in config")
    compute = _DTYPE_BYTES[dtype]
    quant = cfg.get("quantization_config")
    if not quant:
        return compute, compute
    method = str(quant.get("quant_method", "")).lower()
    kv_quantized = bool(quant.get("kv_cache_scheme") or quant.get("kv_cache_quant_algo"))
    algo = str(quant.get("quant_algo", "")).upper()
    if method in {"fp8", "fbgemm_fp8"} or (method == "modelopt" and algo == "FP8"):
        weight = 1.0
    elif method == "mxfp4":
        weight = _MXFP4_BYTES
    elif method == "modelopt" and algo == "NVFP4":
        weight = _NVFP4_BYTES
    elif method == "compressed-tensors":
        groups = (quant.get("config_groups") or {}).values()
        bits = {int(g["weights"]["num_bits"]) for g in groups if g.get("weights")}
        if len(bits) != 1:
            raise ValueError(f"cannot size compressed-tensors weights with bit widths {bits}")
        weight = bits.pop() / 8
    elif "bits" in quant:                           # GPTQ, AWQ
        weight = int(quant["bits"]) / 8
    else:
        raise ValueError(f"cannot size weights quantized with {method!r}")
    return weight, (1.0 if kv_quantized else compute)


# --- catalogue -----------------------------------------------------------------------

def _llama31(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    # meta-llama/Llama-3.1-{8B,70B} config.json: GQA with 8 KV heads, head_dim 128,
    # vocab 128256, 128K context (rope_scaling "llama3"), untied embeddings, bf16.
    return {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _catalogue() -> dict[str, ModelSpec]:
    specs: list[ModelSpec] = [
        # 8,030,261,248 parameters (model card: "8B"; HF safetensors total 8.03B).
        spec_from_hf_config(_llama31(4096, 14336, 32, 32), "llama-3.1-8b"),
        # 70,553,706,496 parameters (model card: "70B").
        spec_from_hf_config(_llama31(8192, 28672, 80, 64), "llama-3.1-70b"),
        # FP8 weights and FP8 KV cache, as in nvidia/Llama-3.1-70B-Instruct-FP8 (ModelOpt,
        # kv_cache_quant_algo FP8) or neuralmagic's FP8 checkpoint served with
        # vLLM --kv-cache-dtype fp8.
        spec_from_hf_config(
            _llama31(8192, 28672, 80, 64)
            | {"quantization_config": {"quant_method": "fp8", "kv_cache_scheme": "fp8"}},
            "llama-3.1-70b-fp8",
        ),
        # Llama 3.2 1B: tied embeddings, head_dim 64 (meta-llama/Llama-3.2-1B config.json).
        spec_from_hf_config(
            _llama31(2048, 8192, 16, 32) | {"tie_word_embeddings": True, "head_dim": 64},
            "llama-3.2-1b",
        ),
        # gpt-oss: OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (arXiv:2508.10925),
        # Table 1: 116.83B total / 5.13B active (120b), 20.91B / 3.61B (20b); checkpoint
        # 60.8 GiB / 12.8 GiB. Shapes from openai/gpt-oss-120b config.json: hidden 2880,
        # 64 query heads and 8 KV heads of dim 64, vocab 201088, 131072 context,
        # 128 experts top-4 (20b: 32 experts, 24 layers). MoE weights are MXFP4
        # (~0.53 B/weight), the rest bf16, so weight_bytes is the checkpoint's average
        # (GiB * 2^30 / params). KV is bf16. Half of the layers use a 128-token sliding
        # window, so kv_bytes_per_token() overstates long-context KV by up to 2x.
        ModelSpec(
            name="gpt-oss-120b", params=116.83e9, active_params=5.13e9, layers=36,
            hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
            weight_bytes=60.8 * 2**30 / 116.83e9, kv_bytes=2.0, max_context=131072,
        ),
        ModelSpec(
            name="gpt-oss-20b", params=20.91e9, active_params=3.61e9, layers=24,
            hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
            weight_bytes=12.8 * 2**30 / 20.91e9, kv_bytes=2.0, max_context=131072,
        ),
        # The checkpoints appliance.models.tiny generates, sized from the same config.
        spec_from_hf_config(tiny_config("tiny"), DEFAULT_MODEL_NAME),
        spec_from_hf_config(tiny_config("20m"), f"{DEFAULT_MODEL_NAME}-20m"),
    ]
    return {spec.name: spec for spec in specs}


MODEL_SPECS: dict[str, ModelSpec] = _catalogue()


def model_spec_name(spec: str) -> str:
    """What a model spec is served as: a catalogue name as given, a checkpoint directory
    (or its config.json) by the directory's name."""
    path = Path(spec).expanduser()
    if spec.lower() not in MODEL_SPECS and path.exists():
        return (path.parent if path.is_file() else path).name
    return spec


def lookup_model_spec(name: str) -> ModelSpec:
    """The catalogue entry for name, case-insensitively; else, when `name` is a checkpoint
    directory (or its config.json), the spec its config.json gives (`spec_from_hf_config`:
    e.g. a Qwen3-MoE sized by its total and active parameters)."""
    spec = MODEL_SPECS.get(name.lower())
    if spec is not None:
        return spec
    path = Path(name).expanduser()
    if (path / "config.json").is_file() or (path.suffix == ".json" and path.is_file()):
        try:
            return spec_from_hf_config(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot size {name}: {e}") from None
    raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_SPECS))}, "
                     "or a checkpoint directory with a config.json")
