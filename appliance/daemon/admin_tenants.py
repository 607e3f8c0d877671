"""`/admin/v1/tenants` (each tenant's share, limits, live rate and budget state) and
`/admin/v1/reload` (re-read [tenants] and [budgets] from the config file).

A bad file on reload answers 400 with the config error's one line and changes nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from appliance.config import ConfigError
from appliance.daemon import admin_audit
from appliance.daemon.api_schema import Operation, register
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import OPERATIONS, SERVICE, json_response

if TYPE_CHECKING:
    from appliance.daemon.service import Service

# The router's queues are the per-tenant ones the daemon holds; prompts waiting in a
# worker's fair queue are ordered there, but counted per worker, not per tenant.
QUEUE_NOTE = ("queue: requests waiting at the router, for a max_concurrent slot or (in "
              "fair queuing order) for a worker with room")


async def tenants(request: web.Request):
    require_admin(request)
    svc: Service = request.app[SERVICE]
    policy = svc.tenants
    return json_response({
        "tenants": policy.view(svc.router.depth),
        "budget_period": policy.budgets.period,
        "budgets_tracked": svc.accounting is not None,
        "queue_depth_note": QUEUE_NOTE,
        "config": str(svc.config_path) if svc.config_path else None,
        "reloads": policy.reloads, "reloaded_at": policy.reloaded_at})


async def reload(request: web.Request):
    require_admin(request)
    svc: Service = request.app[SERVICE]
    try:
        done = svc.reload()
    except ConfigError as exc:
        admin_audit.record(request, "reload", {"config": str(svc.config_path)}, f"400 {exc}")
        raise ApiError(400, f"reload refused, the old limits stay: {exc}",
                       code="invalid_config") from None
    admin_audit.record(request, "reload", {"config": str(svc.config_path)},
                       "reloaded [tenants] and [budgets]")
    return json_response(done)


OPERATIONS_HERE = (
    Operation("GET", "/admin/v1/tenants", tenants, "Each tenant's share, limits, live rate "
              "and budget state", "Tenants", "admin",
              description="Weight, priority (and the effective one while a deprioritizing "
              "budget is spent), max_concurrent, rate limits and what is left of each bucket, "
              "the last minute's rate, in flight, queue depth, refusals, budgets."),
    Operation("POST", "/admin/v1/reload", reload, "Re-read [tenants] and [budgets] from the "
              "config file", "Tenants", "admin", errors=(400,),
              description="Validated first: a bad file answers 400 invalid_config and the old "
              "limits stay. As SIGHUP."),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
