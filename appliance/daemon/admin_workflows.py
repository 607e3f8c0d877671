"""`/admin/v1/workflows`: start, list, show and cancel durable admin workflows.

The handlers only translate: the workflow engine (appliance.workflows) validates,
journals and runs; its one-line refusals become OpenAI-shaped 400 / 404 / 409.
"""
from __future__ import annotations

import orjson
from aiohttp import web

from appliance.daemon import admin_audit
from appliance.daemon.api_schema import Body, Operation, Param, read_query, register
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import OPERATIONS, WORKFLOWS, json_response
from appliance.workflows.engine import WorkflowEngine
from appliance.workflows.journal import NotFound, Refused
from appliance.workflows.kinds import KINDS

START = Body({"type": "object", "required": ["kind"], "additionalProperties": False,
              "properties": {
                  "kind": {"type": "string", "description": "One of: " + ", ".join(KINDS)
                           + " (see docs/admin-api.md for each one's params)."},
                  "params": {"type": ["object", "null"],
                             "description": "The kind's parameters."}}},
             "A workflow to start.")
LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50},
              "How many workflows, newest first.")
ID = Param("id", {"type": "string"}, "A workflow id (wf-…).", where="path")


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
    START.check(body)
    audited = {"kind": body["kind"], "params": body.get("params") or {}}
    try:
        wf = engine.submit(body["kind"], body.get("params") or {})
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
    limit = read_query(request.query, (LIMIT,)).get("limit", 50)
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


OPERATIONS_HERE = (
    Operation("POST", "/admin/v1/workflows", start, "Start a durable admin workflow",
              "Workflows", "admin", body=START,
              ok={"201": ("application/json", {"type": "object"})}, errors=(400, 409)),
    Operation("GET", "/admin/v1/workflows", list_, "List workflows, newest first",
              "Workflows", "admin", params=(LIMIT,), errors=(400,)),
    Operation("GET", "/admin/v1/workflows/{id}", show, "One workflow and its steps",
              "Workflows", "admin", params=(ID,), errors=(404,)),
    Operation("POST", "/admin/v1/workflows/{id}/cancel", cancel, "Cancel a workflow (it "
              "compensates its finished steps)", "Workflows", "admin", params=(ID,),
              errors=(404, 409)),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
