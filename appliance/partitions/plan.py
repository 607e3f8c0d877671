"""Decide which devices each worker gets: the partition plan.

Only a decision, no processes: the daemon reads the plan and starts one worker per slot.
The rules follow what the disaggregated stacks do on one node (Dynamo runs gpt-oss-120b
as 4 prefill GPUs + 4 decode GPUs on an 8xH100 box): split the workers half and half,
keep every tensor-parallel group inside one NVLink island, and keep each phase's GPUs
together so its pool is one contiguous block.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from appliance.partitions.devices import NVLINK, Device, Inventory

MODES = ("disagg", "agg")
log = logging.getLogger("applianced.partitions")

_SPLIT = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


class PlanError(ValueError):
    """The requested partition cannot be built; the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    worker: str  # "prefill0", "decode0", "agg0", ...
    role: str  # "prefill" | "decode" | "agg"
    devices: tuple[str, ...]  # device ids


@dataclass(frozen=True)
class PartitionPlan:
    mode: str  # "disagg" | "agg"
    prefill: tuple[WorkerSlot, ...]  # disagg only; empty in agg mode
    decode: tuple[WorkerSlot, ...]  # disagg only; empty in agg mode
    agg: tuple[WorkerSlot, ...]  # agg only; empty in disagg mode
    tp: int
    reason: str  # one line explaining the choice

    def workers(self) -> tuple[WorkerSlot, ...]:
        return self.prefill + self.decode + self.agg

    def to_json(self) -> dict[str, Any]:
        def slots(group: tuple[WorkerSlot, ...]) -> list[dict[str, Any]]:
            return [{"worker": s.worker, "devices": list(s.devices)} for s in group]

        return {
            "mode": self.mode,
            "prefill": slots(self.prefill),
            "decode": slots(self.decode),
            "agg": slots(self.agg),
            "tp": self.tp,
            "reason": self.reason,
        }


