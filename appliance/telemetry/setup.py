"""Builds the hub for an inventory and its partition plan (what the daemon runs)."""
from __future__ import annotations

import socket

from appliance.telemetry.cpu import RAPL_DIR, CpuSampler
from appliance.telemetry.hub import Telemetry, TelemetryDevice, TelemetryWorker
from appliance.telemetry.nvml_sampler import NvmlSampler
from appliance.telemetry.sim_power import SimPowerModel


def appliance_name(configured: str) -> str:
    """`[site] appliance`, or the host name when it is empty."""
    return configured or socket.gethostname()


def build_telemetry(inventory, plan, *, worker_cores: dict[str, list[int]] | None = None,
                    weight_bytes: float = 2.0, worker_pids=lambda: {}, site: str = "local",
                    appliance: str = "", sample_interval_s: float = 1.0,
                    retain_s: float = 600.0, rapl_dir: str = RAPL_DIR,
                    cpu_idle_w_per_core: float = 1.5, cpu_busy_w_per_core: float = 3.5,
                    nvml=None) -> Telemetry:
    """One sampler per device kind present. `worker_cores`: the cores each CPU worker is
    pinned to (its share of the CPU device); `weight_bytes`: bytes per weight of the served
    model (the simulated power model's ridge point); `nvml`: a `partitions.nvml.Nvml`
    (tests pass one over a fake module)."""
    worker_cores = worker_cores or {}
    devices, samplers = [], []
    cpus = [d for d in inventory.devices if d.kind == "cpu"]
    gpus = [d for d in inventory.devices if d.kind == "gpu"]
    cpu_samplers = {}
    for d in cpus:
        sampler = CpuSampler(d.id, worker_pids=worker_pids, rapl_dir=rapl_dir,
                             idle_w_per_core=cpu_idle_w_per_core,
                             busy_w_per_core=cpu_busy_w_per_core, cores=d.cores or None)
        cpu_samplers[d.id] = sampler
        samplers.append(sampler)
    if gpus:
        samplers.append(NvmlSampler([(d.id, d.index) for d in gpus], nvml=nvml))
    for d in inventory.devices:
        model = None
        idle = None
        if d.kind == "sim" and d.spec is not None:
            model = SimPowerModel.for_gpu(d.spec, weight_bytes)
            idle = model.idle_w
        elif d.kind == "gpu" and d.spec is not None:
            idle = d.spec.idle_w
        elif d.kind == "cpu":
            idle = cpu_samplers[d.id].idle_w
        devices.append(TelemetryDevice(d.id, d.name, d.kind, d.simulated, d.memory_bytes,
                                       idle, model))
    return Telemetry(devices, telemetry_workers(inventory, plan, worker_cores), samplers,
                     mode=plan.mode, site=site,
                     appliance=appliance_name(appliance), sample_interval_s=sample_interval_s,
                     retain_s=retain_s)


def telemetry_workers(inventory, plan, worker_cores: dict[str, list[int]] | None = None):
    """Each worker of the plan with its share of each of its devices."""
    worker_cores = worker_cores or {}
    by_id = {d.id: d for d in inventory.devices}
    workers = []
    for slot in plan.workers():
        shares = []
        for dev_id in slot.devices:
            dev = by_id[dev_id]
            if dev.kind == "cpu":
                cores = worker_cores.get(slot.worker) or []
                sharing = sum(1 for s in plan.workers() if dev_id in s.devices)
                shares.append(len(cores) / dev.cores if cores and dev.cores else 1.0 / sharing)
            else:
                shares.append(1.0)
        workers.append(TelemetryWorker(slot.worker, slot.role, tuple(slot.devices), tuple(shares)))
    return workers
