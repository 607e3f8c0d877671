"""The API's one declaration: each route as an `Operation` whose JSON Schemas both check
what arrives and make `/openapi.json`.

A request body is checked against its schema by `Body.check` (fastjsonschema compiles
the schema to a Python function once, ~0.2 s; then ~50 µs for a small chat body, 20 ms
for 5,000 messages), and a query string by `read_query`; whatever the schema refuses
becomes a 400 in OpenAI's error shape that names the parameter. The parsers after it
only convert and apply the rules a schema cannot say (one field's meaning depending on
another's). `openapi.document`
renders the same `Operation`s, so the document cannot drift from what the daemon
accepts: a route registered without one fails tests/integration/test_openapi.py.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from appliance.daemon.api_error import ApiError

# OpenAI's error body; every non-2xx answer of every route has this shape.
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}}


# Key sets a body schema keeps a check of its own for (see `Body.check`): clients send
# a handful (a chat client's usual fields); beyond this many, the whole schema's check.
SPECIALIZED_KEY_SETS = 32


class Body:
    """A request body's JSON Schema and its compiled check.

    The whole schema's check visits every declared property (fifty for a chat body) for
    every request. A body's top-level keys are few, and an object schema's `properties`
    constrain only the keys present, so a schema cut down to the keys a body has (the
    same subschemas, the same `required` and other object keywords) accepts and refuses
    exactly what the whole one does, and checks a short chat body in about half the
    time. `check` compiles one such cut per key set it meets (~20 ms, once), up to
    `SPECIALIZED_KEY_SETS`; other bodies get the whole schema's check. Only defaults of
    absent top-level keys are no longer written into the body: the parsers read those
    from the schema (`openai_schema.default`)."""

    def __init__(self, schema: dict, description: str = ""):
        self.schema = schema
        self.description = description
        self._by_keys: dict[frozenset, Callable[[Any], Any]] = {}

    @functools.cached_property
    def _validate(self) -> Callable[[Any], Any]:
        import fastjsonschema      # compiled on first use: each prepare child compiles its own
        return fastjsonschema.compile(self.schema)

    def compile(self) -> None:
        """Compile now (at start-up), not on the first request."""
        self._validate

    def _validator(self, body) -> Callable[[Any], Any]:
        """The check for `body`'s key set (compiled the first time it is seen)."""
        props = self.schema.get("properties")
        if not isinstance(body, dict) or not props or self.schema.get("type") != "object":
            return self._validate
        keys = frozenset(body.keys() & props.keys())     # (undeclared keys change nothing)
        check = self._by_keys.get(keys)
        if check is None:
            if len(self._by_keys) >= SPECIALIZED_KEY_SETS:
                return self._validate
            import fastjsonschema
            # (required keys stay declared: with additionalProperties false, a required
            # key missing from `properties` is a schema fastjsonschema refuses to compile)
            kept = keys | set(self.schema.get("required", ()))
            cut = {**self.schema, "properties": {k: v for k, v in props.items() if k in kept}}
            check = self._by_keys[keys] = fastjsonschema.compile(cut)
        return check

    def check(self, body) -> None:
        """Nothing, or the 400 that says which parameter breaks the schema and how."""
        try:
            self._validator(body)(body)
        except Exception as exc:
            from fastjsonschema import JsonSchemaValueException
            if not isinstance(exc, JsonSchemaValueException):
                raise
            raise schema_error(exc) from None


@dataclass(frozen=True, eq=False)
class Param:
    """A query-string or path parameter. `schema` is the JSON Schema of its value once
    read as its type (a number, a whole number, a string)."""

    name: str
    schema: dict
    description: str
    where: str = "query"            # "query" | "path"


@dataclass(frozen=True, slots=True)
class Operation:
    """One route: what registers it and what documents it."""

    method: str
    path: str
    handler: Callable
    summary: str
    tag: str                                  # the document's grouping
    access: str     # who may call: tenant | admin | tenant_or_admin | metrics | open
    body: Body | None = None
    params: tuple[Param, ...] = ()
    # Success answers: "status" (or "status word", to give one status several media
    # types) -> (media type, schema).
    ok: dict = field(default_factory=lambda: {"200": ("application/json", {"type": "object"})})
    errors: tuple[int, ...] = ()               # statuses beyond the ones its access implies
    description: str = ""


def register(app, operations: tuple[Operation, ...], key) -> None:
    """Add the routes and remember their declarations (under the app key `key`) for the
    document."""
    for op in operations:
        if op.method == "GET":      # and HEAD, as aiohttp's add_get (not documented)
            app.router.add_get(op.path, op.handler)
        else:
            app.router.add_route(op.method, op.path, op.handler)
    app[key] = (*app.get(key, ()), *operations)


# ---- schema failures -> OpenAI errors ------------------------------------------------

_KINDS = {"number": "a number", "integer": "an integer", "boolean": "true or false",
          "string": "a string", "object": "an object", "array": "a list", "null": "null"}


