"""The operator's surface: `/admin/v1/…` and `/metrics`.

Every route here sits behind `auth.guard` (admin key, or loopback when none is
configured); handlers read what they need from the Service and never compute it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from appliance.daemon.api_schema import Operation, register
from appliance.daemon.auth import require_admin
from appliance.daemon.responses import OPERATIONS, SERVICE, json_response

if TYPE_CHECKING:
    from appliance.daemon.service import Service


async def status(request: web.Request):
    require_admin(request)
    svc: Service = request.app[SERVICE]
    return json_response(svc.status())


async def metrics(request: web.Request):
    svc: Service = request.app[SERVICE]
    body, content_type = svc.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


OPERATIONS_HERE = (
    Operation("GET", "/admin/v1/status", status, "The appliance's live status snapshot",
              "Admin", "admin"),
    Operation("GET", "/metrics", metrics, "Prometheus metrics", "Metrics", "metrics",
              ok={"200": ("text/plain", {"type": "string"})},
              description="Open to the clients `[auth] metrics_access` allows."),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
