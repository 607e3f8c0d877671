"""The generated tiny Llama checkpoint and the model-shape catalogue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.models.specs import (
    MODEL_SPECS,
    ModelSpec,
    lookup_model_spec,
    spec_from_hf_config,
)
from appliance.models.tiny import (
    BOS,
    CHECKPOINT_FILES,
    DEFAULT_MODEL_NAME,
    ensure_default_model,
    file_sha256,
    init_tiny,
    tiny_config,
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # init_tiny caches the trained tokenizer per process, so later calls in this run
    # (determinism, ensure_default_model) only redo the cheap weight step.
    lines: list[str] = []
    out = init_tiny(tmp_path_factory.mktemp("tiny"), seed=0, preset="tiny", progress=lines.append)
    assert "training tokenizer" in lines and "writing weights" in lines
    return out


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def model(tiny_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir)


# --- checkpoint ----------------------------------------------------------------------

def test_checkpoint_files_and_config(tiny_dir: Path) -> None:
    for name in CHECKPOINT_FILES:
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["do_sample"] is False
    assert gen["eos_token_id"] == config["eos_token_id"]


def test_model_loads_with_expected_size(model) -> None:
    n = sum(p.numel() for p in model.parameters())
    assert 3_000_000 <= n <= 6_000_000
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.config.tie_word_embeddings


def test_state_dict_names_are_llamas(tiny_dir: Path, model) -> None:
    from safetensors import safe_open

    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        saved = set(f.keys())
    assert saved == set(model.state_dict())
    assert "lm_head.weight" in saved and "model.layers.3.self_attn.k_proj.weight" in saved


def test_greedy_generation_does_not_repeat_one_token(tokenizer, model) -> None:
    import torch

    ids = tokenizer("def main():", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 12 or new[-1] in model.generation_config.eos_token_id
    assert len(set(new)) > 3


@pytest.mark.parametrize("seed_b, same", [(0, True), (1, False)])
def test_weights_deterministic_by_seed(tiny_dir: Path, tmp_path: Path, seed_b: int, same: bool) -> None:
    other = init_tiny(tmp_path / "again", seed=seed_b, preset="tiny")
    a = file_sha256(tiny_dir / "model.safetensors")
    b = file_sha256(other / "model.safetensors")
    assert (a == b) is same
    # The tokenizer does not depend on the seed.
    assert file_sha256(tiny_dir / "tokenizer.json") == file_sha256(other / "tokenizer.json")


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="20m"):
        init_tiny(tmp_path, preset="huge")
    assert not any(tmp_path.iterdir())


# --- tokenizer -----------------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "def f(x):\n\treturn x ** 2\r\n",
    "naïve café, Straße, Ελληνικά, русский, עברית, العربية",
    "日本語のテキストと中文文本",
    "emoji 🤖🚀👩‍👩‍👧 and flags 🇳🇱",
    "combining e\u0301 and zero\u200bwidth, NUL \x00, bell \x07",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_exactly(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    bare = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(bare) == text


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert tokenizer.bos_token == BOS
    assert tokenizer.eos_token == "<|eot_id|>"
    assert len(tokenizer) <= tiny_config("tiny")["vocab_size"]
    for tok in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"):
        assert len(tokenizer(tok, add_special_tokens=False)["input_ids"]) == 1


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi ✋"},
]


def test_chat_template_llama3_layout(tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith(BOS)
    assert "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>" in prompt
    assert "<|start_header_id|>user<|end_header_id|>\n\nSay hi ✋<|eot_id|>" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    without = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert without.endswith("<|eot_id|>")


def test_chat_prompt_has_bos_once(tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == prompt


# --- ensure_default_model ------------------------------------------------------------

def _mtimes(root: Path) -> dict[str, int]:
    stamps = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    stamps["."] = root.stat().st_mtime_ns
    return stamps


def test_ensure_default_model_is_idempotent(tmp_path: Path) -> None:
    lines: list[str] = []
    first = ensure_default_model(tmp_path, progress=lines.append)
    assert first == tmp_path / "models" / DEFAULT_MODEL_NAME
    assert all((first / name).is_file() for name in CHECKPOINT_FILES)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [DEFAULT_MODEL_NAME]  # no temp left
    before = _mtimes(first)
    lines.clear()

    second = ensure_default_model(tmp_path, progress=lines.append)
    assert second == first
    assert lines == []
    assert _mtimes(second) == before


def test_ensure_default_model_rebuilds_incomplete(tmp_path: Path) -> None:
    target = ensure_default_model(tmp_path)
    (target / "model.safetensors").unlink()
    again = ensure_default_model(tmp_path)
    assert (again / "model.safetensors").is_file()


# --- specs -----------------------------------------------------------------------------

def test_kv_bytes_per_token_llama_8b() -> None:
    spec = lookup_model_spec("llama-3.1-8b")
    assert spec.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert spec.params == 8_030_261_248  # published parameter count
    assert spec.weight_total_bytes() == spec.params * 2


def test_catalogue_entries() -> None:
    assert lookup_model_spec("LLAMA-3.1-70B").params == 70_553_706_496
    fp8 = lookup_model_spec("llama-3.1-70b-fp8")
    assert fp8.weight_bytes == 1 and fp8.kv_bytes == 1
    oss = lookup_model_spec("gpt-oss-120b")
    assert (oss.layers, oss.hidden, oss.heads, oss.kv_heads, oss.head_dim) == (36, 2880, 64, 8, 64)
    assert oss.active_params < oss.params / 20
    assert 55 * 2**30 < oss.weight_total_bytes() < 65 * 2**30
    for name, spec in MODEL_SPECS.items():
        assert spec.name == name and isinstance(spec, ModelSpec)


def test_lookup_unknown_lists_known_names() -> None:
    with pytest.raises(ValueError) as err:
        lookup_model_spec("nope-7b")
    message = str(err.value)
    assert "\n" not in message and "llama-3.1-8b" in message and "gpt-oss-120b" in message


def test_spec_from_config_matches_transformers(tiny_dir: Path, model) -> None:
    spec = spec_from_hf_config(tiny_dir)
    assert spec.name == tiny_dir.name
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.active_params == spec.params
    assert spec.weight_bytes == 4 and spec.kv_bytes == 4
    assert spec.head_dim == model.config.head_dim
    assert spec == spec_from_hf_config(tiny_dir / "config.json", name=tiny_dir.name)
    assert lookup_model_spec(DEFAULT_MODEL_NAME).params == spec.params


def test_spec_from_config_defaults_and_families() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # No head_dim, no num_key_value_heads: head_dim = hidden/heads, MHA.
    base = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": "bfloat16"}
    spec = spec_from_hf_config(base | {"model_type": "llama"}, name="x")
    assert (spec.head_dim, spec.kv_heads, spec.weight_bytes) == (16, 4, 2)
    # Counts match transformers for each supported family (built on the meta device).
    for family in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen3_moe_mixed"):
        cfg = base | {"model_type": family, "num_key_value_heads": 2}
        if family == "mixtral":
            cfg |= {"num_local_experts": 4, "num_experts_per_tok": 2}
        if family.startswith("qwen3_moe"):   # mixed: one dense layer of two
            cfg |= {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 48,
                    "mlp_only_layers": [1] if family.endswith("mixed") else []}
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        real = sum(p.numel() for p in hf.parameters())
        assert spec_from_hf_config(cfg).params == real, family
    with pytest.raises(ValueError, match="model_type"):
        spec_from_hf_config(base | {"model_type": "gpt2"})


def test_spec_20m_preset_size() -> None:
    spec = spec_from_hf_config(tiny_config("20m"))
    assert 15e6 < spec.params < 25e6


# --- one reader of config.json for the engine and the simulator ----------------------

_BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("cfg", [
    _BASE | {"model_type": "llama"},                                    # MHA, defaults
    _BASE | {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2,
             "head_dim": 32, "max_position_embeddings": 8192, "attention_bias": True},
    _BASE | {"model_type": "mistral", "num_key_value_heads": 1, "sliding_window": None,
             "max_position_embeddings": 32768, "tie_word_embeddings": True},
    _BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "num_key_value_heads": 2, "rope_theta": 1e6},
    tiny_config("20m"),
], ids=["llama-defaults", "llama-gqa-bias", "mistral-tied", "qwen2", "tiny-20m"])
def test_engine_and_simulator_read_a_config_alike(cfg) -> None:
    """The torch engine's shape (what it would build) and the simulator's ModelSpec (what it
    sizes) come from one reader, so they agree on every dimension, the context, and the
    parameter count the engine's weights would have."""
    from appliance.engines.loader import servable_shape

    shape, spec = servable_shape(cfg), spec_from_hf_config(cfg)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab) == (
        shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
        shape.head_dim, shape.vocab_size)
    assert spec.max_context == shape.max_position_embeddings
    D, Iz, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    per_layer = (D * (shape.q_size + 2 * shape.kv_size) + shape.q_size * D + 3 * D * Iz + 2 * D
                 + (shape.q_size + 2 * shape.kv_size if shape.qkv_bias else 0)
                 + (D if shape.o_bias else 0))
    weights = V * D * (1 if shape.tie_word_embeddings else 2) + D + shape.num_layers * per_layer
    assert spec.params == weights


