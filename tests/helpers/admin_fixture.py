"""A real aiohttp server on loopback that answers the admin API contract
(CONTRACTS.md, issue 11 section 6) with snapshots the test sets.

It stands in for the parts of the daemon that other streams are still building (the
live keys of `/admin/v1/status`, `/admin/v1/stream`, `/admin/v1/usage`,
`/admin/v1/carbon`). Tests that use it reach it through the `live_admin` fixture and
assert only what they can also read from the API, so switching them to the real daemon
is a change of that one fixture (`LIVE_DEFAULT` and `DaemonLive` in test_tui_live.py).
"""
from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

from aiohttp import web

from helpers.screen import screen_text

GIB = 1024 ** 3
DEVICES = [f"sim{i}" for i in range(8)]


def windows(x: float) -> dict:
    return {"1s": x, "10s": x, "60s": x}


def contract_status(prefill_busy: float, decode_busy: float, *, site: str = "local",
                    appliance: str = "fixture", history: list[float] | None = None,
                    uptime_s: float = 754.0) -> dict:
    """A `/admin/v1/status` snapshot of a simulated 8xH100 (4 prefill + 4 decode) whose
    groups were busy these fractions over every window; ratio = their GPU-seconds ratio."""
    devices, plan = [], {"mode": "disagg", "prefill": [], "decode": [], "agg": [], "tp": 1,
                         "reason": "fixture"}
    workers = []
    for i, dev in enumerate(DEVICES):
        group = "prefill" if i < 4 else "decode"
        worker = f"{group}{i % 4}"
        busy = prefill_busy if group == "prefill" else decode_busy
        devices.append({"id": dev, "name": "H100-SXM", "kind": "sim", "simulated": True,
                        "group": group, "worker": worker, "util": busy,
                        "power_w": round(70 + 630 * busy, 1), "energy_j": 1000.0 * (i + 1),
                        "mem_used_bytes": 40 * GIB, "mem_total_bytes": 80 * GIB,
                        "busy_fraction": windows(busy), "source": "simulated"})
        plan[group].append({"worker": worker, "devices": [dev]})
        workers.append({"worker": worker, "role": group, "state": "ready", "pid": 1000 + i,
                        "engine": "sim", "devices": [dev], "cpu_cores": None,
                        "simulated": True, "restarts": 1 if i == 5 else 0,
                        "kv_blocks_total": 2577, "kv_blocks_free": 2000, "waiting": 1,
                        "running": 3, "queued_prefill_tokens": 100, "busy_s": 10.0})

    def group(busy: float, tok: float) -> dict:
        return {"devices": DEVICES[:4] if tok > 1000 else DEVICES[4:], "workers": 4,
                "busy_fraction": windows(busy), "gpu_seconds": {"1s": 4 * busy,
                                                                "10s": 40 * busy,
                                                                "60s": 240 * busy},
                "energy_joules": windows(4000 * busy), "utilization": windows(busy),
                "power_w": 4 * (70 + 630 * busy), "tokens_per_s": windows(tok),
                "queue": {"waiting": 4, "running": 12, "queued_prefill_tokens": 400}}

    ratio = prefill_busy / decode_busy if decode_busy else None
    now = 1732365000.0
    hist = history if history is not None else [ratio] * 5
    return {
        "version": "0.1.0", "simulated": True, "engine": "sim", "model": "llama-3.1-70b-fp8",
        "model_dir": "/x", "max_context": 41232, "mode": "disagg", "uptime_s": uptime_s,
        "ready": True, "draining": False, "inflight": 16, "site": site,
        "appliance": appliance, "devices": devices, "plan": plan, "workers": workers,
        "groups": {"prefill": group(prefill_busy, 12000.0), "decode": group(decode_busy, 900.0)},
        "ratio": {"gpu_seconds": ratio, "energy": None if ratio is None else ratio * 1.3,
                  "activity": None if ratio is None else ratio * 0.9, "window": "10s",
                  "history": [[now + i, v] for i, v in enumerate(hist)]},
        "latency": {"ttft_p50_s": 0.12, "ttft_p99_s": 0.34, "itl_p50_s": 0.011,
                    "itl_p99_s": 0.052},
        "requests_per_s": 3.2, "sources": {"energy": "simulated", "utilization": "simulated"},
    }


