"""`GET /admin/v1/plan`: the capacity planner's answer.

The planner itself (`appliance.planner`) knows nothing of HTTP; `daemon.planner_link`
builds it, feeds it and runs its tick; this handler only asks it (in a thread: a plan
over weeks of trends takes a while) and adds the site.
"""
from __future__ import annotations

import asyncio
import functools
import socket

from aiohttp import web

from appliance.config import parse_duration
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import PLANNER, SERVICE, json_response

QUERY_PARAMS = {"horizon", "gpu", "ttft_slo", "itl_slo", "traffic_x", "prompt_tokens",
                "output_tokens"}


async def plan(request: web.Request):
    require_admin(request)
    planner = request.app[PLANNER]
    if planner is None:
        raise ApiError(503, "the planner is not available on this daemon (see its log)",
                       code="planner_unavailable")
    from appliance.planner.planner import MAX_HORIZON_S, parse_whatif
    q = request.query
    unknown = sorted(set(q) - QUERY_PARAMS)
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}; known: "
                            f"{', '.join(sorted(QUERY_PARAMS))}", param=unknown[0],
                       code="invalid_parameter")
    horizon = None
    if "horizon" in q:
        try:
            horizon = parse_duration(q["horizon"])
        except ValueError as exc:
            raise ApiError(400, f"horizon: {exc}", param="horizon", code="invalid_parameter") from None
        if horizon > MAX_HORIZON_S:
            raise ApiError(400, f"horizon {q['horizon']!r} is longer than 8 weeks",
                           param="horizon", code="invalid_parameter")
    try:
        whatif = parse_whatif(dict(q))
    except ValueError as exc:
        param = next((k for k in QUERY_PARAMS if str(exc).startswith(k)), "gpu")
        raise ApiError(400, str(exc), param=param, code="invalid_parameter") from None
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(None, functools.partial(planner.plan, horizon, whatif))
    site = request.app[SERVICE].cfg.site           # a fleet view groups plans by site
    result["site"] = {"name": site.name, "appliance": site.appliance or socket.gethostname()}
    return json_response(result)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/v1/plan", plan)