def plan_partition(inv: Inventory, tp: int = 1, split: str = "auto", mode: str = "disagg",
                   cpu_threads: int = 0) -> PartitionPlan:
    """Plan workers over the inventory's usable GPUs (lost ones excluded), or the CPU.

    disagg: W = N/tp workers, P = W//2 prefill and the rest decode, unless `split` is
    "P+D" (worker counts; may leave devices idle, and then N need not divide by tp).
    agg: W workers that each run both phases; on the CPU one with every core, or with
    `cpu_threads` = T (engine.cpu_threads) one per T cores.
    """
    if mode not in MODES:
        raise PlanError(f"unknown mode {mode!r}: expected 'disagg' or 'agg'")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp must be a whole number >= 1, got {tp!r}")
    manual = None if split.strip().lower() == "auto" else _parse_split(split)
    if mode == "agg" and manual is not None:
        raise PlanError(f"split {split!r} applies to disagg mode only; agg mode uses every device")

    gpus = [d for d in inv.devices if d.is_gpu and not d.lost and not d.mig_enabled]
    lost = sum(1 for d in inv.devices if d.is_gpu and d.lost)
    mig = [d for d in inv.devices if d.is_gpu and not d.lost and d.mig_enabled]
    mig_note = mig_warning(mig)
    if mig_note:
        log.warning("%s", mig_note)
    if not gpus:
        cpu = next((d for d in inv.devices if d.kind == "cpu"), None)
        if cpu is None:
            what = f"all {lost} GPU(s) are lost" if lost else "the inventory is empty"
            if mig:
                what = mig_note
            raise PlanError(f"no usable devices: {what}")
        return _cpu_plan(cpu, tp, manual, mode, cpu_threads)

    n = len(gpus)
    if tp > n:
        raise PlanError(f"tp={tp} needs {tp} devices per worker, only {n} usable exist")
    if manual is None and n % tp:
        raise PlanError(
            f"{n} usable devices are not divisible by tp={tp}; choose a tp that divides {n} "
            "or a manual split that leaves devices idle"
        )

    label = f"{n} {'simulated ' if all(d.simulated for d in gpus) else ''}GPU{'s' if n != 1 else ''}"
    if mode == "agg":
        workers = n // tp
        counts = f"{workers} agg worker{'s' if workers != 1 else ''}"
        prefill_n, decode_n = 0, 0
    elif manual is None:
        workers = n // tp
        if workers < 2:
            smaller = " or a smaller tp" if tp > 1 else ""
            raise PlanError(
                f"disagg needs at least 2 workers, but {n} device(s) at tp={tp} make {workers}; "
                f"use --mode agg{smaller}"
            )
        prefill_n = workers // 2
        decode_n = workers - prefill_n
        counts = f"{prefill_n} prefill + {decode_n} decode (default half/half, odd rounds toward decode)"
    else:
        prefill_n, decode_n = manual
        workers = prefill_n + decode_n
        need = workers * tp
        if need > n:
            raise PlanError(f"split {prefill_n}+{decode_n} at tp={tp} needs {need} devices, only {n} exist")
        counts = f"{prefill_n} prefill + {decode_n} decode (manual split"
        counts += f", uses {need} of {n} devices, {n - need} idle)" if need < n else ")"

    islands = _usable_islands(inv, gpus)
    groups, spanning = _pack(islands, tp, workers)
    phase_note = None
    if mode == "disagg":
        groups, spanning, phase_note = _by_phase_economics(groups, spanning, prefill_n,
                                                           {d.id: d for d in gpus})
    if mode == "agg":
        agg = tuple(WorkerSlot(f"agg{i}", "agg", g) for i, g in enumerate(groups))
        prefill: tuple[WorkerSlot, ...] = ()
        decode: tuple[WorkerSlot, ...] = ()
    else:
        agg = ()
        prefill = tuple(WorkerSlot(f"prefill{i}", "prefill", g) for i, g in enumerate(groups[:prefill_n]))
        decode = tuple(WorkerSlot(f"decode{i}", "decode", g) for i, g in enumerate(groups[prefill_n:]))

    parts = [f"{label}, tp={tp}: {counts}"]
    if phase_note:
        parts.append(phase_note)
    parts += _topology_notes(inv, islands, tp, prefill, decode, agg, spanning)
    if lost:
        parts.append(f"{lost} lost GPU{'s' if lost != 1 else ''} excluded")
    if mig_note:
        parts.append(mig_note)
    return PartitionPlan(mode=mode, prefill=prefill, decode=decode, agg=agg, tp=tp, reason="; ".join(parts))


def mig_warning(mig: list[Device]) -> str | None:
    """One line for MIG-enabled GPUs, which the plan leaves out: their memory and SMs
    belong to MIG instances, addressed by MIG UUIDs; CUDA shows no device under the
    parent's UUID, so a worker planned on it would find no GPU."""
    if not mig:
        return None
    ids = ", ".join(d.id for d in mig)
    return (f"{len(mig)} MIG-enabled GPU{'s' if len(mig) != 1 else ''} excluded ({ids}): "
            "applianced does not plan MIG instances; disable MIG to use "
            f"{'them' if len(mig) != 1 else 'it'} (nvidia-smi -i <index> -mig 0, then a GPU reset)")


def check_engine(plan: PartitionPlan, engine: str) -> None:
    """Refuse, at planning time, what an engine cannot run: the torch engine has no tensor
    parallelism (it would silently use one GPU of each worker's group)."""
    if engine == "torch" and plan.tp > 1:
        raise PlanError(f"engine = torch runs one GPU per worker (no tensor parallelism), but "
                        f"devices.tp = {plan.tp}: set tp = 1, or use engine = trtllm")


def phase_economics(spec) -> dict[str, float]:
    """What a GPU type offers each phase per dollar (catalogue figures): prefill is
    compute-bound (dense BF16 FLOP/s per $/h), decode bandwidth-bound (bytes/s per $/h)."""
    usd = spec.usd_per_hour or float("nan")
    return {"flops_per_usd": spec.flops_bf16 / usd, "bandwidth_per_usd": spec.mem_bw / usd,
            "flops_per_bandwidth": spec.flops_bf16 / spec.mem_bw}


