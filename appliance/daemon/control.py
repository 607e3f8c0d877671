"""The daemon's side of workflows: the `Machine` a workflow acts on, over the real worker
processes, the router and the serving state (`daemon.state`).

Every answer comes from what runs now (the pool's processes, the router's routing set),
which is what recovery compares a workflow's journal against. Every action is "ensure":
asking for what already holds does nothing.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.daemon.router import Trace
from appliance.daemon.state import context_limits
from appliance.daemon.workers import WorkerGone
from appliance.engines.messages import SamplingParams
from appliance.partitions import PartitionPlan, WorkerSlot
from appliance.workflows.machine import ModelRef, StepFailed, WorkerView

if TYPE_CHECKING:
    from appliance.config import Config
    from appliance.daemon.router import Router
    from appliance.daemon.setup import Setup
    from appliance.daemon.state import ServingState
    from appliance.daemon.workers import WorkerPool
    from appliance.telemetry.hub import Telemetry
    from appliance.workflows.journal import Journal

log = logging.getLogger("applianced.control")

LIVE = ("starting", "ready", "restarting")


class Control:
    def __init__(self, cfg: Config, setup: Setup, state: ServingState, pool: WorkerPool,
                 router: Router, journal: Journal, telemetry: Telemetry | None = None,
                 profile_dir: Path | None = None):
        self.cfg = cfg
        self.setup = setup
        self.state = state
        self.pool = pool
        self.router = router
        self.journal = journal
        self.telemetry = telemetry
        self.profile_dir = profile_dir      # device profiles (engine.max_batch_tokens = 0)
        self.inventory = setup.inventory

    # ---- what is ----------------------------------------------------------------
    def plan(self) -> PartitionPlan:
        return self.state.plan

    def served_model(self) -> ModelRef:
        return self.state.model.ref

    def workers(self) -> dict[str, WorkerView]:
        routed = self.router.routed
        return {n: WorkerView(n, w.role, tuple(w.spec.devices),
                              w.proc.pid if w.proc and w.proc.returncode is None else None,
                              w.state, n in routed, w.inflight,
                              (w.spec.model_dir, w.spec.model_spec))
                for n, w in self.pool.workers.items()}

    def admission_open(self) -> bool:
        return self.state.admission_open

    def inflight(self) -> int:
        return self.state.inflight

    def resolve_model(self, params: dict) -> ModelRef:
        """params: {"model": DIR or spec name} or {"model_spec": NAME}, optional
        "model_name". ValueError with one line when it cannot be served."""
        from appliance.models.specs import lookup_model_spec
        unknown = set(params) - {"model", "model_spec", "model_name"}
        if unknown:
            raise ValueError(f"unknown swap-model params {sorted(unknown)} "
                             "(expected model, model_spec, model_name)")
        target, spec = params.get("model"), params.get("model_spec")
        name = params.get("model_name")
        for key, value in (("model", target), ("model_spec", spec), ("model_name", name)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"params.{key} must be a non-empty string")
        if not target and not spec:
            raise ValueError("swap-model needs params.model (a checkpoint directory or a "
                             "model spec such as llama-3.1-8b) or params.model_spec")
        current = self.state.model.ref
        model_dir = current.model_dir
        if target:
            path = Path(target).expanduser()
            if path.is_dir():
                if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
                    raise ValueError(f"model directory {path} needs config.json and tokenizer.json")
                model_dir = str(path.resolve())
            elif spec is None:
                spec = target
            else:
                raise ValueError(f"model {target!r} is not a directory")
        if spec is not None:
            if self.setup.engine != "sim":
                raise ValueError(f"model spec {spec!r} shapes the simulator; the "
                                 f"{self.setup.engine} engine loads a checkpoint directory")
            try:
                lookup_model_spec(spec)
            except ValueError as exc:
                raise ValueError(f"{target or spec!r} is neither a model directory nor a known "
                                 f"model spec: {exc}") from None
        elif target and self.setup.engine == "sim":
            spec = None     # the simulator reads the directory's config.json
        name = name or spec or Path(model_dir).name
        return ModelRef(name, model_dir, spec)

    def health(self, names: list[str]) -> list[str]:
        problems = []
        pool = self.pool.workers
        for n in names:
            w = pool.get(n)
            if w is None:
                problems.append(f"worker {n} does not exist")
            elif w.state != "ready" or w.proc is None or w.proc.returncode is not None:
                problems.append(f"worker {n} is {w.state}")
        holders: dict[str, list[str]] = {}
        for w in pool.values():
            if w.state in LIVE:
                for d in w.spec.devices:
                    holders.setdefault(d, []).append(w.id)
        problems += [f"device {d} is held by {', '.join(ws)}" for d, ws in holders.items()
                     if len(ws) > 1 and not d.startswith("cpu")]
        return problems

    # ---- actions ----------------------------------------------------------------
    def set_plan(self, plan: PartitionPlan) -> None:
        self.state.plan = plan
        if self.telemetry is not None:
            from appliance.telemetry.setup import telemetry_workers
            try:
                self.telemetry.set_workers(telemetry_workers(
                    self.inventory, plan,
                    {n: w.spec.cpu_cores for n, w in self.pool.workers.items()}))
            except Exception:   # telemetry must never break a workflow step
                log.exception("telemetry: cannot follow the new partition")

    def set_admission(self, open_: bool) -> None:
        self.state.admission_open = open_

    def set_routing(self, names: list[str], model: ModelRef | None = None) -> None:
        if model is not None and model != self.state.model.ref:
            self.state.model.swap(model, context_limits(
                self.pool.workers[n] for n in names if n in self.pool.workers))
        self.router.set_routing(names)

    async def wait_idle(self, names: list[str] | None, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            if names is None:
                left = self.state.inflight
            else:
                left = sum(w.inflight + w.kv_holds
                           for n, w in self.pool.workers.items() if n in names)
            if not left or time.monotonic() >= deadline:
                return left
            await asyncio.sleep(0.05)

    async def ensure_stopped(self, names: list[str], reason: str) -> list[str]:
        pool, router = self.pool, self.router
        present = [n for n in names if n in pool.workers]
        router.set_routing(router.routed - set(present))
        await asyncio.gather(*(pool.remove(n, reason) for n in present))
        for n in present:
            self.journal.worker_stopped(n)
        router.refresh()
        return present

    def _spec(self, slot: WorkerSlot, model: ModelRef):
        """The WorkerSpec of a slot: the same derivation as at start-up (devices, peers,
        cores, the prefill token budget of its device when engine.max_batch_tokens is
        0), for the plan the slot belongs to."""
        from appliance.daemon.setup import StartupError, specs_for_plan
        plan = self.state.plan
        if not any(s.worker == slot.worker and s.devices == slot.devices for s in plan.workers()):
            others = [s for s in plan.workers() if s.worker != slot.worker
                      and not set(s.devices) & set(slot.devices)]
            plan = dataclasses.replace(
                plan, prefill=tuple(s for s in others if s.role == "prefill")
                + ((slot,) if slot.role == "prefill" else ()),
                decode=tuple(s for s in others if s.role == "decode")
                + ((slot,) if slot.role == "decode" else ()),
                agg=tuple(s for s in others if s.role == "agg") + ((slot,) if slot.role == "agg" else ()))
        cfg = dataclasses.replace(self.cfg, engine=dataclasses.replace(
            self.cfg.engine, model_spec=model.model_spec or ""))
        try:
            specs = specs_for_plan(cfg, self.inventory, plan, self.setup.engine,
                                   Path(model.model_dir), self.profile_dir)
        except StartupError as exc:
            raise StepFailed(str(exc)) from None
        return next(s for s in specs if s.worker == slot.worker)

    async def ensure_started(self, slots: list[WorkerSlot], model: ModelRef) -> list[str]:
        """Each slot's worker running on its devices with `model`; a worker of that name
        with other devices, role or model is stopped first. Returns the names started."""
        from appliance.daemon.setup import cluster_worker_roles
        pool = self.pool
        roles = cluster_worker_roles(self.cfg)     # a cluster box runs its role's workers only
        todo = []
        for slot in (s for s in slots if s.role in roles):
            w = pool.workers.get(slot.worker)
            if (w is not None and w.state in LIVE and w.role == slot.role
                    and tuple(w.spec.devices) == tuple(slot.devices)
                    and (w.spec.model_dir, w.spec.model_spec) == model.loads()):
                continue
            todo.append(slot)
        for slot in todo:
            if slot.worker in pool.workers:
                await self.ensure_stopped([slot.worker], f"worker {slot.worker} restarted "
                                                         f"to load {model.name}")
            busy = {d: w.id for w in pool.workers.values() if w.state in LIVE
                    for d in w.spec.devices}
            clash = [f"{d} (held by {busy[d]})" for d in slot.devices
                     if d in busy and not d.startswith("cpu")]
            if clash:
                raise StepFailed(f"cannot start {slot.worker}: devices {', '.join(clash)}")
        links = [pool.add(self._spec(slot, model)) for slot in todo]
        results = await asyncio.gather(*(link.start() for link in links), return_exceptions=True)
        failed = [(link, r) for link, r in zip(links, results) if isinstance(r, BaseException)]
        if failed:
            for link, _ in failed:
                await pool.remove(link.id)
            raise StepFailed("; ".join(str(r) for _, r in failed))
        self.router.refresh()
        return [link.id for link in links]

    async def warm_up(self, names: list[str]) -> dict:
        """One short greedy generation on each worker, straight to it (not routed): the
        engine answers and its first-request costs are paid before clients see it."""
        prompt = self.state.model.tokenizer.encode("warm up") or [0]
        out = {}
        for n in names:
            w = self.pool.workers.get(n)
            if w is None or not w.ready:
                raise StepFailed(f"worker {n} is not ready for its warm-up")
            t0 = time.monotonic()
            tokens = 0
            trace = Trace(f"warmup-{n}-{os.urandom(3).hex()}", time.time())
            try:
                async for new, _, _ in self.router._run_local(
                        trace, w, prompt, SamplingParams(max_tokens=2, temperature=0.0)):
                    tokens += len(new)
            except (WorkerGone, Exception) as exc:
                raise StepFailed(f"warm-up of {n} failed: {exc}") from None
            out[n] = {"tokens": tokens, "s": round(time.monotonic() - t0, 4)}
        return out


def kill_orphans(recorded: list[tuple[str, int, list[str], int]]) -> list[dict]:
    """Worker processes a previous daemon recorded that still run (PR_SET_PDEATHSIG
    should have killed them with it; this is the check, and the remedy if it did not):
    a live pid whose command line is an `applianced worker` for that name is killed."""
    killed = []
    for worker, pid, devices, daemon_pid in recorded:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"worker" in cmd and any(f'"worker":"{worker}"'.encode() in part for part in cmd):
            log.warning("worker %s (pid %d, devices %s) of the previous daemon (pid %d) "
                        "survived it: killing it", worker, pid, devices, daemon_pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append({"worker": worker, "pid": pid, "devices": devices})
    return killed