def usage_rows(charges: dict[str, tuple[float, float]], tokens: dict[str, tuple[int, int]]):
    """`/admin/v1/usage?group_by=tenant,phase`: tenant -> (prefill, decode) GPU-seconds."""
    rows = []
    for tenant, (pre, dec) in charges.items():
        p_tok, o_tok = tokens.get(tenant, (0, 0))
        for phase, gpu in (("prefill", pre), ("decode", dec)):
            rows.append({"tenant": tenant, "model": "llama-3.1-70b-fp8", "phase": phase,
                         "site": "local", "requests": 10,
                         "prompt_tokens": p_tok if phase == "prefill" else 0,
                         "output_tokens": o_tok if phase == "decode" else 0,
                         "gpu_seconds": gpu, "energy_joules": gpu * 500.0,
                         "cost_usage": gpu / 3600 * 2.5, "cost_allocation": gpu / 3600 * 3.1,
                         "co2e_grams": gpu * 0.05, "measured": False, "simulated": True})
    total = sum(a + b for a, b in charges.values())
    return {"since": "2026-11-22T12:00:00Z", "until": "2026-11-23T12:00:00Z",
            "group_by": ["tenant", "phase"], "rows": rows,
            "totals": {"attributed_gpu_seconds": total, "idle_gpu_seconds": 0.0,
                       "unattributed_gpu_seconds": 0.0, "measured_gpu_seconds": total,
                       "attributed_energy_joules": total * 500, "idle_energy_joules": 0.0,
                       "unattributed_energy_joules": 0.0,
                       "measured_energy_joules": total * 500}}


class FixtureAdmin:
    """The admin API on 127.0.0.1, in its own thread and event loop, answering with
    whatever the test last set. `stop()` and `start()` again keep the port."""

    def __init__(self, status: dict | None = None, *, stream: bool = True,
                 sse_interval: float = 0.5, admin_key: str | None = None):
        self.admin_key = admin_key
        self.status = status if status is not None else contract_status(0.5, 0.5)
        self.usage: dict | None = None
        self.carbon: dict | None = None
        self.plan: dict | None = None
        self.workflows: dict | None = None
        self.stream = stream
        self.sse_interval = sse_interval
        self.requests: list[str] = []              # paths with query, in order
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, copy.deepcopy(v))

    # ------------------------------------------------------------ handlers

    def _get(self, name: str):
        with self._lock:
            return copy.deepcopy(getattr(self, name))

    async def _json(self, request: web.Request, name: str):
        self.requests.append(request.path_qs)
        data = self._get(name)
        if data is None:
            raise web.HTTPNotFound(text=json.dumps({"error": {"message": "no such route"}}),
                                   content_type="application/json")
        return web.json_response(data)

    def _handler(self, name: str):
        async def handle(request: web.Request):
            return await self._json(request, name)
        return handle

    async def _stream(self, request: web.Request):
        self.requests.append(request.path_qs)
        if not self.stream:
            raise web.HTTPNotFound()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = 0
        while True:
            await resp.write(f"data: {json.dumps(self._get('status'))}\n\n".encode())
            n += 1
            if n % 4 == 0:
                await resp.write(b": keepalive\n\n")
            await asyncio.sleep(self.sse_interval)

    def _app(self) -> web.Application:
        @web.middleware
        async def guard(request, handler):     # what the daemon's auth.guard answers
            if self.admin_key and request.headers.get("Authorization") != f"Bearer {self.admin_key}":
                return web.json_response({"error": {"message": "an admin key is required",
                                                    "type": "permission_error", "param": None,
                                                    "code": "forbidden"}}, status=403)
            return await handler(request)

        app = web.Application(middlewares=[guard])
        for name in ("status", "usage", "carbon", "plan", "workflows"):
            app.router.add_get(f"/admin/v1/{name}", self._handler(name))
        app.router.add_get("/admin/v1/stream", self._stream)
        return app

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "FixtureAdmin":
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve():
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._runner = web.AppRunner(self._app(), handler_cancellation=True,
                                             shutdown_timeout=0.5)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]
            except BaseException as exc:          # reported to start()'s caller
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None
            self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


async def wait_screen(app, pilot, predicate, timeout: float = 20.0, what: str = "screen") -> str:
    """Let the app run until its screen text satisfies `predicate`; return that text."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        await pilot.pause(0.1)
        text = screen_text(app)
        if predicate(text):
            return text
    raise AssertionError(f"timed out waiting for {what}; the screen shows:\n{text}")


def section(text: str, start: str, stop: str | None = None) -> list[str]:
    """The screen lines from the one starting with `start` up to the one starting with `stop`."""
    lines = text.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.strip().startswith(start))
    j = next((n for n, ln in enumerate(lines[i + 1:], i + 1)
              if stop is not None and ln.strip().startswith(stop)), len(lines))
    return lines[i:j]


def two_peers(kv_bytes: int = 0) -> dict:
    """The `cluster` section of a front box's status (the contract xbox-path serves): one
    decode peer up with handoffs in flight, one down since a refused connection."""
    return {"role": "prefill", "peers": [
        {"url": "https://decode-1:8000", "role": "decode", "up": True, "rtt_ms": 0.42,
         "in_flight": 3, "kv_bytes_total": kv_bytes, "last_error": None, "since": 1732364000.0},
        {"url": "https://decode-2:8000", "role": "decode", "up": False, "rtt_ms": None,
         "in_flight": 0, "kv_bytes_total": 123_456, "last_error": "connection refused",
         "since": 1732364900.0}]}
