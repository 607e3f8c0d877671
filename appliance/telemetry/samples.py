"""What every sampler produces and what the accounting reads back.

One `DeviceSample` shape for every kind of device, so the hub, the status page, the
metrics and the ledger never ask whether a number came from NVML, RAPL, a power model or
the simulator: they read `source` and show it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

MEASURED = "measured"
ESTIMATED = "estimated"
SIMULATED = "simulated"


@dataclass(slots=True)
class DeviceSample:
    """One reading of one device. None = not available on this device/driver."""

    device: str                   # inventory device id ("gpu0", "cpu0", "sim0" ...)
    t: float                      # time.time()
    energy_j: float | None        # cumulative joules since the sampler started
    power_w: float | None
    util: float | None            # 0..1
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    sm_clock_mhz: float | None
    temp_c: float | None
    activity: dict[str, float] = field(default_factory=dict)   # sm_activity, tensor_activity, dram_bw (0..1)
    source: str = MEASURED        # "measured" | "estimated" | "simulated"
    # Not in the shared contract's field list, defaulted so it stays compatible: a GPU
    # NVML listed but cannot read any more. Shown as a row with no readings.
    lost: bool = False


class EnergyMeter(Protocol):
    def energy_j(self, device: str, t0: float, t1: float) -> tuple[float | None, str]:
        """Joules the device drew over [t0, t1] (None if not known) and the source."""

    def idle_power_w(self, device: str) -> float | None:
        """Calibrated idle power of the device (None if not known)."""


class Sampler(Protocol):
    """Reads a set of devices. `blocking` samplers (NVML, sysfs, psutil) are run off the
    event loop; the others only read the hub's own state."""

    blocking: bool
    devices: tuple[str, ...]

    def read(self) -> list[DeviceSample]: ...
