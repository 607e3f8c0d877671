"""Constrained decoding with xgrammar: a grammar per request, a token bitmask per step.

xgrammar is what vLLM, SGLang and TensorRT-LLM use; it compiles a JSON schema (or a
regex, a choice, an EBNF grammar) against the served tokenizer's vocabulary once, and a
per-sequence matcher then fills, at each step, the bitmask of the tokens that keep the
output inside the grammar. The bitmask goes onto the logits before sampling (the torch
engine) or restricts the random pick (the simulator), so the output is valid by
construction whatever the model's weights.

A sequence's matcher is rebuilt from its request's `GuidedDecoding` and the tokens it has
generated so far (`Guide.sync`): a decode worker that took a request over from a prefill
worker, or a sequence recomputed after preemption, continues from where the grammar was.

xgrammar (and its import of transformers, ~2 s) is loaded on the first guided request,
never at start-up: an appliance that serves no structured output pays nothing. The daemon
itself never loads it: guided bodies are checked in its preparation children.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from appliance.engines.messages import GuidedDecoding

__all__ = ["GrammarBook", "Guide", "GrammarError", "check_guided", "MAX_SCHEMA_BYTES",
           "MAX_SCHEMA_DEPTH"]

MAX_SCHEMA_BYTES = 64 * 1024    # a schema (or grammar) bigger than this is refused
MAX_SCHEMA_DEPTH = 32           # nesting of the schema document (objects and lists)
COMPILED_CACHE = 64             # compiled grammars kept per worker (LRU)
# JSON-schema keywords xgrammar does not enforce: refused rather than silently ignored.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems", "contains", "minContains", "maxContains",
    "$dynamicRef", "$recursiveRef"})
KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "tagged_json", "harmony_call")
# Harmony's (gpt-oss's) special tokens a forced call's header is written with. Special
# tokens are invisible to every other grammar; a "harmony_call" grammar is compiled
# against a view of the vocabulary where these three keep their text, so the header can
# be written with them. The ends (`<|call|>`, `<|return|>`) stay hidden: the model ends
# the call with a stop token once the arguments are complete, as it ends any grammar.
HARMONY_HEADER_TOKENS = ("<|channel|>", "<|constrain|>", "<|message|>")


class GrammarError(ValueError):
    """A grammar that cannot be used: says why, in words for an API error."""


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured outputs need the xgrammar package, which this "
                           "installation lacks (pip install 'applianced[structured]')") from None
    return xgrammar


def _depth(node: Any, limit: int, at: int = 0) -> None:
    if at > limit:
        raise GrammarError(f"the schema nests deeper than {limit} levels")
    if isinstance(node, dict):
        for key, value in node.items():
            if key in UNSUPPORTED_KEYWORDS:
                raise GrammarError(f"JSON-schema keyword '{key}' is not supported")
            # Under "properties" (and the like) keys are names, not keywords.
            if key in ("properties", "$defs", "definitions", "patternProperties") \
                    and isinstance(value, dict):
                for sub in value.values():
                    _depth(sub, limit, at + 1)
            else:
                _depth(value, limit, at + 1)
    elif isinstance(node, list):
        for item in node:
            _depth(item, limit, at + 1)


def _grammar(spec: GuidedDecoding):
    """The uncompiled xgrammar Grammar of a spec (raises GrammarError)."""
    xgr = _xgr()
    kind, source = spec.kind, spec.source
    try:
        if kind == "json_schema":
            return _json_grammar(xgr, source)
        if kind == "json_object":
            return _json_grammar(xgr, '{"type": "object"}')
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        if kind == "choice":
            choices = json.loads(source)
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in choices))
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(source)
        if kind == "tagged_json":
            parts = json.loads(source)
            return xgr.Grammar.concat(
                _literal(xgr, parts["begin"]),
                _json_grammar(xgr, json.dumps(parts["schema"])),
                _literal(xgr, parts["end"]))
        if kind == "harmony_call":
            calls = json.loads(source)["calls"]
            if not calls:
                raise GrammarError("a harmony call needs at least one function")
            options = [xgr.Grammar.concat(_literal(xgr, harmony_header(name)),
                                          _json_grammar(xgr, json.dumps(schema)))
                       for name, schema in calls]
            return options[0] if len(options) == 1 else xgr.Grammar.union(*options)
    except GrammarError:
        raise
    except Exception as exc:    # xgrammar raises RuntimeError/ValueError with its reason
        raise GrammarError(_reason(exc)) from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


# xgrammar 0.2.8 writes a length-bounded string's characters (maxLength) as a class that
# excludes only the quote, the backslash, CR and LF, which lets raw control characters
# into a JSON string (invalid JSON that strict parsers such as pydantic refuse); its
# unbounded strings exclude all of U+0000-U+001F, as the bounded ones now do.
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_STRICT_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _json_grammar(xgr, schema: str):
    """JSON for a schema, compact (no free whitespace: a model cannot wander into blank
    tokens), with the bounded-string fix above."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    if _LOOSE_CHARS in text:
        grammar = xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _STRICT_CHARS))
    return grammar