def _kind(schema) -> str:
    if not isinstance(schema, dict):
        return "valid"
    if "anyOf" in schema:
        return " or ".join(_kind(s) for s in schema["anyOf"])
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    kinds = schema.get("type")
    if kinds is None:
        return "valid"
    if isinstance(kinds, str):
        kinds = [kinds]
    words = [_KINDS.get(k, k) for k in kinds if k != "null"]
    items = schema.get("items")
    if "array" in kinds and isinstance(items, dict):
        inner = (_kind(items).removeprefix("a ").removeprefix("an ") + "s"
                 if items.get("type") in _KINDS else f"({_kind(items)})")
        words = [f"a list of {inner}" if w == "a list" else w for w in words]
    return " or ".join(words) or "null"


def _name(path: list[str]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def _param(path: list[str]) -> str | None:
    """The `param` of the error: the top-level field, and within `messages` the message
    (and its field), as the hand-written checks always named them."""
    if not path:
        return None
    if path[0] == "messages" and len(path) > 1 and path[1].isdigit():
        return _name(path[:3] if len(path) > 2 and not path[2].isdigit() else path[:2])
    return path[0]


def _number(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def schema_error(exc) -> ApiError:
    """A fastjsonschema failure -> the 400 naming the parameter and what it must be."""
    path = [str(p) for p in exc.path[1:]]       # the first is fastjsonschema's "data"
    rule, want, value, definition = exc.rule, exc.rule_definition, exc.value, exc.definition
    if rule == "required":
        missing = next((k for k in want if not (isinstance(value, dict) and k in value)), want[0])
        path.append(missing)
        return ApiError(400, f"'{_name(path)}' is required", _param(path),
                        "missing_required_parameter")
    name = f"'{_name(path)}'" if path else "the request body"
    code = "invalid_value"
    got = "" if isinstance(value, (dict, list)) else f", got {value!r}"
    if rule == "type":
        code = "invalid_type"
        message = f"{name} must be {_kind(definition)}"
        if definition.get("type") == "null" and definition.get("description"):
            message += f" ({definition['description']})"     # a key that must not be used
    elif rule in ("anyOf", "oneOf") and definition.get("description"):
        message = f"{name}: {definition['description']}"      # a rule across fields
        path = path + ([definition["x-param"]] if "x-param" in definition else [])
    elif rule in ("anyOf", "oneOf"):
        code = "invalid_type"
        message = f"{name} must be " + " or ".join(_kind(s) for s in want)
    elif rule == "minimum":
        message = f"{name} must be at least {_number(want)}{got}"
    elif rule == "maximum":
        message = f"{name} must be at most {_number(want)}{got}"
    elif rule == "exclusiveMinimum":
        message = f"{name} must be greater than {_number(want)}{got}"
    elif rule == "exclusiveMaximum":
        message = f"{name} must be less than {_number(want)}{got}"
    elif rule in ("enum", "const"):
        message = f"{name} must be {_kind(definition)}{got}"
    elif rule == "minItems":
        message = f"{name} must have at least {want} item{'s' if want != 1 else ''}"
    elif rule == "maxItems":
        message = (f"{name}: {definition['description']}" if want == 0 and
                   definition.get("description") else f"{name} takes at most {want} items")
    elif rule == "minLength":
        message = f"{name} must not be empty" if want == 1 else \
            f"{name} must be at least {want} characters"
    elif rule == "maxLength":
        message = f"{name} must be at most {want} characters"
    elif rule == "maxProperties":
        message = f"{name} takes at most {want} entries"
    elif rule == "additionalProperties":
        known = sorted((definition or {}).get("properties", {}))
        unknown = sorted(set(value) - set(known)) if isinstance(value, dict) else []
        message = (f"unknown fields {unknown} in {name} (expected {', '.join(known)})"
                   if known else f"{name} takes no fields, got {unknown}")
        if unknown:
            path = path + [unknown[0]]
    elif rule == "propertyNames" and isinstance(want, dict) and "description" in want:
        message = f"{name}: {want['description']}"
    else:
        message = exc.message.replace("data.", "", 1).replace("data", "the request body", 1)
    return ApiError(400, message, _param(path), code)


# ---- query strings ---------------------------------------------------------------------

def read_query(query, params: tuple[Param, ...]) -> dict[str, Any]:
    """The declared query parameters present in `query`, read as their schema's type and
    checked against it (an unknown one is left to the handler: most routes ignore it)."""
    out = {}
    for p in params:
        if p.where != "query" or p.name not in query:
            continue
        raw = query[p.name]
        kind = p.schema.get("type")
        if kind in ("number", "integer"):
            try:
                value = int(raw) if kind == "integer" else float(raw)
            except ValueError:
                value = None
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                raise ApiError(400, f"'{p.name}' must be {_kind(p.schema)}, got {raw!r}",
                               p.name, "invalid_type")
        else:
            value = raw
        _param_body(p).check({p.name: value})
        out[p.name] = value
    return out


@functools.lru_cache(maxsize=None)
def _param_body(p: Param) -> Body:
    return Body({"type": "object", "properties": {p.name: p.schema}})
