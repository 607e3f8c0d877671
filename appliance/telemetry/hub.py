"""The live picture: every device's samples and every engine iteration in one place.

Busy time comes from the iteration records (time inside engine iterations, exact, per
worker), device readings from the samplers (NVML, RAPL or the CPU model, the simulator's
power model). From both the hub answers, per device and per group (prefill, decode,
agg) over 1/10/60-s windows: busy fraction, busy device-seconds, joules, utilization,
tokens/s; the prefill:decode ratio in three currencies; latency percentiles; and, for
the ledger, `energy_j(device, t0, t1)` (the `EnergyMeter` protocol).

Windows end on the last whole bin edge (`bin_s`, 0.1 s) before now, so they hold whole
bins and busy fractions are exact; an iteration still running at that edge is counted
when its record arrives (records come at the end of an iteration).

A device shared by workers of both groups (the CPU in disagg mode: each worker pinned to
its own cores) has its busy time weighted by each worker's share of it (cores pinned /
cores), and its energy split between the groups by their workers' CPU seconds over the
same span (psutil), else by busy time, else by share.

This module keeps the readings and answers queries; what the answers look like to the
outside (the live keys of /admin/v1/status, the values /metrics exports) is
`telemetry/status.py`'s. Knows nothing of HTTP: the daemon feeds the hub and reads it
through `status.status_fields` and `status.metric_values`.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from appliance.percentiles import percentile
from appliance.telemetry.bins import Bins
from appliance.telemetry.samples import SIMULATED, DeviceSample
from appliance.telemetry.sim_power import SimPowerModel

log = logging.getLogger("applianced.telemetry")

HISTORY_S = 60            # seconds of bins kept for the ratio history
LATENCY_WINDOW_S = 60.0   # finished requests kept for the latency percentiles

# Columns of a worker's bins.
BUSY, PREFILL_TOK, DECODE_TOK, SIM_ACTIVE_J, SIM_TENSOR_S = range(5)
_COLUMNS = 5


@dataclass(frozen=True)
class TelemetryDevice:
    id: str
    name: str
    kind: str                     # "gpu" | "cpu" | "sim"
    simulated: bool
    memory_bytes: int = 0
    idle_w: float | None = None   # default idle power (catalogue / CPU model) until calibrated
    power_model: SimPowerModel | None = None   # simulated GPUs only


@dataclass(frozen=True)
class TelemetryWorker:
    id: str
    role: str                     # "prefill" | "decode" | "agg": the worker's group
    devices: tuple[str, ...]
    # This worker's share of each of its devices: 1 for a GPU, cores pinned / cores for
    # a CPU worker (two workers split one CPU device).
    shares: tuple[float, ...] = ()

    def share(self, i: int) -> float:
        return self.shares[i] if self.shares else 1.0

    @property
    def share_sum(self) -> float:
        return sum(self.share(i) for i in range(len(self.devices)))

    def sim_models(self, devices: dict) -> list:
        """(device id, SimPowerModel) for this worker's simulated devices."""
        return [(d, devices[d].power_model) for d in self.devices
                if d in devices and devices[d].power_model is not None]


@dataclass
class _Series:
    """Cumulative energy readings of one measured/estimated device, for interpolation."""

    t: list[float] = field(default_factory=list)
    e: list[float] = field(default_factory=list)


class SimSampler:
    """Simulated GPUs: power and energy from the hub's own record of their iterations."""

    blocking = False

    def __init__(self, hub: "Telemetry", devices: list[str]):
        self.hub = hub
        self.devices = tuple(devices)

    def read(self) -> list[DeviceSample]:
        hub = self.hub
        t = hub.clock()
        out = []
        for d in self.devices:
            dev = hub.devices[d]
            model = dev.power_model
            energy, _ = hub.energy_j(d, t - 1.0, t)
            busy = hub.device_busy_s(d, t - 1.0, t)
            tensor = hub.device_sim_tensor_s(d, t - 1.0, t)
            cumulative = model.idle_w * (t - hub.started) + hub.sim_active_total_j[d]
            out.append(DeviceSample(d, t, cumulative, energy, min(1.0, busy), None,
                                    dev.memory_bytes or None, None, None,
                                    {"tensor_activity": min(1.0, tensor)}, SIMULATED))
        return out


