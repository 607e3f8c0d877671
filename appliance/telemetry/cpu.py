"""The CPU as a device: package energy from RAPL when readable, else a power model;
per-worker CPU time from psutil.

RAPL (`/sys/class/powercap/intel-rapl:N/energy_uj`, also used for AMD packages on
recent kernels) counts microjoules per package and wraps at `max_energy_range_uj`; since
2020 most kernels make it root-only, so an unprivileged daemon usually falls back to
the model. The model (source "estimated"):

    P = cores * idle_w_per_core + busy_cores * busy_w_per_core

busy_cores from psutil's system-wide CPU times (non-idle seconds per second). Defaults
1.5 W and 3.5 W per core: a 64-core EPYC 7763 idles near ~100 W at the package and
reaches its 280 W TDP under all-core load, ~1.5 + ~2.9 W per core; rounded up to cover
memory traffic. Rough: calibrate on the box or give RAPL access (docs/operations/telemetry.md).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from appliance.telemetry.samples import ESTIMATED, MEASURED, DeviceSample

RAPL_DIR = "/sys/class/powercap"


class Rapl:
    """Summed package energy counters with wraparound; `read()` is None when unreadable."""

    def __init__(self, root: str | os.PathLike = RAPL_DIR):
        self.zones: list[tuple[Path, int]] = []
        base = Path(root)
        try:
            # Top-level zones are packages (intel-rapl:0, :1); intel-rapl:0:0 are parts of them.
            for zone in sorted(base.glob("intel-rapl:*")):
                if zone.name.count(":") != 1:
                    continue
                try:
                    max_uj = int((zone / "max_energy_range_uj").read_text())
                    int((zone / "energy_uj").read_text())
                except (OSError, ValueError):
                    continue        # root-only since CVE-2020-8694, or not a counter
                self.zones.append((zone / "energy_uj", max_uj))
        except OSError:
            pass
        self._last: list[int] | None = None
        self.total_j = 0.0

    @property
    def available(self) -> bool:
        return bool(self.zones)

    def read(self) -> float | None:
        """Joules since the first read (None if a counter cannot be read)."""
        try:
            now = [int(p.read_text()) for p, _ in self.zones]
        except (OSError, ValueError):
            return None
        if not now:
            return None
        if self._last is not None:
            for (_, max_uj), prev, cur in zip(self.zones, self._last, now):
                delta = cur - prev
                if delta < 0:       # wrapped around
                    delta += max_uj
                self.total_j += delta / 1e6
        self._last = now
        return self.total_j


class CpuSampler:
    """Reads the CPU device and the CPU time of each worker process."""

    blocking = True

    def __init__(self, device: str = "cpu0", *, worker_pids=lambda: {},
                 rapl_dir: str | os.PathLike = RAPL_DIR, idle_w_per_core: float = 1.5,
                 busy_w_per_core: float = 3.5, clock=time.time, cpu_times=psutil.cpu_times,
                 cores: int | None = None):
        self.device = device
        self.devices = (device,)
        self.worker_pids = worker_pids
        self.rapl = Rapl(rapl_dir)
        self.idle_w_per_core = idle_w_per_core
        self.busy_w_per_core = busy_w_per_core
        self.clock = clock
        self.cpu_times = cpu_times
        self.cores = cores or psutil.cpu_count() or 1
        self._last_t: float | None = None
        self._last_busy: float | None = None
        self._model_j = 0.0
        self._last_rapl: float | None = None
        self._procs: dict[int, psutil.Process] = {}
        # worker id -> cumulative CPU seconds (user + system) of its process, this run.
        self.worker_cpu_s: dict[str, float] = {}
        self._worker_base: dict[str, tuple[int, float, float]] = {}   # pid, base, carried

    @property
    def source(self) -> str:
        return MEASURED if self.rapl.available else ESTIMATED

    @property
    def idle_w(self) -> float:
        return self.cores * self.idle_w_per_core

    def read(self) -> list[DeviceSample]:
        t = self.clock()
        times = self.cpu_times()
        busy = _busy_seconds(times)
        util = busy_cores = None
        if self._last_t is not None and t > self._last_t:
            busy_cores = max(0.0, (busy - self._last_busy) / (t - self._last_t))
            busy_cores = min(busy_cores, float(self.cores))
            util = busy_cores / self.cores
        power = None
        energy = self.rapl.read() if self.rapl.available else None
        if energy is not None:
            if self._last_rapl is not None and self._last_t is not None and t > self._last_t:
                power = (energy - self._last_rapl) / (t - self._last_t)
            self._last_rapl = energy
            source = MEASURED
        else:
            if busy_cores is not None:
                power = self.cores * self.idle_w_per_core + busy_cores * self.busy_w_per_core
                self._model_j += power * (t - self._last_t)
            energy = self._model_j
            source = ESTIMATED
        self._last_t, self._last_busy = t, busy
        self._read_workers()
        mem = psutil.virtual_memory()
        return [DeviceSample(self.device, t, energy, power, util, int(mem.total - mem.available),
                             int(mem.total), None, None, {}, source)]

    def _read_workers(self) -> None:
        """CPU seconds per worker, carried across a restart (a new pid starts at 0)."""
        for worker, pid in self.worker_pids().items():
            if pid is None:
                continue
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                ct = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                self._procs.pop(pid, None)
                continue
            used = ct.user + ct.system
            old_pid, base, carried = self._worker_base.get(worker, (pid, used, 0.0))
            if old_pid != pid:          # restarted: keep what the old process used
                carried, base = self.worker_cpu_s.get(worker, 0.0), 0.0
            self._worker_base[worker] = (pid, base, carried)
            self.worker_cpu_s[worker] = carried + used - base
        live = set(self.worker_pids().values())
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]


def _busy_seconds(times) -> float:
    idle = getattr(times, "idle", 0.0) + getattr(times, "iowait", 0.0)
    total = sum(v for k, v in times._asdict().items() if k not in ("guest", "guest_nice"))
    return total - idle
