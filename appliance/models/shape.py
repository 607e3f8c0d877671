"""A decoder's shape as its Hugging Face ``config.json`` states it: the one reader.

Both the torch engine (which builds the model from it) and the simulator's `ModelSpec`
(which counts parameters and KV bytes from it) read config.json here, so a checkpoint
is never understood two ways. The reader accepts every Llama-shaped family either caller
knows (q/k/v/o attention, gate/up/down MLP or a mixture of such experts, RMSNorms):
llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, gpt_oss and gemma3_text (Gemma 3's own
numerics, read from the same config.json, are `engines.models.gemma3`'s). What the torch
engine can actually run is narrower; it says so when loading
(`appliance.engines.loader.servable_shape`).

Defaults where config.json is silent are transformers' own: `head_dim` = hidden/heads
(Qwen3Config: 128, Gemma3TextConfig: 256), `num_key_value_heads` = heads,
`max_position_embeddings` 2048 (Gemma 3: 131,072), `rms_norm_eps` 1e-6, `rope_theta`
10000 (Gemma 3's global layers: 1e6), untied embeddings (Gemma 3: tied), Mistral's
4,096-token sliding window, Gemma 3's (4,096, five local layers to one global) and
gpt-oss's (128, alternating), and Qwen3-MoE's `norm_topk_prob` false,
`decoder_sparse_step` 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHITECTURES", "LlamaShape", "ModelLoadError", "RopeScaling", "YarnScaling",
           "architecture_of"]

# model_type -> the transformers class config.json names in "architectures".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_FAMILY_BY_ARCH = {arch: family for family, arch in ARCHITECTURES.items()}


class ModelLoadError(ValueError):
    """A checkpoint cannot be served: unsupported config, missing/corrupt file or tensor."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1 ("llama3") frequency scaling of RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN ("yarn") RoPE scaling, as gpt-oss uses it (`transformers`'
    ``_compute_yarn_parameters``): frequencies blended between interpolated and
    extrapolated by a ramp over the dimensions, cos and sin scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: derived from factor (and mscale)
    mscale: float | None = None
    mscale_all_dim: float | None = None


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
    rope_scaling: RopeScaling | None  # set for rope_type "llama3"
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool  # bias on the output projection (Llama/Qwen3 attention_bias only)
    sliding_window: int | None = None  # tokens a query sees (itself included), if limited
    # Per layer: its window (as `sliding_window`) or None for full attention; () = none slides.
    layer_windows: tuple[int | None, ...] = ()
    family: str = "llama"  # config.json's model_type (one of ARCHITECTURES)
    hidden_act: str = "silu"
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Qwen3-MoE)
    num_experts: int = 0  # routed MLP experts (Mixtral, Qwen3-MoE); 0 = dense
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's (Qwen3-MoE: moe_intermediate_size)
    norm_topk_prob: bool = False  # the kept top-k router weights renormalized to sum 1
    # Layers of an MoE model whose MLP is dense (`intermediate_size`): Qwen3-MoE's
    # mlp_only_layers and those decoder_sparse_step skips. () for dense models.
    dense_mlp_layers: tuple[int, ...] = ()
    yarn: YarnScaling | None = None  # set for rope_type "yarn"
    # gpt-oss: a learned per-head logit each query's softmax also sums over (a "sink"
    # that takes attention weight without a value), the router's bias, and the experts'
    # clamped SwiGLU (gate clamped above, up within +-limit, gate * sigmoid(alpha * gate)).
    attention_sinks: bool = False
    router_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    rope_type: str = "default"  # "default", "llama3", or one the engine refuses (yarn, ...)
    partial_rotary_factor: float = 1.0

    @property
    def max_context(self) -> int:
        """The longest context this engine computes exactly as `transformers` does (sliding
        windows are attended as windows, so they do not shorten it)."""
        return self.max_position_embeddings

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_mlp_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (a query sees itself and the W-1 tokens before
        it), or None when it attends over the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def all_layers_slide(self) -> bool:
        """Every layer is windowed: KV older than the widest window is never read again."""
        return bool(self.layer_windows) and all(w is not None for w in self.layer_windows)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaShape:
        """Parse an HF ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        model_type = cfg.get("model_type") or ""
        arch = architecture_of(cfg)
        # The family (the layer layout) by model_type first, as the simulator always
        # sized it: a class this reader does not know is still sized by its model_type,
        # and refused by the engine that cannot build it (`loader.servable_shape`).
        family = model_type if model_type in ARCHITECTURES else _FAMILY_BY_ARCH.get(arch)
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {arch or model_type!r} (model_type "
                f"{model_type or None!r}); supported: {', '.join(ARCHITECTURES.values())}"
            )

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
        gemma = family == "gemma3_text"
        head_dim = int(cfg.get("head_dim") or (128 if family == "qwen3" else 256 if gemma
                                                else hidden // heads))
        rope_theta, rope_type, rope_scaling, partial = _parse_rope(
            cfg, 1_000_000.0 if gemma else 10000.0)
        yarn = None
        if rope_type == "yarn":
            try:
                yarn = parse_yarn(cfg)
            except ModelLoadError:  # sized all the same; the engine refuses it
                pass
        gpt_oss = family == "gpt_oss"

        if family == "qwen2":
            qkv_bias, o_bias = True, False
        elif family in ("llama", "qwen3", "qwen3_moe", "gemma3_text"):
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        elif family == "gpt_oss":           # GptOssConfig: attention_bias defaults to true
            qkv_bias = o_bias = bool(cfg.get("attention_bias", True))
        else:  # Mistral and Mixtral attention has no biases
            qkv_bias = o_bias = False
        layers = int(need("num_hidden_layers"))
        experts = top_k = moe_inter = 0
        norm_topk, dense_layers = False, ()
        if family == "mixtral":
            experts, top_k = int(need("num_local_experts")), int(need("num_experts_per_tok"))
            norm_topk = True  # Mixtral always renormalizes its top-k
        elif family == "qwen3_moe":
            # Qwen's checkpoints write num_experts; transformers 5 saves num_local_experts.
            key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
            experts, top_k = int(need(key)), int(need("num_experts_per_tok"))
            moe_inter = int(need("moe_intermediate_size"))
            norm_topk = bool(cfg.get("norm_topk_prob", False))
            step = int(cfg.get("decoder_sparse_step") or 1)
            only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
            dense_layers = tuple(i for i in range(layers)
                                 if experts == 0 or i in only or (i + 1) % step)
        elif family == "gpt_oss":
            experts, top_k = int(need("num_local_experts")), int(need("num_experts_per_tok"))
        if experts and not 0 < top_k <= experts:
            raise ModelLoadError(f"num_experts_per_tok {top_k} must be in 1..{experts}")
        windows = _layer_windows(arch, cfg, layers)
        slid = [w for w in windows if w is not None]
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings")
                                        or (131072 if gemma else 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_type=rope_type,
            partial_rotary_factor=partial,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=max(slid) if slid else None,
            layer_windows=windows if slid else (),
            family=family,
            hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma
            else str(cfg.get("hidden_act", "silu")),
            mlp_bias=gpt_oss or bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            num_experts=experts,
            experts_per_token=top_k,
            moe_intermediate_size=moe_inter or (int(cfg["intermediate_size"]) if experts else 0),
            norm_topk_prob=norm_topk,
            dense_mlp_layers=dense_layers,
            yarn=yarn,
            attention_sinks=gpt_oss,
            router_bias=gpt_oss,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if gpt_oss else 0.0,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)) if gpt_oss else 0.0,
        )


def architecture_of(cfg: dict[str, Any]) -> str:
    """The transformers class a config.json names (from its model_type if it names none)."""
    archs = cfg.get("architectures") or []
    return archs[0] if archs else ARCHITECTURES.get(cfg.get("model_type") or "", "")


def _layer_windows(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window, as `transformers` applies it: a token sees itself and
    the W-1 before it. Mistral slides on every layer (MistralConfig defaults the window to
    4,096 when config.json has no key; v0.2 and later write null), as Mixtral does when it
    names a window. Qwen2 and Qwen3 slide only with
    ``use_sliding_window``, on the layers ``layer_types`` names, else on those from
    ``max_window_layers`` on; Qwen3-MoE then on every layer. Gemma 3 slides on the layers
    ``layer_types`` names, else on all but every ``sliding_window_pattern``-th (default 6:
    five local, one global); gpt-oss on those ``layer_types`` names, else on every other
    one from the first (a 128-token window by default). Llama never slides."""
    full: tuple[int | None, ...] = (None,) * num_layers
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = cfg.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
        return (int(window),) * num_layers if window else full
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
            return full
        first = 0 if arch == "Qwen3MoeForCausalLM" else int(cfg.get("max_window_layers", 28))
        slides = [i >= first for i in range(num_layers)]
    elif arch == "Gemma3ForCausalLM":
        if not cfg.get("sliding_window", 4096):
            return full
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        slides = [bool((i + 1) % pattern) for i in range(num_layers)]
    elif arch == "GptOssForCausalLM":
        if not cfg.get("sliding_window", 128):
            return full
        slides = [i % 2 == 0 for i in range(num_layers)]
    else:
        return full
    window = int(cfg.get("sliding_window") or (128 if arch == "GptOssForCausalLM" else 4096))
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelLoadError(f"layer_types lists {len(types)} layers, the model has "
                                 f"{num_layers}")
        slides = [t == "sliding_attention" for t in types]
    return tuple(window if s else None for s in slides)


def _parse_rope(cfg: dict[str, Any], default_theta: float = 10000.0
                ) -> tuple[float, str, RopeScaling | None, float]:
    """(theta, rope type, llama3 scaling, partial rotary factor). Other scaling types are named, not parsed: the
    simulator sizes such a model all the same, the torch engine refuses it."""
    # transformers 5 writes "rope_parameters" (with rope_theta inside); 4.x writes
    # "rope_theta" + "rope_scaling" (with "type" or "rope_type").
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers'
    if not isinstance(params, dict):
        raise ModelLoadError(f"rope parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or default_theta)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind != "llama3":
        return theta, kind, None, partial
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"llama3 rope scaling lacks {e.args[0]!r}") from None
    return theta, kind, scaling, partial


def parse_yarn(cfg: dict[str, Any]) -> YarnScaling:
    """The YaRN parameters of a config.json whose rope type is \"yarn\"."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}

    def opt(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    try:
        return YarnScaling(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=opt("attention_factor"), mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"))
    except KeyError as e:
        raise ModelLoadError(f"yarn rope scaling lacks {e.args[0]!r}") from None
