"""Tokenization in the daemon: prompts in, text out, with the model's own chat template.

Uses `tokenizers` (Rust) and Jinja directly rather than `transformers`, which would
add seconds of start-up and hundreds of MB to the daemon for the same result.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    pass


class PromptTooLong(ValueError):
    """The prompt has more tokens than allowed; `tokens` says how many."""

    def __init__(self, tokens: int):
        super().__init__(f"{tokens} tokens")
        self.tokens = tokens


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def chat_templates(model_dir: Path, cfg: dict) -> dict[str, str]:
    """The checkpoint's chat templates by name, read as transformers reads them:
    `tokenizer_config.json`'s `chat_template` (one string, or a list of named ones), then
    `chat_template.jinja` beside it (how transformers >= 4.43 saves a template; it wins
    over the JSON key) and `additional_chat_templates/NAME.jinja`."""
    found: dict[str, str] = {}
    template = cfg.get("chat_template")
    if isinstance(template, list):
        found.update({t["name"]: t["template"] for t in template
                      if isinstance(t, dict) and "name" in t and "template" in t})
    elif isinstance(template, str):
        found["default"] = template
    jinja = model_dir / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        found["default"] = jinja.read_text(encoding="utf-8")
    extra = model_dir / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            found[f.stem] = f.read_text(encoding="utf-8")
    return found


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _model_type(model_dir: Path) -> str:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        return ""


class ServedTokenizer:
    def __init__(self, model_dir: Path, tool_parser: str = "", reasoning_parser: str = ""):
        self.model_dir = Path(model_dir)
        self.tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        cfg_path = self.model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token")) or ""
        self.eos_token = _token_text(cfg.get("eos_token")) or ""
        templates = chat_templates(self.model_dir, cfg)
        template = templates.get("default")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        # What transformers' template environment adds, so a template renders as there:
        # a `tojson` that keeps key order and does not escape HTML, the date, errors.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = self._raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template) if template else None
        # A checkpoint may keep a separate template for requests with tools, as
        # transformers' `get_chat_template` picks it.
        tool_template = templates.get("tool_use")
        self._tool_template = env.from_string(tool_template) if tool_template else None
        # The tool-call format the template teaches (None: it renders no tools), unless
        # [engine] tool_parser names one ("none": no tool calling).
        from appliance.daemon.tool_calls import detect_parser
        detected = detect_parser(tool_template or template)
        if detected is None and template and _model_type(self.model_dir) == "gpt_oss":
            detected = "harmony"        # gpt-oss is trained on harmony whatever renders it
        self.tool_parser = (detected if not tool_parser else
                            None if tool_parser == "none" else tool_parser)
        # Likewise the reasoning format (`<think>` blocks), unless [engine]
        # reasoning_parser names one ("none": the thinking stays in `content`).
        from appliance.daemon.reasoning import detect_reasoning
        thinks = detect_reasoning(template, self.tool_parser)
        self.reasoning_parser = (thinks if not reasoning_parser else
                                 None if reasoning_parser == "none" else reasoning_parser)
        self.vocab_size = self.tok.get_vocab_size()
        # The most characters one token can stand for (special tokens included): a text of
        # C characters has at least C / this many tokens, whatever it is.
        self.max_token_chars = max((len(k) for k in self.tok.get_vocab(with_added_tokens=True)),
                                   default=1)

    @staticmethod
    def _raise(message: str):
        raise ChatTemplateError(message)

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        return self._ids(self.tok.encode(text, add_special_tokens=True), limit)

    @staticmethod
    def _ids(encoding, limit: int | None) -> list[int]:
        """The ids, unless there are more than `limit`: then only their count is read
        (making a Python list of a million ids holds the GIL for milliseconds)."""
        if limit is not None and len(encoding) > limit:
            raise PromptTooLong(len(encoding))
        return encoding.ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=True)]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    kwargs: dict | None = None) -> str:
        """`kwargs`: the request's `chat_template_kwargs` (e.g. Qwen3's
        `enable_thinking`), as `apply_chat_template` passes its extra arguments; they
        cannot replace what the daemon itself passes (`openai_protocol` refuses those)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        template = self._tool_template if tools and self._tool_template else self._template
        return template.render(**(kwargs or {}), messages=messages, add_generation_prompt=True,
                               bos_token=self.bos_token, eos_token=self.eos_token,
                               tools=tools or None)

    def encode_chat(self, messages: list[dict], limit: int | None = None,
                    tools: list[dict] | None = None, kwargs: dict | None = None) -> list[int]:
        # The template writes BOS itself, so no special tokens are added here.
        return self._ids(self.tok.encode(self.render_chat(messages, tools, kwargs),
                                         add_special_tokens=False), limit)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stream(self, skip_special_tokens: bool = True) -> "Detokenizer":
        return Detokenizer(self.tok, skip_special_tokens)


class Detokenizer:
    """Incremental detokenization: text comes out only when its bytes are complete;
    `flush` at the end gives whatever a full decode has beyond that (e.g. a trailing
    partial character), so streamed text always equals the full decode."""

    __slots__ = ("_tok", "_stream", "_ids", "_emitted", "_skip")

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tok
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        out = []
        for i in ids:
            piece = self._stream.step(self._tok, i)
            if piece:
                out.append(piece)
        text = "".join(out)
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        rest = full[self._emitted:]
        self._emitted = len(full)
        return rest


class StopMatcher:
    """Finds stop strings across chunk boundaries, holding back text that might be
    the start of one so a streamed client never sees part of a stop string."""

    __slots__ = ("stops", "_pending", "_hold", "matched")

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.matched = ""           # the stop string that was hit
        self._pending = ""
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self._pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        first = min(hits, key=lambda h: (h[0], len(h[1]))) if hits else (-1, "")
        cut = first[0]
        if cut >= 0:
            self.matched = first[1]
            self._pending = ""
            return buf[:cut], True
        keep = 0
        for k in range(min(self._hold, len(buf)), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                keep = k
                break
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
