"""`GET /admin/v1/plan`: the capacity planner's answer, and its Prometheus gauges.

The planner itself (`appliance.planner`) knows nothing of HTTP; this module builds it
from the Service, feeds it (the Service's `finished` hook), runs its periodic tick, and
hands it the one daemon action it may take: starting the repartition workflow, a call
to the daemon's workflow engine (`WorkflowEngine.submit`, what `POST
/admin/v1/workflows` calls), in this process: no loopback request, no admin key.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import socket
from pathlib import Path

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from appliance.config import parse_duration
from appliance.daemon.auth import require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import SERVICE, json_response

log = logging.getLogger("applianced.planner")

PLANNER = web.AppKey("planner", object)
TICK_S = 60.0
FIRST_TICK_S = 5.0
MIN_TICK_S = 1.0
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


class PlannerCollector:
    """applianced_planner_recommended_workers{group}; the current count per group,
    `applianced_group_workers`, comes with the live telemetry series."""

    def __init__(self, planner, labels: dict[str, str]):
        self.planner = planner
        self.labels = labels

    def collect(self):
        names = ["group", *self.labels]
        rec = GaugeMetricFamily("applianced_planner_recommended_workers",
                                "Workers the capacity planner recommends per group "
                                "(upper forecast quantile, at the SLOs)", labels=names)
        if self.planner.last_recommended is not None:
            for group, n in zip(("prefill", "decode"), self.planner.last_recommended):
                rec.add_metric([group, *self.labels.values()], float(n))
        return [rec]


def _register_gauges(svc, planner) -> None:
    site = svc.cfg.site
    labels = {"site": site.name, "appliance": site.appliance or socket.gethostname(),
              "simulated": "true" if svc.simulated else "false"}
    svc.metrics.registry.register(PlannerCollector(planner, labels))


def _repartition_starter(svc):
    """The one action the planner may take: submit the repartition workflow to this
    daemon's workflow engine, exactly as `POST /admin/v1/workflows` does. The engine's
    refusals (ValueError: a split that does not fit; Refused: a workflow that changes
    the workers already runs) reach the planner as exceptions, which it records."""
    async def start(split: str) -> dict:
        engine = svc.workflows
        if engine is None:
            raise RuntimeError("workflows are not available yet (the daemon is starting)")
        wf = engine.submit("repartition", {"split": split})
        return {"id": wf.id, "kind": wf.kind, "status": wf.status}
    return start


def _workers_changing(svc):
    """Is a workflow of the "workers" class (repartition, swap-model) unfinished?"""
    def changing() -> bool:
        engine = svc.workflows
        return engine is not None and any(
            w.exclusive == "workers" for w in engine.journal.list(20, unfinished=True))
    return changing


def _live_box(svc, model):
    """The planner's view of the box as it runs now: `svc.plan` and `svc.model` are what
    workflows change (repartition, swap-model). `model` is the start-up model's shape."""
    from appliance.models.specs import lookup_model_spec, spec_from_hf_config
    from appliance.planner.planner import box_from_setup
    start = svc.model
    shapes = {(start.model_dir, start.model_spec): model}

    def box():
        ref = svc.model
        key = (ref.model_dir, ref.model_spec)
        if key not in shapes:
            shapes[key] = (lookup_model_spec(ref.model_spec) if ref.model_spec
                           else spec_from_hf_config(Path(ref.model_dir) / "config.json"))
        return box_from_setup(svc.setup, svc.cfg.engine, plan=svc.plan, model=shapes[key])
    return box


def tick_interval(cfg) -> float:
    """How often the planner plans in the background: every minute, or often enough to
    notice a difference within a quarter of `auto_apply_after_s` (at most once a second)
    when auto-apply is on with a short delay."""
    if not cfg.auto_apply:
        return TICK_S
    return max(MIN_TICK_S, min(TICK_S, cfg.auto_apply_after_s / 4))


def build_planner(svc):
    from appliance.planner.planner import Planner, box_from_setup
    state_dir: Path | None = getattr(svc, "state_dir", None)
    box = box_from_setup(svc.setup, svc.cfg.engine)
    db = state_dir / "ledger.db" if state_dir else ":memory:"
    if state_dir:
        state_dir.mkdir(parents=True, exist_ok=True)
    planner = Planner(svc.cfg.planner, box, db, engine=svc.cfg.engine,
                      profile_dir=state_dir / "profiles" if state_dir else None,
                      start_repartition=_repartition_starter(svc), model_name=svc.model_name,
                      box_source=_live_box(svc, box.model),
                      workers_changing=_workers_changing(svc),
                      served_name=lambda: svc.model_name)
    planner.batch_tokens = getattr(svc.setup, "batch_tokens", None)
    return planner


async def _ticker(planner) -> None:
    every = tick_interval(planner.cfg)
    await asyncio.sleep(min(FIRST_TICK_S, every))
    while True:
        try:
            await planner.auto_apply_tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("planner tick failed")
        await asyncio.sleep(every)


async def _lifecycle(app: web.Application):
    planner = app[PLANNER]
    task = None
    if planner is not None:
        planner.trends.start()
        task = asyncio.create_task(_ticker(planner))
    yield
    if task is not None:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
    if planner is not None:
        await asyncio.get_running_loop().run_in_executor(None, planner.close)


def add_routes(app: web.Application) -> None:
    svc = app[SERVICE]
    try:
        planner = build_planner(svc)
    except Exception as exc:    # a model we cannot size must not stop serving
        log.warning("capacity planner disabled: %s", exc)
        planner = None
    app[PLANNER] = planner
    svc.planner = planner
    if planner is not None:
        _register_gauges(svc, planner)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_get("/admin/v1/plan", plan)
