"""The operator's surface: `/admin/v1/…` and `/metrics`.

Every route here sits behind `auth.guard` (admin key, or loopback when none is
configured); handlers read what they need from the Service and never compute it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from appliance.daemon.auth import require_admin
from appliance.daemon.responses import SERVICE, json_response

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


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/v1/status", status)
    app.router.add_get("/metrics", metrics)