def harmony_header(name: str) -> str:
    """What gpt-oss writes after `<|start|>assistant` to call function NAME, up to its
    arguments (OpenAI's harmony format)."""
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text) if text else 'root ::= ""')


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text


def check_guided(spec: GuidedDecoding) -> None:
    """Refuse (GrammarError) a grammar too big, too deep, with a keyword xgrammar would
    ignore, or that xgrammar cannot parse: in the daemon, before any worker time."""
    if spec.kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")
    if len(spec.source.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema is over {MAX_SCHEMA_BYTES} bytes")
    if spec.kind in ("json_schema", "tagged_json", "harmony_call"):
        try:
            doc = json.loads(spec.source)
        except ValueError as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from None
        _depth(doc, MAX_SCHEMA_DEPTH)
    _grammar(spec)


def spec_key(spec: GuidedDecoding) -> str:
    return hashlib.sha256(f"{spec.kind}\0{spec.source}".encode()).hexdigest()


def tokenizer_vocab(model_dir: Path, keep: Sequence[str] = ()) -> tuple[list[str], str]:
    """The served tokenizer's vocabulary in id order (special tokens as "", so the grammar
    never allows them, but for those named in `keep`) and xgrammar's vocab type for it,
    read from tokenizer.json with `tokenizers` (not transformers' AutoTokenizer: the worker
    never loads transformers)."""
    from tokenizers import Tokenizer
    path = Path(model_dir) / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        encoded[i] = text
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special and added.content not in keep:
            encoded[i] = ""
    doc = json.loads(path.read_text())
    decoders = [doc.get("decoder") or {}]
    decoders += decoders[0].get("decoders", []) if decoders[0].get("type") == "Sequence" else []
    types = {d.get("type") for d in decoders}
    kind = ("BYTE_LEVEL" if "ByteLevel" in types else
            "BYTE_FALLBACK" if "ByteFallback" in types else "RAW")
    return encoded, kind


class Guide:
    """One sequence's grammar state: xgrammar's matcher and how many of the sequence's
    generated tokens it has taken."""

    __slots__ = ("matcher", "taken", "spec")

    def __init__(self, matcher, spec: GuidedDecoding):
        self.matcher = matcher
        self.taken = 0
        self.spec = spec

    def sync(self, generated: Sequence[int]) -> None:
        """Feed the tokens generated since the last call (all of them on a worker that
        has just taken the request over). A token the grammar refuses cannot come from
        a masked pick; it would mean the output is already invalid, so it is an error."""
        for token in generated[self.taken:]:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(int(token)):
                raise GrammarError(f"token {token} does not continue the grammar")
        self.taken = len(generated)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBook:
    """A worker's compiler and its bounded cache of compiled grammars, keyed by a hash of
    the grammar. Thread-safe (the TensorRT-LLM engine may compile from its own thread)."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = COMPILED_CACHE):
        """vocab_size: the model's logits width (at least the tokenizer's; 0: the
        tokenizer's)."""
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.cache_size = cache_size
        self._compilers: dict[tuple[str, ...], Any] = {}
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compilations = 0

    def _get_compiler(self, keep: tuple[str, ...] = ()):
        """The compiler over the vocabulary with the special tokens in `keep` visible
        (one per view, built on first use; most workers only ever build the first)."""
        compiler = self._compilers.get(keep)
        if compiler is None:
            xgr = _xgr()
            encoded, kind = tokenizer_vocab(self.model_dir, keep)
            size = self.vocab_size = max(self.vocab_size, len(encoded))
            info = xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, kind), vocab_size=size,
                                     stop_token_ids=self.stop_token_ids or None)
            compiler = self._compilers[keep] = xgr.GrammarCompiler(info, max_threads=1)
        return compiler

    def compiled(self, spec: GuidedDecoding):
        key = spec_key(spec)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            compiler = self._get_compiler(
                HARMONY_HEADER_TOKENS if spec.kind == "harmony_call" else ())
            try:
                out = compiler.compile_grammar(_grammar(spec))
            except GrammarError:
                raise
            except Exception as exc:
                raise GrammarError(_reason(exc)) from None
            self.compilations += 1
            self._compiled[key] = out
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
            return out

    def guide(self, spec: GuidedDecoding) -> Guide:
        if not self.stop_token_ids:
            # A grammar ends the output with a stop token; without one the mask of a
            # complete output would allow nothing and the step would fail.
            raise GrammarError("this model declares no end-of-sequence token (eos_token_id in "
                               "generation_config.json or config.json), so a grammar could "
                               "not end its output")
        return Guide(_xgr().GrammarMatcher(self.compiled(spec)), spec)

    # ---- masks ---------------------------------------------------------------
    def bitmask(self, guides: Sequence[Guide], generated: Sequence[Sequence[int]],
                rows: Sequence[int], total: int):
        """xgrammar's packed bitmask [total, ceil(V/32)] int32 with guides[i]'s row at
        rows[i], each guide synced with its generated tokens first."""
        mask = _xgr().allocate_token_bitmask(total, self.vocab_size)
        for row, guide, gen in zip(rows, guides, generated):
            guide.sync(gen)
            guide.matcher.fill_next_token_bitmask(mask, row)
        return mask

    def apply(self, logits, rows: Sequence[int], guides: Sequence[Guide],
              generated: Sequence[Sequence[int]]) -> None:
        """Set to -inf, in place, the logits of rows `rows` that their guide forbids
        (guides[i] is row rows[i]'s). `logits` must be float32 and contiguous (the
        caller's own copy). xgrammar reads logits row i with bitmask row i, so the mask
        has a row for each logits row: one of only the guided rows failed the step (and
        so the worker) whenever a guided sequence came after an unguided one in a batch."""
        mask = self.bitmask(guides, generated, rows, logits.shape[0]).to(logits.device)
        _xgr().apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1],
                                           indices=list(rows))

    def allowed(self, guide: Guide, generated: Sequence[int]) -> list[int]:
        """The ids a guide allows next (the simulator picks among them)."""
        import torch
        mask = self.bitmask([guide], [generated], [0], 1)[0]
        bits = (mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        flat = bits.reshape(-1)[:self.vocab_size]
        return torch.nonzero(flat, as_tuple=True)[0].tolist()


def ebnf(spec: GuidedDecoding) -> str:
    """The spec's grammar as xgrammar EBNF text: what an engine with its own grammar
    backend (TensorRT-LLM's guided decoding) is given, so it enforces exactly what the
    torch engine and the simulator do."""
    return str(_grammar(spec))
