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


# The request fields this module reads, as JSON Schema (`api_schema.Body` checks a body
# against them; /openapi.json shows them). What a schema cannot say (one constraint per
# request, the grammar compiling) is checked below.
_A_SCHEMA = {"type": ["object", "string"],
             "description": "a JSON Schema (an object, or its JSON text)"}
_NON_EMPTY = {"type": "string", "minLength": 1}
_CHOICES = {"type": "array", "minItems": 1, "items": _NON_EMPTY}
REQUEST_FIELDS = {
    "response_format": {
        "type": ["object", "null"], "required": ["type"],
        "description": "OpenAI's structured output: text (none), json_object, or json_schema "
                       "with json_schema.schema.",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "schema": _A_SCHEMA, "strict": {"type": ["boolean", "null"]}}}}},
    "structured_outputs": {
        "type": ["object", "null"],
        "description": "vLLM's structured output: exactly one of json, regex, choice, grammar "
                       "(EBNF) or json_object.",
        "properties": {"json": {**_A_SCHEMA, "type": ["object", "string", "null"]},
                       "regex": {**_NON_EMPTY, "type": ["string", "null"]},
                       "choice": {**_CHOICES, "type": ["array", "null"]},
                       "grammar": {**_NON_EMPTY, "type": ["string", "null"]},
                       "json_object": {"enum": [True, None]}},
        "additionalProperties": {"type": "null", "description": "not supported: use json, "
                                 "regex, choice, grammar or json_object"}},
    "guided_json": {**_A_SCHEMA, "type": ["object", "string", "null"],
                    "description": "vLLM's older spelling of structured_outputs.json."},
    "guided_regex": {**_NON_EMPTY, "type": ["string", "null"],
                     "description": "vLLM's older spelling of structured_outputs.regex."},
    "guided_choice": {**_CHOICES, "type": ["array", "null"],
                      "description": "vLLM's older spelling of structured_outputs.choice."},
    "guided_grammar": {**_NON_EMPTY, "type": ["string", "null"],
                       "description": "vLLM's older spelling of structured_outputs.grammar."},
}


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


def _response_format(fmt: dict) -> GuidedDecoding | None:
    param = "response_format"
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    inner = fmt.get("json_schema")             # kind == "json_schema"
    if inner is None:
        raise bad("'response_format': type json_schema needs 'json_schema': "
                  "{'name', 'schema'}", param)
    return GuidedDecoding("json_schema", _schema_text(inner["schema"], param))


def _vllm(key: str, value, param: str) -> GuidedDecoding:
    kind = _STRUCTURED_KEYS[key]
    if kind == "json_schema":
        return GuidedDecoding(kind, _schema_text(value, param))
    if kind == "json_object":                  # the schema: true (or null: not given)
        return GuidedDecoding(kind)
    if kind == "choice":
        return GuidedDecoding(kind, orjson.dumps(value).decode())
    return GuidedDecoding(kind, value)          # regex, ebnf: a non-empty string


def parse_guided(body: dict) -> GuidedDecoding | None:
    """The request's output constraint (None: free text), or the 400 naming the field."""
    found: list[tuple[GuidedDecoding, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:      # the schema refuses keys beyond _STRUCTURED_KEYS' (unless null)
        for k in [k for k in so if so[k] is not None]:
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


def capabilities(engine: str, tool_parser: str | None,
                 reasoning_parser: str | None = None) -> dict:
    """What /v1/models advertises, so a client can check before it sends: JSON schema
    (and the other constraints) where the engine enforces grammars and xgrammar is
    installed; tools where the chat template renders them (with the parser's family);
    which parser splits off `reasoning_content` (harmony's is its tool-call parser)."""
    try:
        import importlib.util
        grammar = importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):
        grammar = False
    guided = grammar and engine in GUIDED_ENGINES
    return {"json_schema": guided, "json_object": guided, "structured_outputs": guided,
            "tools": tool_parser is not None,
            "tool_choice_required": tool_parser is not None and guided,
            "tool_parser": tool_parser,
            "reasoning_parser": reasoning_parser or ("harmony" if tool_parser == "harmony"
                                                     else None)}
