"""The workflows an operator can start: repartition, swap-model, drain, resume.

Each step is written as "ensure X" and comes with `holds_<step>`: does X hold in the
machine right now? The engine runs a step, and on recovery asks `holds_` of every step
in order: a step whose goal holds is skipped, the first whose goal does not is redone
(the daemon that died took its worker processes with it, so a step recorded as done
may have been undone by the crash). Compensation steps are ensure-steps too, towards
the state before the workflow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.partitions.plan import PlanError
from appliance.workflows.machine import (
    Machine, ModelRef, StepFailed, plan_from_json, plan_to_json, replan, slot_key, split_of,
)


@dataclass
class Outcome:
    """A step's observed result, and appliance state to persist with it (same commit)."""

    result: Any
    state: dict = field(default_factory=dict)


class Kind:
    kind = ""
    exclusive = ""          # workflows of one class run one at a time
    steps: list[str] = []
    undo_steps: list[str] = []

    def __init__(self, options: "Options"):
        self.options = options

    def prepare(self, params: dict, m: Machine) -> dict:
        """Check the parameters against the machine; the context every step reads.
        Raises ValueError with one line."""
        raise NotImplementedError

    def intent(self, step: str, ctx: dict) -> dict:
        return {"step": step}

    async def run(self, step: str, ctx: dict, m: Machine, wid: str) -> Outcome:
        out = await getattr(self, f"run_{step}")(ctx, m, wid)
        return out if isinstance(out, Outcome) else Outcome(out)

    def holds(self, step: str, ctx: dict, m: Machine, persisted: dict) -> tuple[bool, str]:
        return getattr(self, f"holds_{step}")(ctx, m, persisted)

    def still_valid(self, ctx: dict, m: Machine) -> str | None:
        """After a restart: None, or why the workflow can no longer go forward."""
        return None


@dataclass
class Options:
    drain_timeout_s: float = 30.0


def _served(ctx: dict, key: str) -> ModelRef:
    return ModelRef.from_json(ctx[key])


# ---- repartition ------------------------------------------------------------------

