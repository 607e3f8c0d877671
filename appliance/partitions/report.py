"""How an inventory and its plan are shown: a table for people, a dict for the CLI's --json."""

from __future__ import annotations

from collections import Counter
from typing import Any

from appliance.partitions.devices import NVLINK, Device, Inventory
from appliance.partitions.plan import PartitionPlan

_GIB = 1024**3


def inventory_json(inv: Inventory, plan: PartitionPlan | None) -> dict[str, Any]:
    return {
        "devices": [d.to_json() for d in inv.devices],
        "plan": plan.to_json() if plan is not None else None,
        "note": inv.note,
        "source": inv.source,
    }


def format_devices(inv: Inventory, plan: PartitionPlan | None) -> str:
    """Devices, the fallback note, NVLink islands, then one line per worker and the reason.

    `plan` may be None so the devices can still be shown when planning failed.
    """
    rows = [("ID", "KIND", "NAME", "MEMORY", "")]
    rows += [(d.id, d.kind, d.name, _memory(d), _marks(d)) for d in inv.devices]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}".rstrip()
        for r in rows
    ]
    if inv.note:
        lines.append(f"note: {inv.note}")
    lines.append(f"links: {_links_summary(inv)}")
    if plan is not None:
        lines.append(f"plan: {plan.mode}, tp={plan.tp}")
        width = max((len(s.worker) for s in plan.workers()), default=0)
        lines += [f"  {s.worker:<{width}}  {' '.join(s.devices)}" for s in plan.workers()]
        lines.append(f"reason: {plan.reason}")
    return "\n".join(lines)


def _memory(d: Device) -> str:
    return f"{d.memory_bytes / _GIB:.1f} GiB" if d.memory_bytes else "-"


def _marks(d: Device) -> str:
    marks = []
    if d.simulated:
        marks.append("(simulated)")
    if d.lost:
        marks.append("LOST")
    if d.mig_enabled:
        marks.append("MIG")
    if d.kind == "cpu":
        marks.append(f"{d.cores} cores")
    if d.kind == "gpu" and not d.lost and d.spec is None:
        marks.append("(not in catalogue)")
    return " ".join(marks)


def _links_summary(inv: Inventory) -> str:
    if not inv.links:
        return "none"
    islands = [island for island in inv.islands() if len(island) > 1]
    text = "NVLink islands " + " ".join("[" + " ".join(i) + "]" for i in islands) if islands else "no NVLink"
    others = Counter(kind for kind in inv.links.values() if kind != NVLINK)
    if others:
        text += "; other pairs: " + ", ".join(f"{n} {kind}" for kind, n in sorted(others.items()))
    return text
