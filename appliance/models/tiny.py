"""A tiny Llama checkpoint made offline, so the CPU engine has a real model to serve.

`init_tiny` writes a standard Hugging Face Llama directory (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
special_tokens_map.json). The weights are random but seeded; the tokenizer is a real
byte-level BPE trained on the Python standard library's sources, so any text
round-trips exactly through encode/decode.

Token conventions follow Llama 3:
- plain `tokenizer(text)` prepends `<|begin_of_text|>` (BOS);
- the chat template emits `<|begin_of_text|>` itself, so a rendered chat prompt must
  be encoded with `add_special_tokens=False` (otherwise BOS appears twice);
- `<|eot_id|>` ends an assistant turn and is the tokenizer's eos_token;
  generation stops on either `<|eot_id|>` or `<|end_of_text|>`.

Invariant: for a given (seed, preset) model.safetensors is byte-identical across runs.
The tokenizer depends on the local Python's stdlib sources, so it is identical on one
machine but may differ between Python builds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-llama"

BOS = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
# Trained first, so their ids are their positions here: BOS=0, EOS_TEXT=1, ..., EOT=4.
SPECIAL_TOKENS = (BOS, EOS_TEXT, START_HEADER, END_HEADER, EOT)
SPECIAL_IDS = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# Shapes. "tiny" ~5.0M parameters, "20m" ~21.6M (both untied embeddings, GQA).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=688),
    "20m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, intermediate_size=1376),
    # The shape issue 26 measures against vLLM's CPU build (81.8M parameters).
    "82m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4, intermediate_size=2048),
}
VOCAB_SIZE = 4096
MAX_POSITIONS = 4096
INIT_STD = 0.02  # HF LlamaConfig.initializer_range
# Embeddings are drawn with a larger std so the current token dominates the residual
# stream; greedy decoding then walks through many tokens instead of repeating one.
EMBED_STD = 1.0

TOKENIZER_CORPUS_BYTES = 4_000_000

# Llama-3 style. String content or OpenAI-style lists of {"type": "text", "text": ...}.
# Tools (HF's `tools=`) are rendered Hermes-style, as Qwen's templates do: their
# signatures in a system turn inside <tools></tools>, an assistant's calls as
# <tool_call>{"name", "arguments"}</tool_call>, a tool's result as <tool_response>.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- macro text(content) %}"
    "{%- if content is none %}"
    "{%- elif content is string %}{{- content }}"
    "{%- else %}{{- content | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- set skip_first = tools and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if skip_first %}{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + repr(TOOLS_FORMAT) + " + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and skip_first) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- else %}{{- text(message['content']) }}"
    "{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' }}{{- call['function']['name'] | tojson }}"
    "{{- ', \"arguments\": ' }}"
    "{%- if args is string %}{{- args }}{%- else %}{{- args | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

Progress = Callable[[str], None]


def init_tiny(
    out_dir: Path,
    seed: int = 0,
    preset: str = "tiny",
    progress: Progress | None = None,
) -> Path:
    """Write a seeded random Llama checkpoint with a trained BPE tokenizer into out_dir."""
    config = tiny_config(preset)  # validates preset before any work
    say = progress or (lambda _line: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    say("training tokenizer")
    tokenizer = _train_tokenizer(VOCAB_SIZE)
    trained_ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    if trained_ids != SPECIAL_IDS:
        raise RuntimeError(f"special token ids {trained_ids} differ from {SPECIAL_IDS}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(out_dir / "special_tokens_map.json", _special_tokens_map())

    say("writing config")
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": SPECIAL_IDS[BOS],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": SPECIAL_IDS[EOS_TEXT],
        "do_sample": False,
    })

    say("writing weights")
    _write_weights(out_dir / "model.safetensors", config, seed)
    say("done")
    return out_dir


def ensure_default_model(state_dir: Path, progress: Progress | None = None) -> Path:
    """Return state_dir/models/tiny-llama, creating it once.

    It is built in a temporary directory beside the target and renamed into place, so
    a reader never sees a half-written checkpoint.
    """
    models_dir = Path(state_dir) / "models"
    target = models_dir / DEFAULT_MODEL_NAME
    if is_complete(target):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    if target.exists():
        # Not made by us (our rename is atomic): somebody removed files. Rebuild.
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=models_dir))
    try:
        init_tiny(tmp, progress=progress)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; use its copy if it is whole.
            if not is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_complete(model_dir: Path) -> bool:
    return all((Path(model_dir) / name).is_file() for name in CHECKPOINT_FILES)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- tokenizer ---------------------------------------------------------------------

# Where a frozen binary (packaging/applianced.spec) keeps its copy of the corpus files:
# it has no stdlib sources of its own, and the same files must give the same tokenizer.
FROZEN_CORPUS_DIR = "stdlib_corpus"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def corpus_root() -> Path:
    if getattr(sys, "frozen", False):
        return Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)) / FROZEN_CORPUS_DIR
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_paths(root: Path | None = None, limit_bytes: int = TOKENIZER_CORPUS_BYTES) -> list[Path]:
    """The stdlib's .py files in sorted path order, up to about limit_bytes (the file that
    crosses the limit included). Files that do not decode as UTF-8 are skipped."""
    root = root or corpus_root()
    paths = sorted(
        (p for p in root.rglob("*.py")
         if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    chosen, total = [], 0
    for path in paths:
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        chosen.append(path)
        total += len(data)
        if total >= limit_bytes:
            break
    if not chosen:
        raise RuntimeError(f"no Python sources found under {root} to train a tokenizer")
    return chosen


def _corpus(limit_bytes: int = TOKENIZER_CORPUS_BYTES) -> Iterator[str]:
    for path in corpus_paths(limit_bytes=limit_bytes):
        yield path.read_bytes().decode("utf-8")


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@functools.lru_cache(maxsize=2)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per process; a later init_tiny (tests, several presets) reuses it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer.to_str()


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict:
    return {"bos_token": BOS, "eos_token": EOT}


# --- config and weights ------------------------------------------------------------

def tiny_config(preset: str = "tiny") -> dict:
    """The config.json contents init_tiny writes for a preset (pure data, no torch)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        **shape,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers 4.x reads rope_theta/torch_dtype, 5.x the others.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
        "bos_token_id": SPECIAL_IDS[BOS],
        "eos_token_id": [SPECIAL_IDS[EOT], SPECIAL_IDS[EOS_TEXT]],
    }


def _weight_names_and_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes exactly as transformers' LlamaForCausalLM has them
    (a test checks this against transformers; the daemon itself does not need it)."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def _write_weights(path: Path, config: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save

    # A private generator: same numbers for the same seed, global RNG left alone.
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _weight_names_and_shapes(config):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
            continue
        std = EMBED_STD if name == "model.embed_tokens.weight" else INIT_STD
        tensors[name] = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    # `save` to bytes rather than `save_file`, so the file gets the umask's mode.
    path.write_bytes(save(tensors, metadata={"format": "pt"}))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
