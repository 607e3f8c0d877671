"""Structured-output request fields -> the `GuidedDecoding` the workers enforce.

Three spellings, one constraint per request:
- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's `structured_outputs`: `{"json": schema} | {"regex": str} | {"choice": [str]} |
  {"grammar": ebnf} | {"json_object": true}` (the documented form here);
- vLLM's older top-level `guided_json` / `guided_regex` / `guided_choice` /
  `guided_grammar`, accepted as aliases of the same.

Every grammar is checked here (size, nesting, keywords xgrammar would ignore, and
xgrammar's own parse), so a bad one is a 400 naming the field before any worker sees it.
"""
from __future__ import annotations

import orjson

from appliance.daemon.api_error import bad
from appliance.engines.grammar import GrammarError, check_guided
from appliance.engines.messages import GuidedDecoding

# vLLM's structured_outputs keys and older guided_* fields -> our kinds.
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "ebnf", "json_object": "json_object"}
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):     # vLLM takes a schema as JSON text too
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise bad(f"'{param}': the schema is not JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise bad(f"'{param}': the schema must be a JSON object", param)
    return orjson.dumps(schema).decode()     # key order kept: it is the output's


def check_constraint(spec: GuidedDecoding, param: str) -> GuidedDecoding:
    """The spec, or the 400 naming `param` that says why it cannot be enforced."""
    return _checked(spec, param)


def _checked(spec: GuidedDecoding, param: str) -> GuidedDecoding:
    try:
        check_guided(spec)
    except GrammarError as exc:
        raise bad(f"'{param}': {exc}", param) from None
    return spec


def _response_format(fmt) -> GuidedDecoding | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise bad("'response_format' must be an object with a 'type'", param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise bad("'response_format': type json_schema needs 'json_schema': "
                       "{'name', 'schema'}", param)
        return GuidedDecoding("json_schema", _schema_text(inner["schema"], param))
    raise bad(f"'response_format' type must be text, json_object or json_schema, "
               f"got {kind!r}", param)


def _vllm(key: str, value, param: str) -> GuidedDecoding:
    kind = _STRUCTURED_KEYS[key]
    if kind == "json_schema":
        return GuidedDecoding(kind, _schema_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise bad(f"'{param}': json_object must be true", param)
        return GuidedDecoding(kind)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise bad(f"'{param}': choice must be a non-empty list of non-empty strings",
                       param)
        return GuidedDecoding(kind, orjson.dumps(value).decode())
    if not isinstance(value, str) or not value:
        raise bad(f"'{param}' must be a non-empty string", param)
    return GuidedDecoding(kind, value)


def parse_guided(body: dict) -> GuidedDecoding | None:
    """The request's output constraint (None: free text), or the 400 naming the field."""
    found: list[tuple[GuidedDecoding, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'structured_outputs' must be an object", "structured_outputs")
        keys = [k for k in so if so[k] is not None and k in _STRUCTURED_KEYS]
        unknown = [k for k in so if k not in _STRUCTURED_KEYS and so[k] is not None]
        if unknown:
            raise bad(f"'structured_outputs': '{unknown[0]}' is not supported (use one of "
                       f"{sorted(_STRUCTURED_KEYS)})", "structured_outputs")
        for k in keys:
            found.append((_vllm(k, so[k], "structured_outputs"), "structured_outputs"))
    for name, key in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((_vllm(key, body[name], name), name))
    if not found:
        return None
    if len(found) > 1:
        raise bad(f"'{found[1][1]}': only one output constraint per request "
                   f"('{found[0][1]}' is already given)", found[1][1])
    spec, param = found[0]
    return _checked(spec, param)


# The simulator and the torch engine apply the mask themselves; TensorRT-LLM gets the same
# grammar for its own guided decoding (mapped and contract-tested, not run on hardware).
GUIDED_ENGINES = ("sim", "torch", "trtllm")


def capabilities(engine: str, tool_parser: str | None) -> dict:
    """What /v1/models advertises, so a client can check before it sends: JSON schema
    (and the other constraints) where the engine enforces grammars and xgrammar is
    installed; tools where the chat template renders them (with the parser's family)."""
    try:
        import importlib.util
        grammar = importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):
        grammar = False
    guided = grammar and engine in GUIDED_ENGINES
    return {"json_schema": guided, "json_object": guided, "structured_outputs": guided,
            "tools": tool_parser is not None,
            # harmony calls are not forced by a grammar (tool_calls.forced_grammar)
            "tool_choice_required": tool_parser not in (None, "harmony") and guided,
            "tool_parser": tool_parser}
