"""The routes boxes of a cluster call on each other (docs/operations/cluster.md).

`POST /cluster/v1/decode` (a decode box): run another box's request's decode here. The
decode worker with the most free KV pulls the prompt's KV from the prefill box's worker
with NIXL READ, then decodes; the answer streams back as JSON lines (`cluster_wire`).
The decode box bills what it served under the front's request id and tenant in its own
ledger (a RequestRecord with ``endpoint = "cluster_decode"``), as the issue's joined
chargeback view expects. When the caller's connection closes, the request is aborted
(the daemon runs with handler cancellation), so a front that restarts leaves no
imported KV behind.

`GET /cluster/v1/status`: what a peer polls: role, readiness, free decode KV, layout.

Both need ``Authorization: Bearer <cluster.key>`` (compared in constant time): 401
otherwise. A box of role "both" has no cluster routes (404); a prefill box takes no
decodes (403).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from appliance.accounting.records import RequestRecord
from appliance.daemon.api_schema import Operation, register
from appliance.daemon.cluster_wire import (
    DECODE_BODY, DECODE_PATH, NDJSON, STATUS_PATH, bearer_matches, parse_decode_order,
)
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import OPERATIONS, RETRY_AFTER_S, SERVICE, json_response
from appliance.daemon.router import EngineError, NoWorker, Trace
from appliance.daemon.workers import WorkerGone
from appliance.engines.messages import KvImported
from appliance.kv.nixl_transport import NixlKvHandle, from_json

if TYPE_CHECKING:
    from appliance.daemon.service import Service


def _authorized(request: web.Request) -> Service:
    svc: Service = request.app[SERVICE]
    c = svc.cfg.cluster
    if c.role == "both":
        raise ApiError(404, f"no route {request.method} {request.path}: this box is not part "
                            "of a cluster (cluster.role = \"both\")", code="unknown_route")
    if not bearer_matches(request.headers.get("Authorization"), c.key):
        raise ApiError(401, "cluster routes need Authorization: Bearer <cluster.key>",
                       type_="authentication_error", code="invalid_cluster_key")
    return svc


async def status(request: web.Request):
    svc = _authorized(request)
    free, layout = svc.router.decode_capacity()
    return json_response({
        "role": svc.cfg.cluster.role, "ready": svc.router.ready(), "model": svc.model_name,
        "free_kv_blocks": free, "layout": layout, "simulated": svc.simulated})


async def decode(request: web.Request):
    svc = _authorized(request)
    if svc.cfg.cluster.role != "decode":
        raise ApiError(403, "this box is a prefill box (cluster.role = \"prefill\"): it takes "
                            "no decodes from others", code="forbidden")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not JSON ({exc})", code="invalid_json") from None
    order = parse_decode_order(body)
    if order.model != svc.model_name:
        raise ApiError(400, f"this box serves {svc.model_name!r}, not {order.model!r}",
                       param="model", code="model_not_found")
    try:
        handle = from_json(NixlKvHandle, order.kv_handle)
    except ValueError as exc:
        raise ApiError(400, f"kv.handle: {exc}", param="kv", code="invalid_value") from None
    arrival = time.time()
    trace = Trace(order.request_id, arrival)
    gen = svc.router.decode_order(trace, order, handle)
    rec = {"status": "error", "finish": None, "error": None, "output": 0}
    resp: web.StreamResponse | None = None
    try:
        try:
            first = await anext(gen)
        except NoWorker as exc:
            rec["error"] = str(exc)
            raise ApiError(503, f"{exc}; retry shortly", code="no_worker",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except (WorkerGone, EngineError) as exc:
            rec["error"] = str(exc)
            raise ApiError(503 if isinstance(exc, WorkerGone) else 500, str(exc),
                           code=getattr(exc, "code", "worker_failed")) from None
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        ev = first
        try:
            while True:
                if isinstance(ev, KvImported):
                    line = {"event": "kv_imported", "transport": ev.transport,
                            "nbytes": ev.nbytes, "seconds": ev.seconds}
                else:
                    rec["output"] += len(ev.tokens)
                    line = {"event": "tokens", "tokens": ev.tokens, "logprobs": ev.logprobs,
                            "finish_reason": ev.finish_reason}
                await resp.write(orjson.dumps(line) + b"\n")
                if not isinstance(ev, KvImported) and ev.finish_reason is not None:
                    rec["status"], rec["finish"] = "ok", ev.finish_reason
                    break
                ev = await anext(gen)
        except (NoWorker, WorkerGone, EngineError) as exc:
            rec["error"] = str(exc)
            code = getattr(exc, "code", None) or "worker_failed"
            await resp.write(orjson.dumps({"event": "error", "message": str(exc),
                                           "code": code}) + b"\n")
        except StopAsyncIteration:
            rec["error"] = "the decode ended without a finish"
            await resp.write(orjson.dumps({"event": "error", "message": rec["error"],
                                           "code": "engine_error"}) + b"\n")
        await resp.write_eof()
        return resp
    except (ConnectionError, asyncio.CancelledError):
        rec["status"], rec["error"] = "aborted", "the calling box disconnected"
        raise
    finally:
        await gen.aclose()      # not finished: the worker aborts it and frees its KV
        svc.record(RequestRecord(
            request_id=order.request_id, tenant=order.tenant, model=svc.model_name,
            endpoint="cluster_decode", prompt_tokens=len(order.prompt),
            output_tokens=rec["output"], cached_tokens=0, arrival=arrival,
            first_token=trace.first_token, finish=time.time(), prefill_worker=None,
            decode_worker=trace.decode_worker, status=rec["status"],
            finish_reason=rec["finish"], error=rec["error"], simulated=svc.simulated))


_STREAM = {"200": (NDJSON, {"type": "string", "description": "one JSON event per line: "
                            "kv_imported, tokens, error"})}
OPERATIONS_HERE = (
    Operation("POST", DECODE_PATH, decode, "Decode another box's request (its KV pulled "
              "with NIXL)", "Cluster", "open", body=DECODE_BODY, ok=_STREAM,
              errors=(400, 401, 403, 404, 503),
              description="Cluster key (Authorization: Bearer <cluster.key>); decode boxes "
                          "only. docs/operations/cluster.md"),
    Operation("GET", STATUS_PATH, status, "A box's role, readiness and free decode KV, for "
              "its peers", "Cluster", "open", errors=(401, 404),
              description="Cluster key (Authorization: Bearer <cluster.key>)."),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
