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
from appliance.daemon.api_schema import Operation, Param, read_query, register
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import OPERATIONS, PLANNER, SERVICE, json_response


def _positive(at_most: float) -> dict:
    """A what-if within sense: past these the plan's arithmetic leaves 64-bit integers
    (a traffic_x of 1e300 once made the answer unserializable: a 500)."""
    return {"type": "number", "exclusiveMinimum": 0, "maximum": at_most}


MAX_TOKENS_WHATIF = 1 << 20
PARAMS = (
    Param("horizon", {"type": "string"}, "How far ahead to plan: a duration such as 2h, 7d "
                                         "(at most 8 weeks; default: the planner's)."),
    Param("gpu", {"type": "string"}, "What if the box had this GPU model (e.g. L40S)."),
    Param("ttft_slo", _positive(600), "What if the time-to-first-token goal were this (s)."),
    Param("itl_slo", _positive(60), "What if the inter-token-latency goal were this (s)."),
    Param("traffic_x", _positive(1000), "What if traffic were this many times today's."),
    Param("prompt_tokens", _positive(MAX_TOKENS_WHATIF),
          "What if prompts were this long on average."),
    Param("output_tokens", _positive(MAX_TOKENS_WHATIF),
          "What if answers were this long on average."),
)
QUERY_PARAMS = {p.name for p in PARAMS}


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
    read_query(q, PARAMS)
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
    cluster = request.app[SERVICE].cfg.cluster     # a fleet's role plan starts from these
    result["cluster"] = {"role": cluster.role, "peers": list(cluster.peers)}
    return json_response(result)


OPERATIONS_HERE = (
    Operation("GET", "/admin/v1/plan", plan, "The capacity planner's plan (and what-ifs)",
              "Admin", "admin", params=PARAMS, errors=(400, 503),
              description="Unknown query parameters are refused (400)."),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
