"""What every route shares: the app keys through which handlers reach the service and
its subsystems, JSON responses, and the middleware that turns every failure into
OpenAI-shaped JSON (the traceback goes to the log, never out)."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from appliance.daemon.openai_protocol import ApiError

log = logging.getLogger("applianced.http")

if TYPE_CHECKING:
    from appliance.audit import AuditLog
    from appliance.daemon.accounting_link import AccountingLink
    from appliance.daemon.api_schema import Operation
    from appliance.daemon.service import Service
    from appliance.planner.planner import Planner
    from appliance.workflows.engine import WorkflowEngine

# What a handler uses, set once by `server.build_app` from what `daemon.main` built.
SERVICE: web.AppKey[Service] = web.AppKey("service")
WORKFLOWS: web.AppKey[WorkflowEngine] = web.AppKey("workflows")
PLANNER: web.AppKey[Planner | None] = web.AppKey("planner")           # None: not built
ACCOUNTING: web.AppKey[AccountingLink | None] = web.AppKey("accounting")   # None: off
AUDIT: web.AppKey[AuditLog] = web.AppKey("audit")
# Every route's declaration (`api_schema.register`), which /openapi.json renders.
OPERATIONS: web.AppKey[tuple[Operation, ...]] = web.AppKey("operations")
RETRY_AFTER_S = "1"


def request_id(request: web.Request) -> str:
    """This request's id: made on first use, then the same in its response header, its
    logs and its record."""
    rid = request.get("request_id")
    if rid is None:
        rid = request["request_id"] = request.app[SERVICE].next_request_id()
    return rid


async def stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every response that leaves through the app (handlers, errors
    of the middlewares, aiohttp's own 404/405) carries `X-Request-Id`. Failures of the
    HTTP parser never reach the app; `http_parser_errors.JsonErrorProtocol` stamps those."""
    if "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = request_id(request)


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type="application/json")


def error_response(err: ApiError, request_id: str | None = None) -> web.Response:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return json_response(err.body(), err.status, headers)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SERVICE].cfg.server.max_body_bytes
        return error_response(ApiError(413, f"request body too large (limit {limit} bytes, "
                                            f"server.max_body_bytes)", code="body_too_large"))
    except web.HTTPNotFound:
        return error_response(ApiError(404, f"no route {request.method} {request.path}",
                                       code="unknown_route"))
    except web.HTTPMethodNotAllowed as exc:
        return error_response(ApiError(405, f"{request.method} not allowed on {request.path} "
                                            f"(allowed: {', '.join(sorted(exc.allowed_methods))})",
                                       code="method_not_allowed"))
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal error (see the daemon log)",
                                       code="internal_error"))
