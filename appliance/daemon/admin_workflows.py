"""`/admin/v1/workflows`: start, list, show and cancel durable admin workflows.

The handlers only translate: the workflow engine (appliance.workflows) validates,
journals and runs; its one-line refusals become OpenAI-shaped 400 / 404 / 409.
"""
from __future__ import annotations

import orjson
from aiohttp import web

from appliance.daemon import admin_audit
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import WORKFLOWS, json_response
from appliance.workflows.engine import WorkflowEngine
from appliance.workflows.journal import NotFound, Refused


def _engine(request: web.Request) -> WorkflowEngine:
    require_admin(request)
    return request.app[WORKFLOWS]


def _get(engine, wid: str):
    try:
        return engine.journal.get(wid)
    except NotFound:
        raise ApiError(404, f"no workflow {wid!r}", param="id", code="workflow_not_found") from None


async def start(request: web.Request):
    engine = _engine(request)
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object {\"kind\", \"params\"}",
                       code="invalid_value")
    unknown = set(body) - {"kind", "params"}
    if unknown:
        raise ApiError(400, f"unknown fields {sorted(unknown)} (expected kind, params)",
                       param=sorted(unknown)[0], code="invalid_value")
    kind = body.get("kind")
    if not isinstance(kind, str):
        raise ApiError(400, "kind must be one of: " + ", ".join(engine.kinds), param="kind",
                       code="invalid_value")
    params = body.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ApiError(400, "params must be a JSON object", param="params", code="invalid_value")
    audited = {"kind": kind, "params": params}
    try:
        wf = engine.submit(kind, params)
    except Refused as exc:
        admin_audit.record(request, "workflow.start", audited, f"409 {exc}")
        raise ApiError(409, str(exc), code="workflow_conflict") from None
    except ValueError as exc:
        admin_audit.record(request, "workflow.start", audited, f"400 {exc}")
        raise ApiError(400, str(exc), param="kind" if "kind" in str(exc) else "params",
                       code="invalid_value") from None
    admin_audit.record(request, "workflow.start", {**audited, "id": wf.id}, "started")
    return json_response({"id": wf.id, "kind": wf.kind, "status": wf.status}, status=201)


async def list_(request: web.Request):
    engine = _engine(request)
    try:
        limit = int(request.query.get("limit", "50"))
    except ValueError:
        raise ApiError(400, "limit must be a whole number", param="limit") from None
    if not 1 <= limit <= 1000:
        raise ApiError(400, "limit must be within 1..1000", param="limit")
    return json_response({"object": "list",
                          "data": [w.to_json() for w in engine.journal.list(limit)]})


async def show(request: web.Request):
    engine = _engine(request)
    return json_response(_get(engine, request.match_info["id"]).to_json())


async def cancel(request: web.Request):
    engine = _engine(request)
    wid = request.match_info["id"]
    _get(engine, wid)
    try:
        wf = engine.cancel(wid)
    except Refused as exc:
        admin_audit.record(request, "workflow.cancel", {"id": wid}, f"409 {exc}")
        raise ApiError(409, str(exc), code="workflow_finished") from None
    admin_audit.record(request, "workflow.cancel", {"id": wid}, "cancel requested")
    return json_response({"id": wf.id, "kind": wf.kind, "status": wf.status,
                          "cancel_requested": wf.cancel_requested})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/v1/workflows", start)
    app.router.add_get("/admin/v1/workflows", list_)
    app.router.add_get("/admin/v1/workflows/{id}", show)
    app.router.add_post("/admin/v1/workflows/{id}/cancel", cancel)