class Telemetry:
    """Implements `EnergyMeter`; see the module docstring."""

    def __init__(self, devices: list[TelemetryDevice], workers: list[TelemetryWorker],
                 samplers=(), *, mode: str = "disagg", site: str = "local", appliance: str = "",
                 sample_interval_s: float = 1.0, bin_s: float = 0.1, retain_s: float = 600.0,
                 clock=time.time):
        self.clock = clock
        self.started = clock()
        self.mode = mode
        self.site = site
        self.appliance = appliance
        self.sample_interval_s = sample_interval_s
        self.bin_s = bin_s
        self.retain_s = max(retain_s, HISTORY_S + 10.0)
        self.devices = {d.id: d for d in devices}
        self.samplers = list(samplers)
        sim = [d.id for d in devices if d.power_model is not None]
        if sim:
            self.samplers.append(SimSampler(self, sim))
        self._bins: dict[str, Bins] = {}
        self._cpu: dict[str, _Series] = {}                       # worker CPU s
        # Counters for /metrics (monotonic).
        self.group_busy_total: dict[str, float] = {}
        self.group_energy_total: dict[str, float] = {}
        self.set_workers(workers)
        self._latest: dict[str, DeviceSample | None] = {d: None for d in self.devices}
        keep = int(self.retain_s / max(sample_interval_s, 0.01)) + 2
        self._samples: dict[str, deque[DeviceSample]] = {
            d: deque(maxlen=max(keep, HISTORY_S + 2)) for d in self.devices}
        self._energy: dict[str, _Series] = {d: _Series() for d in self.devices}
        self._idle_seen: dict[str, deque[float]] = {d: deque(maxlen=120) for d in self.devices}
        self._requests: deque[tuple[float, float | None, float | None]] = deque()
        self.phase_tokens_total = {"prefill": 0, "decode": 0}
        self.sim_active_total_j = {d: 0.0 for d in sim}
        self.requests_total = 0
        self._task: asyncio.Task | None = None

    def set_workers(self, workers: list[TelemetryWorker]) -> None:
        """Index workers, groups and devices: at start-up, and when the partition changed
        (a repartition workflow). Workers that stay keep their history; new ones start
        empty; a worker that left drops out of the windows (its past busy time with it)."""
        self.workers = {w.id: w for w in workers}
        self.groups: dict[str, list[str]] = {}          # group -> worker ids
        for w in workers:
            self.groups.setdefault(w.role, []).append(w.id)
        # device -> [(worker id, fraction of that worker's busy time spent on this device)]
        self._dev_workers: dict[str, list[tuple[str, float]]] = {d: [] for d in self.devices}
        for w in workers:
            total = sum(w.share(i) for i in range(len(w.devices))) or 1.0
            for i, d in enumerate(w.devices):
                self._dev_workers.setdefault(d, []).append((w.id, w.share(i) / total))
        self.device_groups = {d: sorted({self.workers[w].role for w, _ in ws})
                              for d, ws in self._dev_workers.items()}
        self.group_devices = {g: sorted({d for w in ws for d in self.workers[w].devices},
                                        key=list(self.devices).index)
                              for g, ws in self.groups.items()}
        self._bins = {w: self._bins.get(w) or Bins(self.bin_s, self.retain_s, _COLUMNS)
                      for w in self.workers}
        self._share_sum = {w.id: w.share_sum for w in workers}
        self._sim_models = {w.id: w.sim_models(self.devices) for w in workers}
        self._cpu = {w: self._cpu.get(w) or _Series() for w in self.workers}
        for g in self.groups:
            self.group_busy_total.setdefault(g, 0.0)
            self.group_energy_total.setdefault(g, 0.0)

    # ------------------------------------------------------------------ feeding
    def observe_iteration(self, rec) -> None:
        w = self.workers.get(rec.worker)
        if w is None:
            return
        wall = rec.wall_s
        phase = rec.phase
        prefill = decode = 0
        if phase == "prefill":
            prefill = tokens = sum(e[1] for e in rec.entries)
        elif phase == "decode":
            decode = tokens = sum(e[1] for e in rec.entries)
        else:
            tokens = 0
            if phase == "mixed":
                # Chunked prefill: prompt chunks and one-token decodes in one pass.
                for e in rec.entries:
                    if e[1] == 1:
                        decode += 1
                    else:
                        prefill += e[1]
                tokens = prefill + decode
        busy = wall * self._share_sum[w.id]
        active_j = tensor_s = 0.0
        for d, model in self._sim_models[w.id]:
            u = model.share_for(phase, tokens)
            joules = (model.power_at(u) - model.idle_w) * wall
            self.sim_active_total_j[d] += joules
            active_j += joules
            tensor_s += u * wall
        self._bins[w.id].add(rec.start, rec.start + wall, (busy, prefill, decode, active_j, tensor_s))
        self.group_busy_total[w.role] += busy
        self.phase_tokens_total["prefill"] += prefill
        self.phase_tokens_total["decode"] += decode

    def observe_request(self, rec) -> None:
        """A finished request (RequestRecord): TTFT and ITL for the percentiles."""
        self.requests_total += 1
        ttft = itl = None
        if rec.first_token is not None:
            ttft = rec.first_token - rec.arrival
            per_choice = rec.output_tokens // max(1, getattr(rec, "choices", 1))
            if per_choice >= 2:
                itl = (rec.finish - rec.first_token) / (per_choice - 1)
        self._requests.append((rec.finish, ttft, itl))
        cutoff = self.clock() - LATENCY_WINDOW_S
        while self._requests and self._requests[0][0] < cutoff:
            self._requests.popleft()

    # ------------------------------------------------------------------ sampling
    def read_blocking(self) -> list[DeviceSample]:
        """Readings of the samplers that call the hardware (run off the event loop)."""
        out: list[DeviceSample] = []
        for s in self.samplers:
            if s.blocking:
                try:
                    out += s.read()
                except Exception:   # a sampler must never take the daemon down
                    log.exception("telemetry sampler %s failed", type(s).__name__)
        return out

    def read_nonblocking(self) -> list[DeviceSample]:
        return [x for s in self.samplers if not s.blocking for x in s.read()]

    def sample(self) -> list[DeviceSample]:
        """Read every sampler now and take the readings in (what `run` does each period)."""
        samples = self.read_blocking()
        self.ingest(samples)
        sim = self.read_nonblocking()
        self.ingest(sim)
        return samples + sim

    async def run(self) -> None:
        """Sample every `sample_interval_s` until cancelled; NVML and sysfs off the loop."""
        blocking = any(s.blocking for s in self.samplers)
        while True:
            try:
                if blocking:
                    self.ingest(await asyncio.to_thread(self.read_blocking))
                self.ingest(self.read_nonblocking())
            except Exception:
                log.exception("telemetry sampling failed")
            await asyncio.sleep(self.sample_interval_s)

    def ingest(self, samples: list[DeviceSample]) -> None:
        for sampler in self.samplers:
            cpu = getattr(sampler, "worker_cpu_s", None)
            if cpu:
                now = self.clock()
                for worker, seconds in cpu.items():
                    if worker in self._cpu:
                        self._append(self._cpu[worker], now, seconds)
        for s in samples:
            if s.device not in self.devices:
                continue
            prev = self._latest[s.device]
            self._latest[s.device] = s
            self._samples[s.device].append(s)
            if s.energy_j is not None and self.devices[s.device].power_model is None:
                self._append(self._energy[s.device], s.t, s.energy_j)
            if prev is None or prev.t >= s.t:
                continue
            if prev.energy_j is not None and s.energy_j is not None and s.energy_j >= prev.energy_j:
                delta = s.energy_j - prev.energy_j
                for g, share in self._group_shares(s.device, prev.t, s.t).items():
                    self.group_energy_total[g] += delta * share
            if s.power_w is not None and self.device_busy_s(s.device, prev.t, s.t) == 0.0 \
                    and s.t - prev.t >= 0.5:
                self._idle_seen[s.device].append(s.power_w)

    def _append(self, series: _Series, t: float, v: float) -> None:
        if series.t and t <= series.t[-1]:
            return
        series.t.append(t)
        series.e.append(v)
        if len(series.t) > 64 and t - series.t[0] > self.retain_s * 1.5:
            cut = bisect.bisect_left(series.t, t - self.retain_s)
            del series.t[:cut], series.e[:cut]

    # ------------------------------------------------------------------ EnergyMeter
    def energy_j(self, device: str, t0: float, t1: float) -> tuple[float | None, str]:
        dev = self.devices.get(device)
        if dev is None:
            return None, "unknown"
        if t1 < t0:
            t0, t1 = t1, t0
        if dev.power_model is not None:
            active = 0.0
            for w, _ in self._dev_workers.get(device, ()):
                worker = self.workers[w]
                n_sim = sum(1 for d in worker.devices if self.devices[d].power_model) or 1
                active += self._bins[w].sum(t0, t1)[SIM_ACTIVE_J] / n_sim
            # Idle power only from when the hub started: before that nothing was watched.
            idle_s = max(0.0, max(t1, self.started) - max(t0, self.started))
            return dev.power_model.idle_w * idle_s + active, SIMULATED
        latest = self._latest.get(device)
        source = latest.source if latest is not None else "measured"
        a, b = self._interp(device, t0), self._interp(device, t1)
        if a is None or b is None:
            return None, source
        return max(0.0, b - a), source

    def _interp(self, device: str, t: float) -> float | None:
        """Cumulative joules at t from the readings around it; a little past the newest
        reading, extrapolated with the latest power (samples lag by up to one period)."""
        s = self._energy[device]
        if not s.t:
            return None
        slack = 2.5 * self.sample_interval_s
        if t <= s.t[0]:
            return s.e[0] if s.t[0] - t <= slack else None
        if t >= s.t[-1]:
            if t - s.t[-1] > slack:
                return None
            latest = self._latest[device]
            power = latest.power_w if latest is not None and latest.power_w is not None else (
                (s.e[-1] - s.e[-2]) / (s.t[-1] - s.t[-2]) if len(s.t) > 1 else 0.0)
            return s.e[-1] + power * (t - s.t[-1])
        i = bisect.bisect_right(s.t, t)
        ta, tb, ea, eb = s.t[i - 1], s.t[i], s.e[i - 1], s.e[i]
        return ea + (eb - ea) * (t - ta) / (tb - ta)

    def idle_power_w(self, device: str) -> float | None:
        """The median power seen while the device ran no iteration for a whole sample
        period (>= 5 such readings), else the catalogue's / CPU model's idle figure."""
        dev = self.devices.get(device)
        if dev is None:
            return None
        if dev.power_model is not None:
            return dev.power_model.idle_w
        seen = self._idle_seen.get(device)
        if seen and len(seen) >= 5:
            return percentile(list(seen), 0.5)
        return dev.idle_w

    # ------------------------------------------------------------------ windows
    def device_busy_s(self, device: str, t0: float, t1: float) -> float:
        """Busy device-seconds of one device over [t0, t1)."""
        return sum(self._bins[w].sum(t0, t1)[BUSY] * frac
                   for w, frac in self._dev_workers.get(device, ()))

    def device_sim_tensor_s(self, device: str, t0: float, t1: float) -> float:
        total = 0.0
        for w, _ in self._dev_workers.get(device, ()):
            n = len(self.workers[w].devices) or 1
            total += self._bins[w].sum(t0, t1)[SIM_TENSOR_S] / n
        return total

    def _cpu_seconds(self, worker: str, t0: float, t1: float) -> float | None:
        s = self._cpu.get(worker)
        if s is None or len(s.t) < 2:
            return None
        a = self._interp_series(s, t0)
        b = self._interp_series(s, t1)
        return None if a is None or b is None else max(0.0, b - a)

    @staticmethod
    def _interp_series(s: _Series, t: float) -> float | None:
        if t <= s.t[0]:
            return s.e[0]
        if t >= s.t[-1]:
            return s.e[-1]
        i = bisect.bisect_right(s.t, t)
        ta, tb = s.t[i - 1], s.t[i]
        return s.e[i - 1] + (s.e[i] - s.e[i - 1]) * (t - ta) / (tb - ta)

    def _group_shares(self, device: str, t0: float, t1: float) -> dict[str, float]:
        """How the device's energy over [t0, t1] splits between the groups using it."""
        groups = self.device_groups.get(device, [])
        if len(groups) <= 1:
            return {g: 1.0 for g in groups}
        by: dict[str, float] = {}
        for basis in ("cpu", "busy", "share"):
            by = {g: 0.0 for g in groups}
            for w, frac in self._dev_workers[device]:
                role = self.workers[w].role
                if basis == "cpu":
                    v = self._cpu_seconds(w, t0, t1)
                    by[role] += (v or 0.0) * frac
                elif basis == "busy":
                    by[role] += self._bins[w].sum(t0, t1)[BUSY] * frac
                else:
                    worker = self.workers[w]
                    by[role] += worker.share(worker.devices.index(device))
            total = sum(by.values())
            if total > 0:
                return {g: v / total for g, v in by.items()}
        return {g: 1.0 / len(groups) for g in groups}

    def _device_window(self, device: str, t0: float, t1: float) -> dict:
        """Utilization and activity of one device over [t0, t1], from its readings
        (simulated: the busy fraction)."""
        width = t1 - t0
        busy = self.device_busy_s(device, t0, t1) / width if width > 0 else 0.0
        dev = self.devices[device]
        if dev.power_model is not None:
            return {"busy": busy, "util": min(1.0, busy), "activity": min(1.0, busy),
                    "activity_source": "utilization"}
        utils, acts = [], []
        for s in reversed(self._samples[device]):
            if s.t <= t0:
                break
            if s.t <= t1 + self.bin_s:
                if s.util is not None:
                    utils.append(s.util)
                if "sm_activity" in s.activity:
                    acts.append(s.activity["sm_activity"])
        if not utils and not acts:
            latest = self._latest[device]
            if latest is not None and t1 - latest.t <= 2.5 * self.sample_interval_s:
                if latest.util is not None:
                    utils = [latest.util]
                if "sm_activity" in latest.activity:
                    acts = [latest.activity["sm_activity"]]
        util = sum(utils) / len(utils) if utils else None
        if acts:
            activity, src = sum(acts) / len(acts), "gpm_sm_activity"
        elif util is not None:
            activity, src = util, "utilization"
        else:
            activity, src = busy, "busy_fraction"
        return {"busy": busy, "util": util, "activity": activity, "activity_source": src}

    def window_edge(self, now: float) -> float:
        """The last whole bin edge at or before `now`: where every window ends."""
        return math.floor(now / self.bin_s) * self.bin_s

    def group_window(self, group: str, t0: float, t1: float) -> dict:
        """Busy fraction, busy device-seconds, joules, utilization, activity-seconds,
        tokens of one group over [t0, t1)."""
        width = t1 - t0
        busy = prefill = decode = 0.0
        capacity = 0.0
        for w in self.groups[group]:
            sums = self._bins[w].sum(t0, t1)
            busy += sums[BUSY]
            prefill += sums[PREFILL_TOK]
            decode += sums[DECODE_TOK]
            worker = self.workers[w]
            capacity += sum(worker.share(i) for i in range(len(worker.devices)))
        energy: float | None = 0.0
        activity_s = 0.0
        utils = []
        sources = set()
        for d in self.group_devices[group]:
            share = self._group_shares(d, t0, t1).get(group, 0.0)
            # A window reaching back before the first reading shows the energy since it.
            series = self._energy[d]
            start = max(t0, series.t[0]) if series.t and t1 > series.t[0] else t0
            joules, _ = self.energy_j(d, start, t1)
            if joules is None:
                energy = None
            elif energy is not None:
                energy += joules * share
            win = self._device_window(d, t0, t1)
            if len(self.device_groups.get(d, ())) > 1:
                # A shared device's activity cannot be told apart per group: its busy time can.
                mine = sum(self._bins[w].sum(t0, t1)[BUSY] * frac for w, frac in self._dev_workers[d]
                           if self.workers[w].role == group)
                activity_s += mine
                sources.add("busy_fraction")
            else:
                activity_s += win["activity"] * width
                sources.add(win["activity_source"])
            if win["util"] is not None:
                utils.append(win["util"])
        cpu = [self._cpu_seconds(w, t0, t1) for w in self.groups[group]]
        return {
            "busy_s": busy, "capacity": capacity,
            "cpu_s": sum(c for c in cpu if c is not None) if any(c is not None for c in cpu) else None,
            "busy_fraction": busy / (capacity * width) if capacity and width > 0 else 0.0,
            "energy_j": energy, "activity_s": activity_s,
            "activity_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else None),
            "utilization": sum(utils) / len(utils) if utils else None,
            "prefill_tokens": prefill, "decode_tokens": decode,
        }

    # ------------------------------------------------------------------ queries for the status
    def group_busy_s(self, group: str, t0: float, t1: float) -> float:
        """Busy worker-seconds of a group over [t0, t1), from the iteration bins."""
        return sum(self._bins[w].sum(t0, t1)[BUSY] for w in self.groups[group])

    def recent_requests(self, now: float, span: float) -> list[tuple[float, float | None, float | None]]:
        """(finish, TTFT, ITL) of the requests that finished in the last `span` seconds."""
        return [r for r in self._requests if r[0] >= now - span]

    def latest(self, device: str) -> DeviceSample | None:
        """The device's last reading, if any."""
        return self._latest[device]

    def device_workers(self, device: str) -> list[str]:
        """The workers running on a device."""
        return [w for w, _ in self._dev_workers.get(device, ())]

    def sources(self, win: dict[str, dict] | None = None) -> dict:
        """Where the figures come from: energy by its readings' source, utilization
        measured or simulated, activity by the windows' sources (`win`: group windows)."""
        energy = {(s.source if s is not None else None) for s in self._latest.values()}
        energy.discard(None)
        util = set()
        for d, s in self._latest.items():
            if self.devices[d].power_model is not None:
                util.add(SIMULATED)
            elif s is not None and s.util is not None:
                util.add(s.source if s.source == SIMULATED else "measured")
        acts = {w["activity_source"] for w in (win or {}).values() if w.get("activity_source")}

        def one(values: set) -> str | None:
            return values.pop() if len(values) == 1 else ("mixed" if values else None)
        return {"energy": one(energy), "utilization": one(util), "activity": one(acts)}

    def group_power_w(self, group: str) -> float | None:
        """The group's power now: its devices' last readings, a shared device's split by
        the groups' shares over the last 10 s; None if a reading lacks power."""
        now = self.clock()
        total = 0.0
        for d in self.group_devices[group]:
            s = self._latest[d]
            if s is None or s.power_w is None:
                return None
            total += s.power_w * self._group_shares(d, now - 10.0, now).get(group, 0.0)
        return total

