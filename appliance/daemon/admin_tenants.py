"""`/admin/v1/tenants` (each tenant's share, limits, live rate and budget state) and
`/admin/v1/reload` (re-read [tenants] and [budgets] from the config file).

A bad file on reload answers 400 with the config error's one line and changes nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from appliance.config import ConfigError
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import SERVICE, json_response

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
        return json_response(svc.reload())
    except ConfigError as exc:
        raise ApiError(400, f"reload refused, the old limits stay: {exc}",
                       code="invalid_config") from None


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/v1/tenants", tenants)
    app.router.add_post("/admin/v1/reload", reload)
