"""Loading an HF safetensors checkpoint into a `LlamaModel` (the decoder every family runs;
Gemma 3: its subclass `models.gemma3.Gemma3Model`).

Supported checkpoints: HF ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``GptOssForCausalLM``
(MXFP4 experts dequantized at load) and ``Gemma3ForCausalLM`` (text only) in safetensors
(single file or sharded index); each family's module builds its layers
(`LAYER_LOADERS`). config.json is read by the one shape reader
(`appliance.models.shape`), which knows more families than this engine runs;
`servable_shape` refuses the rest with a one-line reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from appliance.engines.models import gpt_oss, llama, mixtral, qwen3, qwen3_moe
from appliance.engines.models.llama import DecoderLayer, Get, Linear, LlamaModel
from appliance.models.shape import LlamaShape, ModelLoadError, architecture_of, parse_yarn

__all__ = ["LAYER_LOADERS", "SUPPORTED_ARCHITECTURES", "load_model", "servable_shape"]

# architecture -> how its checkpoint's layer i becomes a DecoderLayer.
LAYER_LOADERS: dict[str, Callable[[Get, LlamaShape, int], DecoderLayer]] = {
    "LlamaForCausalLM": llama.load_layer,
    "MistralForCausalLM": llama.load_layer,
    "Qwen2ForCausalLM": llama.load_layer,
    "Qwen3ForCausalLM": qwen3.load_layer,
    "Qwen3MoeForCausalLM": qwen3_moe.load_layer,
    "MixtralForCausalLM": mixtral.load_layer,
    "GptOssForCausalLM": gpt_oss.load_layer,
}
# Gemma 3 builds its own model (`models.gemma3.build`).
SUPPORTED_ARCHITECTURES = tuple(LAYER_LOADERS) + ("Gemma3ForCausalLM",)


def servable_shape(cfg: dict[str, Any]) -> LlamaShape:
    """The shape of a config.json this engine can run; raises ModelLoadError otherwise."""
    arch = architecture_of(cfg)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shape = LlamaShape.from_hf_config(cfg)
    if shape.family == "gemma3_text":
        from appliance.engines.models.gemma3 import GemmaNumerics
        GemmaNumerics.from_hf_config(cfg)       # refuses what the Gemma 3 model cannot run
        if shape.head_dim % 2:
            raise ModelLoadError(f"head_dim {shape.head_dim} must be even for RoPE")
        return shape
    if shape.hidden_act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {shape.hidden_act!r} for {arch}; only 'silu'")
    if shape.mlp_bias and shape.family != "gpt_oss":
        raise ModelLoadError(f"unsupported mlp_bias=true for {arch}")
    if shape.head_dim % 2:
        raise ModelLoadError(f"head_dim {shape.head_dim} must be even for RoPE")
    if shape.partial_rotary_factor != 1.0:
        raise ModelLoadError("unsupported partial_rotary_factor != 1.0")
    if shape.rope_type == "yarn" and shape.yarn is None:
        parse_yarn(cfg)         # raises, naming what is missing
    if shape.rope_type not in ("default", "llama3", "yarn"):
        raise ModelLoadError(f"unsupported rope scaling type {shape.rope_type!r}; "
                             "supported: default, llama3, yarn")
    return shape


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


class _Tensors:
    """A checkpoint's tensors, each handed out once (`Get`): checked against the shape the
    model expects, converted to the model's device and dtype (unless `raw`: quantized
    blocks are dequantized by the family first), and dropped from here, so it is freed as
    soon as the model has packed or fused it."""

    def __init__(self, raw: dict[str, torch.Tensor], model_dir: Path,
                 device: str | torch.device, dtype: torch.dtype) -> None:
        self.raw, self.model_dir, self.device, self.dtype = raw, model_dir, device, dtype

    def has(self, name: str) -> bool:
        return name in self.raw

    def __call__(self, name: str, expected: tuple[int, ...], *, raw: bool = False) -> torch.Tensor:
        t = self.raw.pop(name, None)
        if t is None:
            raise ModelLoadError(f"checkpoint {self.model_dir} lacks tensor {name!r}")
        if tuple(t.shape) != expected:
            raise ModelLoadError(f"tensor {name!r} in {self.model_dir} has shape "
                                 f"{tuple(t.shape)}, expected {expected}")
        if raw:
            return t
        out = t.to(device=self.device, dtype=self.dtype)
        # A tensor that needed no conversion is still a slice of the checkpoint's mapping
        # (safetensors maps the whole file), and one such slice kept (a norm's weight) keeps
        # the whole file mapped, with every page the load read counted in the worker's
        # memory: 1.7 GiB for a 0.93B-parameter bf16 checkpoint. A copy lets it go.
        return out.clone() if out.data_ptr() == t.data_ptr() else out


def load_model(
    model_dir: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaModel:
    """Load an HF safetensors checkpoint of a supported family; raises ModelLoadError."""
    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    shape = servable_shape(cfg)
    raw = _load_tensors(model_dir)
    D = shape.hidden_size

    get = _Tensors(raw, model_dir, device, dtype)

    if shape.family == "gemma3_text":
        from appliance.engines.models import gemma3
        model = gemma3.build(shape, cfg, get)
        raw.clear()
        return model
    embed = get("model.embed_tokens.weight", (shape.vocab_size, D))
    if shape.tie_word_embeddings:
        lm_head = Linear(embed)
    else:
        lm_head = Linear(get("lm_head.weight", (shape.vocab_size, D)))
    load_layer = LAYER_LOADERS[shape.architecture]
    layers = [load_layer(get, shape, i) for i in range(shape.num_layers)]
    norm = get("model.norm.weight", (D,))
    raw.clear()  # tensors the model does not use (e.g. rotary caches in old checkpoints)
    return LlamaModel(shape, embed, layers, norm, lm_head)