def rank_for_prefill(specs) -> tuple[list, str]:
    """GPU types ordered from the best prefill choice to the best decode choice, and why.

    Splitwise (Patel et al., ISCA 2024): put the highest FLOP/s per $ on prefill and the
    highest memory bandwidth per $ on decode. When one type is best at both, the one
    with the most FLOP/s per byte/s (a price-free comparative advantage) takes prefill."""
    specs = list({s.name: s for s in specs}.values())
    econ = {s.name: phase_economics(s) for s in specs}
    top_f = max(specs, key=lambda s: econ[s.name]["flops_per_usd"])
    top_b = max(specs, key=lambda s: econ[s.name]["bandwidth_per_usd"])
    if top_f is not top_b:
        order = sorted(specs, key=lambda s: -econ[s.name]["flops_per_usd"])
        rule = "highest FLOP/s per $ on prefill, highest bandwidth per $ on decode (Splitwise)"
    else:
        order = sorted(specs, key=lambda s: -econ[s.name]["flops_per_bandwidth"])
        rule = (f"{top_f.name} is best per $ at both; prefill takes the most FLOP/s per byte/s "
                "of bandwidth")
    figures = ", ".join(f"{s.name} {econ[s.name]['flops_per_usd'] / 1e12:.0f} TFLOP/s and "
                        f"{econ[s.name]['bandwidth_per_usd'] / 1e12:.2f} TB/s per $/h"
                        for s in order)
    return order, f"{rule}: {figures}"


def _by_phase_economics(groups, spanning, prefill_n, devices):
    """On a box of mixed GPU types, give prefill the groups whose type ranks best for it
    (`rank_for_prefill`); one type: unchanged."""
    specs = [devices[g[0]].spec for g in groups]
    if any(s is None for s in specs) or len({s.name for s in specs}) < 2 or prefill_n == 0:
        return groups, spanning, None
    order, why = rank_for_prefill(specs)
    rank = {s.name: i for i, s in enumerate(order)}
    idx = sorted(range(len(groups)), key=lambda i: rank[specs[i].name])
    new_groups = [groups[i] for i in idx]
    new_spanning = sorted(idx.index(i) for i in spanning)
    pre = sorted({specs[i].name for i in idx[:prefill_n]})
    dec = sorted({specs[i].name for i in idx[prefill_n:]})
    note = f"mixed GPUs: prefill on {'+'.join(pre)}, decode on {'+'.join(dec)} ({why})"
    return new_groups, new_spanning, note


def _parse_split(split: str) -> tuple[int, int]:
    match = _SPLIT.match(split)
    if match is None:
        raise PlanError(f"malformed split {split!r}: expected 'auto' or 'P+D' worker counts, e.g. '4+4'")
    prefill_n, decode_n = int(match.group(1)), int(match.group(2))
    if prefill_n < 1:
        raise PlanError(f"zero prefill workers in split {split!r}: disagg needs at least one of each")
    if decode_n < 1:
        raise PlanError(f"zero decode workers in split {split!r}: disagg needs at least one of each")
    return prefill_n, decode_n


