"""What a workflow sees of the appliance: the `Machine` protocol, and partitions as data.

The daemon implements `Machine` over its real worker processes and router
(`appliance.daemon.control`); workflows only call it. Every query answers from the live
state (processes that exist now, the routing set in force now), never from the journal:
that is what lets recovery check reality instead of trusting what was recorded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from appliance.partitions import Inventory, PartitionPlan, WorkerSlot, plan_partition
from appliance.partitions.plan import PlanError


class StepFailed(Exception):
    """A step could not reach its goal; one line. The workflow compensates."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The served model: what the workers load and what /v1/models calls it."""

    name: str
    model_dir: str
    model_spec: str | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "model_dir": self.model_dir, "model_spec": self.model_spec}

    @classmethod
    def from_json(cls, data: dict) -> "ModelRef":
        return cls(data["name"], data["model_dir"], data.get("model_spec"))

    def loads(self) -> tuple[str, str | None]:
        """What a worker has loaded (the name is the router's business)."""
        return (self.model_dir, self.model_spec)


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker: str
    role: str
    devices: tuple[str, ...]
    pid: int | None
    state: str                  # starting | ready | restarting | stopped | failed
    routed: bool
    inflight: int
    loads: tuple[str, str | None]   # (model_dir, model_spec) the process was started with


class Machine(Protocol):
    inventory: Inventory

    def plan(self) -> PartitionPlan: ...
    def served_model(self) -> ModelRef: ...
    def workers(self) -> dict[str, WorkerView]: ...
    def resolve_model(self, params: dict) -> ModelRef: ...
    def admission_open(self) -> bool: ...
    def set_admission(self, open_: bool) -> None: ...
    def inflight(self) -> int: ...
    def health(self, names: list[str]) -> list[str]: ...
    def set_plan(self, plan: PartitionPlan) -> None: ...
    def set_routing(self, names: list[str], model: ModelRef | None = None) -> None: ...
    async def wait_idle(self, names: list[str] | None, timeout: float) -> int: ...
    async def ensure_stopped(self, names: list[str], reason: str) -> list[str]: ...
    async def ensure_started(self, slots: list[WorkerSlot], model: ModelRef) -> list[str]: ...
    async def warm_up(self, names: list[str]) -> dict: ...


# ---- partitions as data ---------------------------------------------------------

def plan_to_json(plan: PartitionPlan) -> dict:
    return plan.to_json()


def plan_from_json(data: dict) -> PartitionPlan:
    def slots(role: str) -> tuple[WorkerSlot, ...]:
        return tuple(WorkerSlot(s["worker"], role, tuple(s["devices"])) for s in data.get(role, []))
    return PartitionPlan(mode=data["mode"], prefill=slots("prefill"), decode=slots("decode"),
                         agg=slots("agg"), tp=int(data["tp"]), reason=data.get("reason", ""))


def split_of(plan: PartitionPlan) -> str:
    return f"{len(plan.prefill)}+{len(plan.decode)}" if plan.mode == "disagg" \
        else f"{len(plan.agg)} agg"


def slot_key(slot: WorkerSlot) -> tuple:
    return (slot.worker, slot.role, tuple(slot.devices))


def replan(current: PartitionPlan, inv: Inventory, split: str) -> PartitionPlan:
    """The plan for `split`, with the names of the workers that keep their role and
    devices unchanged (so they keep serving through the change), and fresh names for
    the others that collide with no name in use. Raises PlanError (one line)."""
    if current.mode != "disagg":
        raise PlanError("repartition moves devices between prefill and decode: the "
                        f"appliance runs in {current.mode} mode")
    fresh = plan_partition(inv, tp=current.tp, split=split, mode="disagg")
    kept = {(s.role, tuple(s.devices)): s.worker for s in current.workers()}
    taken = {s.worker for s in current.workers()}
    out: dict[str, list[WorkerSlot]] = {"prefill": [], "decode": []}
    pending = []
    for slot in fresh.workers():
        name = kept.get((slot.role, tuple(slot.devices)))
        if name is None:
            pending.append(slot)
        else:
            out[slot.role].append(WorkerSlot(name, slot.role, tuple(slot.devices)))
    for slot in pending:
        k = 0
        while f"{slot.role}{k}" in taken:
            k += 1
        taken.add(f"{slot.role}{k}")
        out[slot.role].append(WorkerSlot(f"{slot.role}{k}", slot.role, tuple(slot.devices)))
    return PartitionPlan(mode="disagg", prefill=tuple(out["prefill"]), decode=tuple(out["decode"]),
                         agg=(), tp=current.tp, reason=fresh.reason + " (repartitioned)")