class Repartition(Kind):
    """Move devices between the prefill and decode groups. Workers whose role and
    devices do not change keep their names and serve throughout."""

    kind = "repartition"
    exclusive = "workers"
    steps = ["validate", "drain_affected", "wait_inflight", "stop_affected", "start_new",
             "warm_up", "health_check", "switch_routing", "persist"]
    undo_steps = ["undo_route_old", "undo_stop_new", "undo_start_old", "undo_route_all",
                  "undo_persist"]

    def prepare(self, params: dict, m: Machine) -> dict:
        split = params.get("split")
        if not isinstance(split, str) or not split.strip():
            raise ValueError("repartition needs params.split, e.g. \"6+2\"")
        old = m.plan()
        try:
            new = replan(old, m.inventory, split)
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        old_keys = {slot_key(s) for s in old.workers()}
        new_keys = {slot_key(s) for s in new.workers()}
        if old_keys == new_keys:
            raise ValueError(f"the appliance already runs split {split_of(old)}")
        return {"split": split_of(new), "old": plan_to_json(old), "new": plan_to_json(new),
                "affected": sorted(s.worker for s in old.workers() if slot_key(s) not in new_keys),
                "added": sorted(s.worker for s in new.workers() if slot_key(s) not in old_keys)}

    def still_valid(self, ctx, m):
        known = {d.id for d in m.inventory.devices}
        missing = {d for s in plan_from_json(ctx["new"]).workers() for d in s.devices} - known
        return f"devices {sorted(missing)} are gone" if missing else None

    def intent(self, step, ctx):
        what = {"drain_affected": ctx["affected"], "wait_inflight": ctx["affected"],
                "stop_affected": ctx["affected"], "start_new": ctx["added"],
                "warm_up": ctx["added"], "health_check": ctx["added"],
                "switch_routing": [s["worker"] for r in ("prefill", "decode")
                                   for s in ctx["new"][r]],
                "persist": ctx["split"]}.get(step)
        return {"step": step, "workers": what} if what is not None else {"step": step}

    @staticmethod
    def _new_slots(ctx, names=None):
        return [s for s in plan_from_json(ctx["new"]).workers()
                if names is None or s.worker in names]

    @staticmethod
    def _running(m: Machine, slots) -> list[str]:
        live = m.workers()
        return [s.worker for s in slots if s.worker in live
                and live[s.worker].devices == tuple(s.devices) and live[s.worker].role == s.role
                and live[s.worker].state in ("ready", "starting", "restarting")]

    # validate: pure; its result is the context
    async def run_validate(self, ctx, m, wid):
        return {"old": split_of(plan_from_json(ctx["old"])), "new": ctx["split"],
                "affected": ctx["affected"], "added": ctx["added"]}

    def holds_validate(self, ctx, m, persisted):
        return True, "context recorded"

    async def run_drain_affected(self, ctx, m, wid):
        live = m.workers()
        keep = [n for n, w in live.items() if w.routed and n not in ctx["affected"]]
        m.set_routing(keep)
        return {"routed": sorted(keep)}

    def holds_drain_affected(self, ctx, m, persisted):
        live = m.workers()
        routed = [n for n in ctx["affected"] if n in live and live[n].routed
                  and live[n].devices == _old_devices(ctx, n)]
        return (not routed, f"still routed: {routed}" if routed else "affected workers not routed")

    async def run_wait_inflight(self, ctx, m, wid):
        left = await m.wait_idle(ctx["affected"], self.options.drain_timeout_s)
        if left:
            return {"timed_out": True, "inflight": left,
                    "note": f"{left} request(s) still in flight after "
                            f"{self.options.drain_timeout_s:g}s are cut off when their "
                            "workers stop (503 worker_failed)"}
        return {"inflight": 0}

    def holds_wait_inflight(self, ctx, m, persisted):
        ok, why = self.holds_drain_affected(ctx, m, persisted)
        return ok, why

    async def run_stop_affected(self, ctx, m, wid):
        stopped = await m.ensure_stopped(ctx["affected"], f"stopped by workflow {wid} "
                                                          f"(repartition to {ctx['split']})")
        return {"stopped": stopped}

    def holds_stop_affected(self, ctx, m, persisted):
        live = m.workers()
        left = [n for n in ctx["affected"] if n in live and live[n].devices == _old_devices(ctx, n)]
        return not left, f"still running: {left}" if left else "affected workers gone"

    async def run_start_new(self, ctx, m, wid):
        try:
            started = await m.ensure_started(self._new_slots(ctx, ctx["added"]), m.served_model())
        except StepFailed:
            raise
        except Exception as exc:
            raise StepFailed(str(exc)) from None
        return {"started": started,
                "pids": {n: m.workers()[n].pid for n in ctx["added"] if n in m.workers()}}

    def holds_start_new(self, ctx, m, persisted):
        slots = self._new_slots(ctx, ctx["added"])
        missing = sorted(set(ctx["added"]) - set(self._running(m, slots)))
        return not missing, f"not running: {missing}" if missing else "new workers running"

    async def run_warm_up(self, ctx, m, wid):
        return await m.warm_up(ctx["added"])

    def holds_warm_up(self, ctx, m, persisted):
        # A warm-up is cheap and proves the engine answers: redo it after any restart
        # unless the new workers are already serving.
        return self.holds_switch_routing(ctx, m, persisted)

    async def run_health_check(self, ctx, m, wid):
        problems = m.health(ctx["added"])
        if problems:
            raise StepFailed("; ".join(problems))
        return {"healthy": ctx["added"]}

    def holds_health_check(self, ctx, m, persisted):
        return self.holds_switch_routing(ctx, m, persisted)

    async def run_switch_routing(self, ctx, m, wid):
        names = [s.worker for s in self._new_slots(ctx)]
        m.set_routing(names)
        m.set_plan(plan_from_json(ctx["new"]))
        return {"routed": names}

    def holds_switch_routing(self, ctx, m, persisted):
        want = self._new_slots(ctx)
        live = m.workers()
        routed = sorted(n for n, w in live.items() if w.routed)
        ok = routed == sorted(s.worker for s in want) and len(self._running(m, want)) == len(want)
        return ok, f"routed: {routed}"

    async def run_persist(self, ctx, m, wid):
        return Outcome({"partition": ctx["split"]}, {"partition": ctx["new"]})

    def holds_persist(self, ctx, m, persisted):
        ok = _same_plan(persisted.get("partition"), ctx["new"])
        return ok, "persisted" if ok else "persisted partition is not the new one"

    # ---- compensation: back to the old partition ------------------------------
    async def run_undo_route_old(self, ctx, m, wid):
        old = plan_from_json(ctx["old"])
        running = self._running(m, old.workers())
        m.set_routing(running)
        m.set_plan(old)
        return {"routed": running}

    def holds_undo_route_old(self, ctx, m, persisted):
        live = m.workers()
        stray = [n for n in ctx["added"] if n in live and live[n].routed]
        return not stray, f"new workers still routed: {stray}" if stray else "ok"

    async def run_undo_stop_new(self, ctx, m, wid):
        return {"stopped": await m.ensure_stopped(ctx["added"], f"stopped by workflow {wid} "
                                                                "(repartition rolled back)")}

    def holds_undo_stop_new(self, ctx, m, persisted):
        left = [n for n in ctx["added"] if n in m.workers()]
        return not left, f"still running: {left}" if left else "ok"

    async def run_undo_start_old(self, ctx, m, wid):
        slots = [s for s in plan_from_json(ctx["old"]).workers() if s.worker in ctx["affected"]]
        try:
            return {"started": await m.ensure_started(slots, m.served_model())}
        except Exception as exc:
            raise StepFailed(str(exc)) from None

    def holds_undo_start_old(self, ctx, m, persisted):
        old = plan_from_json(ctx["old"]).workers()
        missing = sorted({s.worker for s in old} - set(self._running(m, old)))
        return not missing, f"not running: {missing}" if missing else "ok"

    async def run_undo_route_all(self, ctx, m, wid):
        names = [s.worker for s in plan_from_json(ctx["old"]).workers()]
        m.set_routing(names)
        return {"routed": names}

    def holds_undo_route_all(self, ctx, m, persisted):
        routed = sorted(n for n, w in m.workers().items() if w.routed)
        want = sorted(s.worker for s in plan_from_json(ctx["old"]).workers())
        return routed == want, f"routed: {routed}"

    async def run_undo_persist(self, ctx, m, wid):
        return Outcome({"partition": split_of(plan_from_json(ctx["old"]))}, {"partition": ctx["old"]})

    def holds_undo_persist(self, ctx, m, persisted):
        p = persisted.get("partition")
        return p is None or _same_plan(p, ctx["old"]), "persisted"


