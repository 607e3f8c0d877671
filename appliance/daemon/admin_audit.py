"""`/admin/v1/audit`: the audit log read back, and how handlers append to it.

What is recorded and where is `appliance.audit`'s; this module only knows the request:
the caller's identity (set by `auth.guard`), the peer address, and the one-line outcome.
"""
from __future__ import annotations

import datetime as dt
import time

from aiohttp import web

from appliance.audit import AuditLog
from appliance.config import parse_duration
from appliance.daemon.api_schema import Operation, Param, read_query, register
from appliance.daemon.auth import CALLER, require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import AUDIT, OPERATIONS, json_response
from appliance.daemon.tls import subject


def record(request: web.Request, action: str, params: dict, result: str) -> None:
    """One admin action by this request's caller."""
    caller = request.get(CALLER)
    request.app[AUDIT].record(action, caller.identity if caller else "anonymous", result,
                              remote=request.remote, params=params)


def auth_failure(audit: AuditLog):
    """For `auth.guard`: a refused admin request is audited (what was asked, why not);
    the identity is what the request claimed, never the key it sent."""

    def on_failure(request: web.Request, err: ApiError) -> None:
        bearer = request.headers.get("Authorization", "").startswith("Bearer ")
        who = "a key" if bearer else "anonymous"
        transport = request.transport
        cert = subject(transport.get_extra_info("peercert") if transport is not None else None)
        audit.record("auth.failure", f"{who} cert={cert}" if cert else who,
                     f"{err.status} {err.message}", remote=request.remote,
                     params={"method": request.method, "path": request.path})
    return on_failure


def _since(text: str) -> float:
    """Unix seconds, an ISO 8601 time, or a span back from now (90m, 24h, 7d)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return time.time() - parse_duration(text)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, "since must be unix seconds, an ISO 8601 time (e.g. "
                            "2026-11-24T03:00:00Z) or a span back from now (e.g. 24h)",
                       param="since") from None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


async def audit(request: web.Request):
    require_admin(request)
    q = read_query(request.query, (SINCE, LIMIT))
    since = _since(q.get("since", "0"))
    limit = q.get("limit", 1000)
    entries = request.app[AUDIT].read(since, limit)
    return json_response({"object": "list", "data": entries})


SINCE = Param("since", {"type": "string"}, "Entries from: unix seconds, an ISO 8601 time or a "
              "span back from now (90m, 24h, 7d); default: the oldest kept.")
LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": 10000, "default": 1000},
              "How many entries at most, oldest first.")
OPERATIONS_HERE = (
    Operation("GET", "/admin/v1/audit", audit, "The audit log: admin actions and refused "
              "admin logins", "Security", "admin", params=(SINCE, LIMIT), errors=(400,),
              description="Each entry: time, identity (key name or certificate subject, "
              "never the key), remote address, action, parameters, result."),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
