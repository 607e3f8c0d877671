"""What the appliance can run on: real GPUs (NVML), the CPU, or simulated GPUs.

All three produce the same `Inventory`, so planning, the daemon and the TUI never ask
which world they are in; the difference lives here, in `discover`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.partitions.catalogue import GpuSpec, lookup_gpu, match_nvml_name
from appliance.partitions.nvml import Nvml

# A simulated box is one node; past this the O(N^2) link table stops being a toy.
MAX_SIM_GPUS = 64

ACCEPTED_SPECS = "'auto', 'cpu' or 'sim:<N>x<GPU>[+<N>x<GPU>...]' (e.g. 'sim:8xH100', 'sim:4xH100+4xL40S')"

NVLINK = "nvlink"
PCIE_SYSTEM = "pcie-system"


@dataclass(frozen=True, slots=True)
class Device:
    id: str  # "gpu0", "cpu0", "sim0"
    kind: str  # "gpu" | "cpu" | "sim"
    name: str  # "NVIDIA H100 80GB HBM3", "cpu", "H100-SXM"
    simulated: bool
    index: int
    uuid: str | None = None  # real GPUs: NVML UUID; sim: a stable fake "SIM-<spec>-<n>"
    memory_bytes: int = 0
    mig_enabled: bool = False
    cores: int = 0  # cpu only
    spec: GpuSpec | None = None  # catalogue entry for gpu (by name, may be None) and sim
    lost: bool = False  # a GPU NVML listed but could not read (shown, not crashed)

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "sim")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "name": self.name,
            "simulated": self.simulated,
            "index": self.index,
            "uuid": self.uuid,
            "memory_bytes": self.memory_bytes,
            "mig_enabled": self.mig_enabled,
            "cores": self.cores,
            "spec": self.spec.name if self.spec else None,
            "lost": self.lost,
        }


@dataclass(frozen=True)
class Inventory:
    devices: tuple[Device, ...]
    # (a, b) -> link kind, one entry per pair with a listed before b in `devices`.
    links: dict[tuple[str, str], str]
    source: str  # "nvml" | "cpu" | "sim"
    note: str | None  # why NVML was not used and what was used instead

    def link(self, a: str, b: str) -> str | None:
        return self.links.get((a, b)) or self.links.get((b, a))

    def islands(self) -> list[list[str]]:
        """Groups of devices joined by NVLink (connected components), in device order.

        Tensor-parallel workers must stay inside one island: their all-reduces over PCIe
        would cost more than the extra GPU buys.
        """
        parent = {d.id: d.id for d in self.devices}

        def root(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for (a, b), kind in self.links.items():
            if kind == NVLINK and a in parent and b in parent:
                ra, rb = root(a), root(b)
                if ra != rb:
                    parent[rb] = ra
        groups: dict[str, list[str]] = {}
        for d in self.devices:
            groups.setdefault(root(d.id), []).append(d.id)
        return list(groups.values())


def discover(spec: str = "auto", nvml: Nvml | None = None) -> Inventory:
    """Build the inventory for a device spec: 'auto', 'cpu' or 'sim:...'.

    'auto' prefers NVML and falls back to the CPU with a note saying why, so a box whose
    driver broke still serves (slowly) and says so, instead of refusing to start.
    """
    text = spec.strip()
    lowered = text.lower()
    if lowered == "cpu":
        return Inventory(devices=(_cpu_device(),), links={}, source="cpu", note=None)
    if lowered.startswith("sim:"):
        return _simulated(text)
    if lowered == "auto":
        return _auto(nvml)
    raise ValueError(f"unknown device spec {spec!r}: expected {ACCEPTED_SPECS}")


# ---------------------------------------------------------------------------- cpu


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The processor's feature flags (the first CPU's; empty when unreadable)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def _cpu_device() -> Device:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return Device(
        id="cpu0", kind="cpu", name="cpu", simulated=False, index=0, memory_bytes=memory, cores=cores
    )


def _cpu_fallback(note: str, lost: tuple[Device, ...] = ()) -> Inventory:
    # Lost GPUs stay in the listing so the operator sees them next to the fallback.
    return Inventory(devices=(*lost, _cpu_device()), links={}, source="cpu", note=note)


# ---------------------------------------------------------------------------- sim

_SIM_TERM = re.compile(r"^(\d+)\s*[xX]\s*(\S.*)$")


def parse_sim_spec(spec: str) -> list[GpuSpec]:
    """'sim:4xH100+4xL40S' -> one catalogue entry per simulated GPU, in order."""
    body = spec.strip()[len("sim:") :].strip()
    if not body:
        raise ValueError(f"empty sim spec {spec!r}: expected {ACCEPTED_SPECS}")
    gpus: list[GpuSpec] = []
    for term in body.split("+"):
        term = term.strip()
        match = _SIM_TERM.match(term)
        if match is None:
            raise ValueError(
                f"malformed term {term!r} in sim spec {spec!r}: expected <N>x<GPU>; "
                f"accepted forms: {ACCEPTED_SPECS}"
            )
        count = int(match.group(1))
        if count < 1:
            raise ValueError(f"count must be at least 1 in term {term!r} of sim spec {spec!r}")
        try:
            gpu = lookup_gpu(match.group(2))
        except ValueError as exc:
            raise ValueError(f"{exc} (in sim spec {spec!r})") from None
        gpus.extend([gpu] * count)
        if len(gpus) > MAX_SIM_GPUS:
            raise ValueError(f"sim spec {spec!r} asks for more than {MAX_SIM_GPUS} GPUs on one node")
    return gpus


def _simulated(spec: str) -> Inventory:
    gpus = parse_sim_spec(spec)
    devices = tuple(
        Device(
            id=f"sim{i}",
            kind="sim",
            name=gpu.name,
            simulated=True,
            index=i,
            uuid=f"SIM-{gpu.name}-{i}",
            memory_bytes=gpu.mem_bytes,
            spec=gpu,
        )
        for i, gpu in enumerate(gpus)
    )
    links: dict[tuple[str, str], str] = {}
    for i, a in enumerate(devices):
        for b in devices[i + 1 :]:
            # NVLink only joins boards of one model (one HGX baseboard).
            same_board = a.spec is b.spec and a.spec is not None and a.spec.nvlink
            links[(a.id, b.id)] = NVLINK if same_board else PCIE_SYSTEM
    return Inventory(devices=devices, links=links, source="sim", note=None)


# ---------------------------------------------------------------------------- nvml

# nvmlDeviceGetTopologyCommonAncestor levels, named like `nvidia-smi topo -m`'s legend.
_TOPOLOGY_NAMES: tuple[tuple[str, str], ...] = (
    ("NVML_TOPOLOGY_INTERNAL", "same-board"),
    ("NVML_TOPOLOGY_SINGLE", "pcie-switch"),  # PIX
    ("NVML_TOPOLOGY_MULTIPLE", "pcie-multi-switch"),  # PXB
    ("NVML_TOPOLOGY_HOSTBRIDGE", "pcie-host-bridge"),  # PHB
    ("NVML_TOPOLOGY_NODE", "pcie-numa-node"),  # NODE
    ("NVML_TOPOLOGY_SYSTEM", PCIE_SYSTEM),  # SYS
)


def _auto(nvml: Nvml | None) -> Inventory:
    owned = nvml is None
    session = Nvml() if nvml is None else nvml
    reason = session.init()
    if reason is not None:
        return _cpu_fallback(f"NVML unavailable: {reason}; using the CPU")
    try:
        return _from_nvml(session)
    finally:
        if owned:
            session.shutdown()


def _from_nvml(nvml: Nvml) -> Inventory:
    count = nvml.call("nvmlDeviceGetCount")
    if count is None:
        return _cpu_fallback(f"NVML could not count GPUs ({nvml.last_error}); using the CPU")
    if count == 0:
        return _cpu_fallback("NVML found no GPUs; using the CPU")

    devices: list[Device] = []
    handles: dict[str, Any] = {}
    for index in range(count):
        device, handle = _read_gpu(nvml, index)
        devices.append(device)
        if handle is not None:
            handles[device.id] = handle

    if not handles:
        why = nvml.last_error or "unreadable"
        return _cpu_fallback(
            f"NVML listed {count} GPU(s) but none could be read ({why}); using the CPU",
            lost=tuple(devices),
        )

    links: dict[tuple[str, str], str] = {}
    readable = [d.id for d in devices if d.id in handles]
    for i, a in enumerate(readable):
        for b in readable[i + 1 :]:
            links[(a, b)] = _link_kind(nvml, handles[a], handles[b])
    return Inventory(devices=tuple(devices), links=links, source="nvml", note=None)


def _read_gpu(nvml: Nvml, index: int) -> tuple[Device, Any]:
    """One GPU's record; a GPU that cannot be read becomes a lost row, never an exception."""
    device_id = f"gpu{index}"
    handle = nvml.call("nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return _lost(device_id, index, nvml.last_error), None
    name = _text(nvml.call("nvmlDeviceGetName", handle))
    uuid = _text(nvml.call("nvmlDeviceGetUUID", handle))
    memory = nvml.call("nvmlDeviceGetMemoryInfo", handle)
    total = getattr(memory, "total", None)
    if name is None or uuid is None or total is None:
        # Without identity or memory the GPU cannot be planned on or billed correctly.
        return _lost(device_id, index, nvml.last_error, name=name, uuid=uuid), None
    mig = nvml.call("nvmlDeviceGetMigMode", handle)  # [current, pending]; N/A -> off
    mig_enabled = bool(mig) and mig[0] == nvml.const("NVML_DEVICE_MIG_ENABLE")
    device = Device(
        id=device_id,
        kind="gpu",
        name=name,
        simulated=False,
        index=index,
        uuid=uuid,
        memory_bytes=int(total),
        mig_enabled=mig_enabled,
        spec=match_nvml_name(name),
    )
    return device, handle


def _lost(
    device_id: str, index: int, why: str | None, *, name: str | None = None, uuid: str | None = None
) -> Device:
    label = f"{name or 'unreadable GPU'} ({why or 'unknown error'})"
    return Device(id=device_id, kind="gpu", name=label, simulated=False, index=index, uuid=uuid, lost=True)


def _link_kind(nvml: Nvml, h1: Any, h2: Any) -> str:
    """NVLink if the driver allows peer access over it, else the PCIe distance.

    The P2P status is used rather than walking each NVLink's remote PCI id because on
    NVSwitch boards (HGX) the links end at the switch, not at the peer GPU.
    """
    nvlink = nvml.call("nvmlDeviceGetP2PStatus", h1, h2, nvml.const("NVML_P2P_CAPS_INDEX_NVLINK"))
    if nvlink is not None and nvlink == nvml.const("NVML_P2P_STATUS_OK"):
        return NVLINK
    level = nvml.call("nvmlDeviceGetTopologyCommonAncestor", h1, h2)
    if level is None:
        return "unknown"
    for const_name, kind in _TOPOLOGY_NAMES:
        if level == nvml.const(const_name):
            return kind
    return "unknown"


def _text(value: Any) -> str | None:
    # Old pynvml releases returned bytes; current ones decode.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value
