"""`GET /openapi.json`: the OpenAPI 3.1 document of every route, rendered from the
`api_schema.Operation`s the routes were registered with, so its request schemas are
the very ones the daemon validates against (operators generate clients from it; the
tests fuzz the daemon with it)."""
from __future__ import annotations

from aiohttp import web

from appliance import __version__
from appliance.daemon.api_schema import ERROR_SCHEMA, Operation, register
from appliance.daemon.responses import OPERATIONS, json_response

_ACCESS = {   # who may call: the security requirement and the errors it implies
    "open": ([], ()),
    "tenant": ([{"apiKey": []}, {}], (401,)),       # {}: no key while none are configured
    "tenant_or_admin": ([{"apiKey": []}, {}], (401, 403)),
    "admin": ([{"apiKey": []}, {}], (401, 403)),   # {}: loopback while no admin keys
    "metrics": ([{"apiKey": []}, {}], (403,)),
}
_STATUS_TEXT = {400: "Bad request (the error names the parameter)", 401: "No or unknown key",
                403: "This caller may not use this route", 404: "Not found or not enabled",
                409: "Conflicts with a workflow already running", 413: "Body too large",
                503: "Not now (draining, overloaded or starting): retry after Retry-After"}


def _operation_id(op: Operation) -> str:
    words = op.path.strip("/").replace("{", "").replace("}", "").replace("-", "_").split("/")
    return "_".join([op.method.lower(), *[w for w in words if w]]) or op.method.lower()


def _operation(op: Operation) -> dict:
    security, implied = _ACCESS[op.access]
    out: dict = {"operationId": _operation_id(op), "summary": op.summary, "tags": [op.tag],
                 "security": security}
    if op.description:
        out["description"] = op.description
    if op.params:
        out["parameters"] = [{"name": p.name, "in": p.where, "required": p.where == "path",
                              "description": p.description, "schema": p.schema}
                             for p in op.params]
    if op.body is not None:
        out["requestBody"] = {"required": True, "description": op.body.description,
                              "content": {"application/json": {"schema": op.body.schema}}}
    responses: dict = {}
    for key, (media, schema) in op.ok.items():
        status = key.split()[0]
        entry = responses.setdefault(status, {"description": "OK", "content": {}})
        entry["content"][media] = {"schema": schema}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for status in sorted({*implied, *op.errors}):
        responses[str(status)] = {"description": _STATUS_TEXT.get(status, "Error"),
                                  "content": error}
    responses["default"] = {"description": "Any other error (404 unknown route, 405, 413, "
                                           "500), in OpenAI's error shape", "content": error}
    out["responses"] = responses
    return out


def document(operations: tuple[Operation, ...]) -> dict:
    paths: dict = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "applianced", "version": __version__,
                 "description": "The OpenAI-compatible API (a subset) and the operator's "
                                "admin API of an applianced inference appliance. Request "
                                "schemas are the ones the daemon validates against."},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR_SCHEMA},
            "securitySchemes": {"apiKey": {
                "type": "http", "scheme": "bearer",
                "description": "A tenant API key on the OpenAI routes, an admin key on "
                               "/admin/v1/* (see docs/admin-api.md)."}}},
    }


async def openapi_json(request: web.Request):
    return json_response(document(request.app[OPERATIONS]))


OPERATIONS_HERE = (
    Operation("GET", "/openapi.json", openapi_json, "This document (OpenAPI 3.1)", "Meta",
              "open"),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
