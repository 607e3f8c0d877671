"""`/admin/v1/stream`: the live status snapshot as server-sent events (the TUI reads it).

Each event is `data: {the /admin/v1/status JSON}`; `?interval=` seconds between
snapshots, 0.25-1 (1-4 per second, default 0.5). A `: keepalive` comment opens the stream
and repeats every 15 s. There is no `[DONE]`: the client closes it, and the daemon ends it
when it starts draining.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from appliance.daemon.api_schema import Operation, Param, read_query, register
from appliance.daemon.auth import require_admin
from appliance.daemon.responses import OPERATIONS, SERVICE

if TYPE_CHECKING:
    from appliance.daemon.service import Service

MIN_INTERVAL_S = 0.25
MAX_INTERVAL_S = 1.0
DEFAULT_INTERVAL_S = 0.5
KEEPALIVE_S = 15.0


INTERVAL = Param("interval", {"type": "number", "minimum": MIN_INTERVAL_S,
                              "maximum": MAX_INTERVAL_S, "default": DEFAULT_INTERVAL_S},
                 "Seconds between snapshots (1-4 per second).")


def _interval(request: web.Request) -> float:
    return read_query(request.query, (INTERVAL,)).get("interval", DEFAULT_INTERVAL_S)


async def stream(request: web.Request):
    require_admin(request)
    svc: Service = request.app[SERVICE]
    interval = _interval(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        await resp.write(b": keepalive\n\n")
        last_keepalive = time.monotonic()
        while not svc.draining:
            started = time.monotonic()
            await resp.write(b"data: " + orjson.dumps(svc.status()) + b"\n\n")
            if started - last_keepalive >= KEEPALIVE_S:
                await resp.write(b": keepalive\n\n")
                last_keepalive = started
            # Keep the rate even when a snapshot takes a while to build.
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
    except (ConnectionResetError, ConnectionError):
        pass        # the client went away: that is how a stream ends
    return resp


OPERATIONS_HERE = (
    Operation("GET", "/admin/v1/stream", stream, "The live status as server-sent events",
              "Admin", "admin", params=(INTERVAL,),
              ok={"200": ("text/event-stream", {"type": "string"})}, errors=(400,)),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