def _old_devices(ctx, name) -> tuple[str, ...] | None:
    for s in plan_from_json(ctx["old"]).workers():
        if s.worker == name:
            return tuple(s.devices)
    return None


def _same_plan(a: dict | None, b: dict) -> bool:
    if a is None:
        return False
    ka = {slot_key(s) for s in plan_from_json(a).workers()}
    return ka == {slot_key(s) for s in plan_from_json(b).workers()}


# ---- swap-model ----------------------------------------------------------------------

class SwapModel(Kind):
    """Serve another model without going dark: half the workers load it while the
    other half serve the old one, routing switches, then the rest load it."""

    kind = "swap-model"
    exclusive = "workers"
    steps = ["validate", "drain_first", "wait_first", "load_first", "switch_routing",
             "wait_second", "load_second", "route_all", "persist"]
    undo_steps = ["undo_route_old", "undo_reload", "undo_route_all", "undo_persist"]

    def prepare(self, params, m):
        new = m.resolve_model(params)
        old = m.served_model()
        if new.loads() == old.loads() and new.name == old.name:
            raise ValueError(f"the appliance already serves {old.name}")
        plan = m.plan()
        groups = [g for g in (plan.prefill, plan.decode, plan.agg) if g]
        if all(len(g) >= 2 for g in groups):
            first = [s.worker for g in groups for s in g[:len(g) // 2]]
        else:
            first = [s.worker for g in groups for s in g]   # one worker of a role: no overlap
        second = [s.worker for s in plan.workers() if s.worker not in first]
        return {"old": old.to_json(), "new": new.to_json(), "first": first, "second": second,
                "plan": plan_to_json(plan)}

    def intent(self, step, ctx):
        group = {"drain_first": "first", "wait_first": "first", "load_first": "first",
                 "switch_routing": "first", "wait_second": "second",
                 "load_second": "second"}.get(step)
        out = {"step": step, "model": ctx["new"]["name"]}
        if group:
            out["workers"] = ctx[group]
        return out

    @staticmethod
    def _loaded(m, names, model: ModelRef) -> list[str]:
        live = m.workers()
        return [n for n in names if n in live and live[n].loads == model.loads()
                and live[n].state in ("ready", "starting", "restarting")]

    async def run_validate(self, ctx, m, wid):
        return {"old": ctx["old"]["name"], "new": ctx["new"]["name"],
                "first": ctx["first"], "second": ctx["second"]}

    def holds_validate(self, ctx, m, persisted):
        return True, "context recorded"

    async def run_drain_first(self, ctx, m, wid):
        keep = [n for n, w in m.workers().items() if w.routed and n not in ctx["first"]]
        m.set_routing(keep)
        return {"routed": sorted(keep),
                "note": None if keep else "one worker per role: the appliance answers 503 "
                                          "until the new model is loaded"}

    def holds_drain_first(self, ctx, m, persisted):
        new = _served(ctx, "new")
        live = m.workers()
        bad = [n for n in ctx["first"] if n in live and live[n].routed
               and live[n].loads != new.loads()]
        return not bad, f"still routed with the old model: {bad}" if bad else "ok"

    async def run_wait_first(self, ctx, m, wid):
        left = await m.wait_idle(ctx["first"], self.options.drain_timeout_s)
        return {"inflight": left, "timed_out": bool(left)}

    def holds_wait_first(self, ctx, m, persisted):
        return self.holds_drain_first(ctx, m, persisted)

    async def _load(self, names, ctx, m, wid, model: ModelRef):
        plan = plan_from_json(ctx["plan"])
        slots = [s for s in plan.workers() if s.worker in names]
        try:
            return await m.ensure_started(slots, model)
        except Exception as exc:
            raise StepFailed(str(exc)) from None

    async def run_load_first(self, ctx, m, wid):
        started = await self._load(ctx["first"], ctx, m, wid, _served(ctx, "new"))
        return {"loaded": started, "warm": await m.warm_up(ctx["first"])}

    def holds_load_first(self, ctx, m, persisted):
        miss = sorted(set(ctx["first"]) - set(self._loaded(m, ctx["first"], _served(ctx, "new"))))
        return not miss, f"not on the new model: {miss}" if miss else "ok"

    async def run_switch_routing(self, ctx, m, wid):
        m.set_routing(ctx["first"], _served(ctx, "new"))
        return {"routed": ctx["first"], "model": ctx["new"]["name"]}

    def holds_switch_routing(self, ctx, m, persisted):
        new = _served(ctx, "new")
        live = m.workers()
        routed = [n for n, w in live.items() if w.routed]
        ok = (m.served_model() == new and routed
              and all(live[n].loads == new.loads() for n in routed))
        return bool(ok), f"serving {m.served_model().name}, routed {sorted(routed)}"

    async def run_wait_second(self, ctx, m, wid):
        left = await m.wait_idle(ctx["second"], self.options.drain_timeout_s)
        return {"inflight": left, "timed_out": bool(left)}

    def holds_wait_second(self, ctx, m, persisted):
        return self.holds_switch_routing(ctx, m, persisted)

    async def run_load_second(self, ctx, m, wid):
        started = await self._load(ctx["second"], ctx, m, wid, _served(ctx, "new"))
        return {"loaded": started, "unloaded_old": True}

    def holds_load_second(self, ctx, m, persisted):
        new = _served(ctx, "new")
        miss = sorted(set(ctx["second"]) - set(self._loaded(m, ctx["second"], new)))
        return not miss and self.holds_switch_routing(ctx, m, persisted)[0], \
            f"not on the new model: {miss}" if miss else "ok"

    async def run_route_all(self, ctx, m, wid):
        names = ctx["first"] + ctx["second"]
        m.set_routing(names, _served(ctx, "new"))
        return {"routed": names}

    def holds_route_all(self, ctx, m, persisted):
        names = ctx["first"] + ctx["second"]
        new = _served(ctx, "new")
        routed = sorted(n for n, w in m.workers().items() if w.routed)
        ok = routed == sorted(names) and len(self._loaded(m, names, new)) == len(names) \
            and m.served_model() == new
        return ok, f"routed {routed}"

    async def run_persist(self, ctx, m, wid):
        return Outcome({"model": ctx["new"]["name"]}, {"model": ctx["new"]})

    def holds_persist(self, ctx, m, persisted):
        return persisted.get("model") == ctx["new"], "persisted model"

    # ---- compensation: back to the old model ---------------------------------------
    async def run_undo_route_old(self, ctx, m, wid):
        old = _served(ctx, "old")
        names = self._loaded(m, ctx["first"] + ctx["second"], old)
        m.set_routing(names, old)
        return {"routed": names}

    def holds_undo_route_old(self, ctx, m, persisted):
        return m.served_model() == _served(ctx, "old"), f"serving {m.served_model().name}"

    async def run_undo_reload(self, ctx, m, wid):
        names = ctx["first"] + ctx["second"]
        return {"loaded": await self._load(names, ctx, m, wid, _served(ctx, "old"))}

    def holds_undo_reload(self, ctx, m, persisted):
        names = ctx["first"] + ctx["second"]
        return len(self._loaded(m, names, _served(ctx, "old"))) == len(names), "ok"

    async def run_undo_route_all(self, ctx, m, wid):
        names = ctx["first"] + ctx["second"]
        m.set_routing(names, _served(ctx, "old"))
        return {"routed": names}

    def holds_undo_route_all(self, ctx, m, persisted):
        routed = sorted(n for n, w in m.workers().items() if w.routed)
        return routed == sorted(ctx["first"] + ctx["second"]), f"routed {routed}"

    async def run_undo_persist(self, ctx, m, wid):
        return Outcome({"model": ctx["old"]["name"]}, {"model": ctx["old"]})

    def holds_undo_persist(self, ctx, m, persisted):
        p = persisted.get("model")
        return p is None or p == ctx["old"], "persisted"


# ---- drain / resume ---------------------------------------------------------------

class Drain(Kind):
    """Stop taking new requests (503 + Retry-After), let in-flight ones finish. The
    closed admission is persisted: a daemon restarted for maintenance stays drained."""

    kind = "drain"
    exclusive = "admission"
    steps = ["close_admission", "persist", "wait_inflight"]
    undo_steps = ["undo_open_admission", "undo_persist"]

    def prepare(self, params, m):
        if params:
            raise ValueError(f"drain takes no params, got {sorted(params)}")
        return {}

    async def run_close_admission(self, ctx, m, wid):
        m.set_admission(False)
        return {"admission": "closed", "inflight": m.inflight()}

    def holds_close_admission(self, ctx, m, persisted):
        return not m.admission_open(), "admission closed" if not m.admission_open() else "open"

    async def run_persist(self, ctx, m, wid):
        return Outcome({"admission": "closed"}, {"admission": "closed"})

    def holds_persist(self, ctx, m, persisted):
        return persisted.get("admission") == "closed", "persisted"

    async def run_wait_inflight(self, ctx, m, wid):
        left = await m.wait_idle(None, self.options.drain_timeout_s)
        if left:
            raise StepFailed(f"{left} request(s) still in flight after "
                             f"{self.options.drain_timeout_s:g}s (workflows.drain_timeout_s)")
        return {"drained": True}

    def holds_wait_inflight(self, ctx, m, persisted):
        return m.inflight() == 0 and not m.admission_open(), f"{m.inflight()} in flight"

    async def run_undo_open_admission(self, ctx, m, wid):
        m.set_admission(True)
        return {"admission": "open"}

    def holds_undo_open_admission(self, ctx, m, persisted):
        return m.admission_open(), "open"

    async def run_undo_persist(self, ctx, m, wid):
        return Outcome({"admission": "open"}, {"admission": "open"})

    def holds_undo_persist(self, ctx, m, persisted):
        return persisted.get("admission", "open") == "open", "persisted"


class Resume(Kind):
    kind = "resume"
    exclusive = "admission"
    steps = ["open_admission", "persist"]
    undo_steps: list[str] = []

    def prepare(self, params, m):
        if params:
            raise ValueError(f"resume takes no params, got {sorted(params)}")
        return {}

    async def run_open_admission(self, ctx, m, wid):
        m.set_admission(True)
        return {"admission": "open"}

    def holds_open_admission(self, ctx, m, persisted):
        return m.admission_open(), "open" if m.admission_open() else "closed"

    async def run_persist(self, ctx, m, wid):
        return Outcome({"admission": "open"}, {"admission": "open"})

    def holds_persist(self, ctx, m, persisted):
        return persisted.get("admission", "open") == "open", "persisted"


KINDS: dict[str, type[Kind]] = {k.kind: k for k in (Repartition, SwapModel, Drain, Resume)}
