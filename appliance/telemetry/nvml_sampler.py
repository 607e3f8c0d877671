"""NVML readings of real GPUs, through the one NVML wrapper (`partitions.nvml.Nvml`).

Energy comes from the board's total-energy counter (mJ since driver load; DOMAIN.md: the
best source) as differences from the first reading; a driver without the counter falls
back to integrating the power reading. GPM metrics (Hopper+: SM activity, tensor
activity, DRAM bandwidth) need two samples, so the first reading of a device has none.
Every reading the driver or board lacks is None, remembered once by the wrapper; a GPU
that falls off the bus is a `lost` row until it answers again. Never raises.

Written against nvidia-ml-py's real API and tested with tests/helpers/fake_nvml.py; not run on
a GPU (see docs/limitations.md, "Not verified on hardware").
"""
from __future__ import annotations

import time
from typing import Any

from appliance.partitions.nvml import Nvml
from appliance.telemetry.samples import MEASURED, DeviceSample

# (key in DeviceSample.activity, NVML_GPM_METRIC_* constant)
GPM_METRICS = (("sm_activity", "NVML_GPM_METRIC_SM_UTIL"),
               ("tensor_activity", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
               ("dram_bw", "NVML_GPM_METRIC_DRAM_BW_UTIL"))


class _Gpu:
    __slots__ = ("id", "index", "handle", "e0_mj", "offset_j", "last_j", "last_t",
                 "last_power", "gpm", "gpm_prev")

    def __init__(self, dev_id: str, index: int):
        self.id = dev_id
        self.index = index
        self.handle: Any = None
        self.e0_mj: int | None = None       # first energy counter reading
        self.offset_j = 0.0                 # energy carried over a counter reset
        self.last_j: float | None = None
        self.last_t: float | None = None
        self.last_power: float | None = None
        self.gpm: bool | None = None        # None: not asked yet
        self.gpm_prev: Any = None


class NvmlSampler:
    blocking = True

    def __init__(self, devices: list[tuple[str, int]], nvml: Nvml | None = None,
                 clock=time.time):
        """devices: (inventory id, NVML index) of each real GPU."""
        self.nvml = nvml or Nvml()
        self.init_error = self.nvml.init()
        self.clock = clock
        self._gpus = [_Gpu(d, i) for d, i in devices]
        self._request = None        # one c_nvmlGpmMetricsGet_t, reused for every device
        self.devices = tuple(d for d, _ in devices)

    def read(self) -> list[DeviceSample]:
        return [self._read(g) for g in self._gpus]

    def close(self) -> None:
        for g in self._gpus:
            if g.gpm_prev is not None:
                self.nvml.call("nvmlGpmSampleFree", g.gpm_prev)
                g.gpm_prev = None

    # ------------------------------------------------------------------ one device
    def _blank(self, g: _Gpu, t: float, lost: bool) -> DeviceSample:
        return DeviceSample(g.id, t, g.last_j, None, None, None, None, None, None, {},
                            MEASURED, lost=lost)

    def _read(self, g: _Gpu) -> DeviceSample:
        nv = self.nvml
        t = self.clock()
        if not nv.initialised:
            return self._blank(g, t, lost=False)
        if g.handle is None:
            g.handle = nv.call("nvmlDeviceGetHandleByIndex", g.index)
            if g.handle is None:
                return self._blank(g, t, lost=True)
        h = g.handle
        power_mw = nv.call("nvmlDeviceGetPowerUsage", h)
        if nv.gpu_lost:
            return self._lose(g, t)
        power = power_mw / 1000.0 if power_mw is not None else None
        energy = self._energy(g, t, nv.call("nvmlDeviceGetTotalEnergyConsumption", h), power)
        util = nv.call("nvmlDeviceGetUtilizationRates", h)
        mem = nv.call("nvmlDeviceGetMemoryInfo", h)
        clock = nv.call("nvmlDeviceGetClockInfo", h, nv.const("NVML_CLOCK_SM"))
        temp = nv.call("nvmlDeviceGetTemperature", h, nv.const("NVML_TEMPERATURE_GPU"))
        activity = self._gpm(g)
        if nv.gpu_lost:
            return self._lose(g, t)
        return DeviceSample(
            g.id, t, energy, power,
            util.gpu / 100.0 if util is not None else None,
            int(mem.used) if mem is not None else None,
            int(mem.total) if mem is not None else None,
            float(clock) if clock is not None else None,
            float(temp) if temp is not None else None,
            activity, MEASURED)

    def _lose(self, g: _Gpu, t: float) -> DeviceSample:
        """The GPU fell off the bus: a visible row; ask for a fresh handle next time."""
        g.handle = None
        g.gpm_prev = None       # its samples belong to a device that is gone
        g.gpm = None
        return self._blank(g, t, lost=True)

    def _energy(self, g: _Gpu, t: float, counter_mj: int | None, power: float | None) -> float | None:
        if counter_mj is not None:
            if g.e0_mj is None:
                g.e0_mj = counter_mj
                g.offset_j = g.last_j or 0.0
            elif counter_mj < g.e0_mj:          # driver reloaded: the counter restarted
                g.offset_j = g.last_j or 0.0
                g.e0_mj = counter_mj
            joules = g.offset_j + (counter_mj - g.e0_mj) / 1000.0
        elif power is not None:
            # No counter (pre-Volta or a driver without it): integrate the 1-s averages.
            base = g.last_j or 0.0
            prev_p = g.last_power if g.last_power is not None else power
            joules = base + (t - g.last_t) * (prev_p + power) / 2 if g.last_t is not None else base
        else:
            joules = g.last_j
        g.last_j, g.last_t, g.last_power = joules, t, power
        return joules

    def _gpm(self, g: _Gpu) -> dict[str, float]:
        nv = self.nvml
        if g.gpm is None:
            support = nv.call("nvmlGpmQueryDeviceSupport", g.handle)
            g.gpm = bool(support is not None and getattr(support, "isSupportedDevice", 0))
        if not g.gpm:
            return {}
        sample = nv.call("nvmlGpmSampleAlloc")
        if sample is None:
            g.gpm = False
            return {}
        if nv.call("nvmlGpmSampleGet", g.handle, sample) is None:
            nv.call("nvmlGpmSampleFree", sample)
            return {}
        prev, g.gpm_prev = g.gpm_prev, sample
        if prev is None:
            return {}
        try:
            return self._metrics(prev, sample)
        finally:
            nv.call("nvmlGpmSampleFree", prev)

    def _metrics(self, first, second) -> dict[str, float]:
        nv = self.nvml
        req = self._request
        if req is None:
            struct = nv.const("c_nvmlGpmMetricsGet_t")
            if struct is None:
                return {}
            req = self._request = struct()
        # Every field set on each use: NVML writes the results into the same struct.
        req.version = nv.const("NVML_GPM_METRICS_GET_VERSION")
        req.numMetrics = len(GPM_METRICS)
        req.sample1, req.sample2 = first, second
        for i, (_, const) in enumerate(GPM_METRICS):
            req.metrics[i].metricId = nv.const(const)
        got = nv.call("nvmlGpmMetricsGet", req)
        if got is None:
            return {}
        ok = nv.const("NVML_SUCCESS", 0)
        return {name: max(0.0, min(1.0, got.metrics[i].value / 100.0))
                for i, (name, _) in enumerate(GPM_METRICS) if got.metrics[i].nvmlReturn == ok}