def test_reader_sizes_what_the_engine_refuses() -> None:
    """A family or option the torch engine cannot run is still sized for the simulator,
    and the engine refuses it with a one-line reason instead of building something else."""
    from appliance.engines.loader import servable_shape
    from appliance.models.shape import ModelLoadError

    for cfg, why in [
        (_BASE | {"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (_BASE | {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
         "rope scaling type 'dynamic'"),
    ]:
        assert spec_from_hf_config(cfg).params > 0
        with pytest.raises(ModelLoadError, match=why):
            servable_shape(cfg)
    assert spec_from_hf_config(_BASE | {"model_type": "qwen3"}).head_dim == 128
    # An unknown class with a known model_type is sized by its model_type (the daemon
    # then lets the worker say what it cannot load), and refused by the engine.
    mamba = _BASE | {"model_type": "llama", "architectures": ["MambaForCausalLM"]}
    assert spec_from_hf_config(mamba).params == spec_from_hf_config(
        _BASE | {"model_type": "llama"}).params
    with pytest.raises(ModelLoadError, match="unsupported architecture 'MambaForCausalLM'"):
        servable_shape(mamba)


def test_loaded_model_has_the_simulators_parameter_count(tiny_dir: Path) -> None:
    from appliance.engines.loader import load_model

    model = load_model(tiny_dir)
    counted = model.embed.numel() + model.norm.numel() + sum(
        layer.attn_norm.numel() + layer.mlp_norm.numel() + layer.qkv.dense().numel()
        + layer.o.dense().numel() + layer.mlp.gate_up.dense().numel() + layer.mlp.down.dense().numel()
        for layer in model.layers)
    if not model.shape.tie_word_embeddings:
        counted += model.lm_head.dense().numel()
    assert counted == spec_from_hf_config(tiny_dir).params