def _cpu_plan(cpu: Device, tp: int, manual: tuple[int, int] | None, mode: str,
              cpu_threads: int = 0) -> PartitionPlan:
    """The CPU box: one prefill and one decode process; the daemon splits the cores between
    them (engine.cpu_threads). Agg: one worker on every core, or with `cpu_threads` = T
    one worker per T cores (each a process holding the weights): T = 1 keeps every core
    busy with work of its own, where one worker's threads wait for each other at every op
    (and for the slowest of them on a loaded machine)."""
    if tp != 1:
        raise PlanError(f"tp={tp} needs GPUs; the CPU runs tp=1")
    if mode == "agg":
        n = max(1, cpu.cores // cpu_threads) if cpu_threads > 0 else 1
        slots = tuple(WorkerSlot(f"agg{i}", "agg", (cpu.id,)) for i in range(n))
        reason = (f"CPU only ({cpu.cores} cores): {n} agg workers on {cpu.id}, {cpu_threads} "
                  f"core(s) each" if n > 1 else f"CPU only ({cpu.cores} cores): 1 agg worker "
                  f"on {cpu.id}")
        return PartitionPlan(mode="agg", prefill=(), decode=(), agg=slots, tp=1, reason=reason)
    if manual is not None and manual != (1, 1):
        raise PlanError(
            f"split {manual[0]}+{manual[1]} is not possible on the CPU: it runs exactly one "
            "prefill and one decode worker (1+1)"
        )
    pinning = "the cores split between them" if cpu.cores >= 2 else "sharing its only core"
    reason = f"CPU only ({cpu.cores} cores): 1 prefill + 1 decode worker on {cpu.id}, {pinning}"
    return PartitionPlan(
        mode="disagg",
        prefill=(WorkerSlot("prefill0", "prefill", (cpu.id,)),),
        decode=(WorkerSlot("decode0", "decode", (cpu.id,)),),
        agg=(),
        tp=1,
        reason=reason,
    )


def _usable_islands(inv: Inventory, gpus: list[Device]) -> list[list[str]]:
    """NVLink islands of the usable GPUs, largest first (stable: ties keep device order)."""
    usable = {d.id for d in gpus}
    islands = [[i for i in island if i in usable] for island in inv.islands()]
    islands = [island for island in islands if island]
    return sorted(islands, key=len, reverse=True)


def _pack(islands: list[list[str]], tp: int, workers: int) -> tuple[list[tuple[str, ...]], list[int]]:
    """Cut `workers` groups of `tp` devices, inside islands where they fit.

    Greedy over islands largest first; groups come out in island order, so taking the
    first P for prefill and the rest for decode keeps each phase contiguous. What is left
    of each island after its whole groups is pooled, and groups cut from that pool span
    islands (their indices are returned so the reason can say so).
    """
    groups: list[tuple[str, ...]] = []
    leftovers: list[str] = []
    for island in islands:
        whole = len(island) // tp
        groups += [tuple(island[k * tp : (k + 1) * tp]) for k in range(whole)]
        leftovers += island[whole * tp :]
    groups = groups[:workers]
    spanning: list[int] = []
    k = 0
    while len(groups) < workers:
        spanning.append(len(groups))
        groups.append(tuple(leftovers[k * tp : (k + 1) * tp]))
        k += 1
    return groups, spanning


def _topology_notes(
    inv: Inventory,
    islands: list[list[str]],
    tp: int,
    prefill: tuple[WorkerSlot, ...],
    decode: tuple[WorkerSlot, ...],
    agg: tuple[WorkerSlot, ...],
    spanning: list[int],
) -> list[str]:
    island_of = {dev: i for i, island in enumerate(islands) for dev in island}
    slots = prefill + decode + agg
    used = {dev for s in slots for dev in s.devices}
    notes: list[str] = []
    used_islands = {island_of[d] for d in used}
    if len(used) > 1 and len(used_islands) == 1:
        notes.append("all workers in one NVLink island")
    elif tp > 1 and not spanning:
        notes.append("each worker inside one NVLink island")
    elif spanning:
        names = ", ".join(slots[i].worker for i in spanning)
        notes.append(f"NVLink islands too small for tp={tp}: {names} span islands over PCIe")
    if prefill and decode and len(used_islands) > 1:
        if not any(kind == NVLINK for kind in inv.links.values()):
            notes.append("no NVLink: prefill->decode KV handoff over PCIe")
        else:
            p_islands = {island_of[d] for s in prefill for d in s.devices}
            d_islands = {island_of[d] for s in decode for d in s.devices}
            if not p_islands & d_islands:
                notes.append("prefill->decode KV handoff crosses NVLink islands over PCIe")
    return notes
