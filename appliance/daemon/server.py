"""Builds the aiohttp application: middlewares, then each surface's routes.

Each surface (OpenAI API, admin) lives in its own module and adds its own routes, so a
new admin area is one module and one line here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from appliance.daemon import (
    admin, admin_audit, admin_live, admin_plan, admin_tenants, admin_usage, admin_workflows,
    cluster_routes, openai_routes, openapi,
)
from appliance.daemon.auth import guard
from appliance.daemon.responses import (
    ACCOUNTING, AUDIT, PLANNER, SERVICE, WORKFLOWS, errors_as_json, stamp_request_id,
)

if TYPE_CHECKING:
    from appliance.audit import AuditLog
    from appliance.daemon.service import Service

SURFACES = (openai_routes, admin, admin_audit, admin_live, admin_plan, admin_tenants,
            admin_usage, admin_workflows, cluster_routes, openapi)


def build_app(svc: Service, max_body_bytes: int, audit: AuditLog) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[errors_as_json,
                                       guard(svc.auth, admin_audit.auth_failure(audit))])
    app[SERVICE] = svc
    app[AUDIT] = audit
    app[WORKFLOWS] = svc.workflows
    app[PLANNER] = svc.planner
    app[ACCOUNTING] = svc.accounting
    app.on_response_prepare.append(stamp_request_id)
    add_surfaces(app)
    return app


def add_surfaces(app: web.Application) -> None:
    """Every route, each declared (`api_schema.register`): /openapi.json shows them all."""
    for surface in SURFACES:
        surface.add_routes(app)
