"""Connects the capacity planner (`appliance.planner`, which knows nothing of HTTP or the
daemon) to the running daemon: builds it from the config and the start-up decisions,
hands it the live box (the partition and model that run now, which workflows change),
feeds it each finished request (the Service's `finished`), runs its periodic tick, and
gives it the one daemon action it may take: starting the repartition workflow, a call
to the daemon's workflow engine (`WorkflowEngine.submit`, what `POST
/admin/v1/workflows` calls), in this process: no loopback request, no admin key.

`GET /admin/v1/plan` (`daemon.admin_plan`) reads the planner through its app key.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from appliance.config import Config
    from appliance.daemon.setup import Setup
    from appliance.daemon.state import ServingState
    from appliance.planner.planner import Planner
    from appliance.workflows.engine import WorkflowEngine

log = logging.getLogger("applianced.planner")

TICK_S = 60.0
FIRST_TICK_S = 5.0
MIN_TICK_S = 1.0


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


def _repartition_starter(workflows: WorkflowEngine):
    """The one action the planner may take: submit the repartition workflow to this
    daemon's workflow engine, exactly as `POST /admin/v1/workflows` does. The engine's
    refusals (ValueError: a split that does not fit; Refused: a workflow that changes
    the workers already runs) reach the planner as exceptions, which it records."""
    async def start(split: str) -> dict:
        wf = workflows.submit("repartition", {"split": split})
        return {"id": wf.id, "kind": wf.kind, "status": wf.status}
    return start


def _workers_changing(workflows: WorkflowEngine):
    """Is a workflow of the "workers" class (repartition, swap-model) unfinished?"""
    def changing() -> bool:
        return any(w.exclusive == "workers" for w in workflows.journal.list(20, unfinished=True))
    return changing


def _live_box(cfg: Config, setup: Setup, state: ServingState, model):
    """The planner's view of the box as it runs now: `state.plan` and `state.model` are
    what workflows change (repartition, swap-model). `model` is the start-up model's
    shape."""
    from appliance.models.specs import lookup_model_spec, spec_from_hf_config
    from appliance.planner.planner import box_from_setup
    start = state.model.ref
    shapes = {(start.model_dir, start.model_spec): model}

    def box():
        ref = state.model.ref
        key = (ref.model_dir, ref.model_spec)
        if key not in shapes:
            shapes[key] = (lookup_model_spec(ref.model_spec) if ref.model_spec
                           else spec_from_hf_config(Path(ref.model_dir) / "config.json"))
        return box_from_setup(setup, cfg.engine, plan=state.plan, model=shapes[key])
    return box


def tick_interval(cfg) -> float:
    """How often the planner plans in the background: every minute, or often enough to
    notice a difference within a quarter of `auto_apply_after_s` (at most once a second)
    when auto-apply is on with a short delay."""
    if not cfg.auto_apply:
        return TICK_S
    return max(MIN_TICK_S, min(TICK_S, cfg.auto_apply_after_s / 4))


def build_planner(cfg: Config, setup: Setup, state: ServingState, workflows: WorkflowEngine,
                  state_dir: Path) -> Planner:
    from appliance.planner.planner import Planner, box_from_setup
    box = box_from_setup(setup, cfg.engine)
    state_dir.mkdir(parents=True, exist_ok=True)
    planner = Planner(cfg.planner, box, state_dir / "ledger.db", engine=cfg.engine,
                      profile_dir=state_dir / "profiles",
                      start_repartition=_repartition_starter(workflows),
                      model_name=state.model.name,
                      box_source=_live_box(cfg, setup, state, box.model),
                      workers_changing=_workers_changing(workflows),
                      served_name=lambda: state.model.name)
    planner.batch_tokens = setup.batch_tokens
    return planner


def start_planner(cfg: Config, setup: Setup, state: ServingState, workflows: WorkflowEngine,
                  state_dir: Path, registry: CollectorRegistry) -> Planner | None:
    """The planner with its gauges registered, or None (logged) when it cannot be
    built: a model we cannot size must not stop serving."""
    try:
        planner = build_planner(cfg, setup, state, workflows, state_dir)
    except Exception as exc:
        log.warning("capacity planner disabled: %s", exc)
        return None
    site = cfg.site
    labels = {"site": site.name, "appliance": site.appliance or socket.gethostname(),
              "simulated": "true" if setup.simulated else "false"}
    registry.register(PlannerCollector(planner, labels))
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


@contextlib.asynccontextmanager
async def running(planner: Planner):
    """The planner's background work while the daemon serves: its trend store's writer
    and its tick; on the way out the tick stops and the planner closes (in a thread)."""
    planner.trends.start()
    task = asyncio.create_task(_ticker(planner), name="planner")
    try:
        yield planner
    finally:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        await asyncio.get_running_loop().run_in_executor(None, planner.close)
