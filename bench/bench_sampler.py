"""What the telemetry sampler itself costs: CPU time per second of sampling 8 devices at
10 Hz, measured as this process's CPU time over a real-time run of the hub's own sampling
loop (`Telemetry.run`, NVML reads in a worker thread as in the daemon).

    .venv/bin/python bench/bench_sampler.py [--seconds 10] [--hz 10]

Three setups, each 8 devices:
- nvml: 8 GPUs through the real NVML wrapper (`partitions.nvml.Nvml`) and sampler over
  tests/helpers/fake_nvml.py (GPM supported, so 10 NVML calls per device per sample). The fake is
  Python; real NVML calls go through ctypes into the driver and can cost more (some take
  milliseconds on a busy driver), so this measures our side of the cost only.
- sim: 8 simulated GPUs, power from their iterations, with the simulator's iteration
  records fed at --iter-rate per second (what a sped-up sim box sends); the feeding is
  measured separately (observe_iteration, per record).
- status: one /admin/v1/status snapshot of the sim hub (status_fields), per call: what
  each SSE event of /admin/v1/stream costs.

Goal (issue 11): <= 1% of one core for 8 devices at 10 Hz. Writes
bench/results/sampler.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import fake_nvml  # noqa: E402
from appliance.engines.messages import IterationRecord  # noqa: E402
from appliance.partitions import discover, plan_partition  # noqa: E402
from appliance.partitions.nvml import Nvml  # noqa: E402
from appliance.telemetry import Telemetry, TelemetryDevice, TelemetryWorker, build_telemetry  # noqa: E402
from appliance.telemetry.nvml_sampler import NvmlSampler  # noqa: E402
from appliance.telemetry.status import status_fields  # noqa: E402


def nvml_hub(hz: float) -> Telemetry:
    fake = fake_nvml.FakeNvml()                 # 8 H100s
    sampler = NvmlSampler([(f"gpu{i}", i) for i in range(8)], nvml=Nvml(module=fake))
    devices = [TelemetryDevice(f"gpu{i}", "H100", "gpu", False, idle_w=70.0) for i in range(8)]
    workers = [TelemetryWorker(f"prefill{i}", "prefill", (f"gpu{i}",)) for i in range(4)] + \
              [TelemetryWorker(f"decode{i}", "decode", (f"gpu{i + 4}",)) for i in range(4)]
    hub = Telemetry(devices, workers, [sampler], sample_interval_s=1.0 / hz)

    def tick():   # the counters move, as on a busy board
        for g in fake.gpus:
            g.energy_mj += 50_000
    hub._bench_tick = tick
    return hub


def sim_hub(hz: float) -> Telemetry:
    inv = discover("sim:8xH100")
    return build_telemetry(inv, plan_partition(inv), weight_bytes=1.0, sample_interval_s=1.0 / hz)


async def run_for(hub: Telemetry, seconds: float, iter_rate: float) -> dict:
    task = asyncio.create_task(hub.run())
    workers = list(hub.workers.values())
    fed = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    feed_cpu = 0.0
    end = wall0 + seconds
    while time.perf_counter() < end:
        await asyncio.sleep(0.01)
        tick = getattr(hub, "_bench_tick", None)
        if tick:
            tick()
        if iter_rate:
            f0 = time.process_time()
            now = time.time()
            for k in range(int(iter_rate * 0.01)):
                w = workers[(fed + k) % len(workers)]
                entries = ([("p", 3000, 3000)] if w.role == "prefill"
                           else [(f"d{i}", 1, 500) for i in range(32)])
                hub.observe_iteration(IterationRecord(w.id, w.role, now - 0.003, 0.003,
                                                      w.devices, True, entries))
            fed += int(iter_rate * 0.01)
            feed_cpu += time.process_time() - f0
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    task.cancel()
    samples = len(hub._samples[next(iter(hub.devices))])
    return {"wall_s": wall, "cpu_s": cpu - feed_cpu, "samples_per_device": samples,
            "iterations_fed": fed, "feed_cpu_s": feed_cpu}


async def idle_baseline(seconds: float) -> float:
    """This loop's own cost with no hub (10-ms sleeps): subtracted from the runs."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        await asyncio.sleep(0.01)
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def status_cost(hub: Telemetry, n: int = 50) -> float:
    rows = [{"role": w.role, "waiting": 1, "running": 8, "queued_prefill_tokens": 100}
            for w in hub.workers.values()]
    t0 = time.process_time()
    for _ in range(n):
        status_fields(hub, rows)
    return (time.process_time() - t0) / n


def sample_cost(hub: Telemetry, n: int = 300) -> float:
    """CPU seconds per `sample()` (all 8 devices read and taken in), called back to back."""
    tick = getattr(hub, "_bench_tick", None)
    t0 = time.process_time()
    for _ in range(n):
        if tick:
            tick()
        hub.sample()
    return (time.process_time() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--iter-rate", type=float, default=2000.0,
                    help="iteration records per second fed to the sim hub")
    args = ap.parse_args()
    base = asyncio.run(idle_baseline(min(args.seconds, 5.0)))
    out = {"machine": platform.processor() or platform.machine(), "hz": args.hz,
           "devices": 8, "loop_baseline_core_fraction": base}
    for name, make, rate in (("nvml", nvml_hub, 0.0), ("sim", sim_hub, args.iter_rate)):
        hub = make(args.hz)
        r = asyncio.run(run_for(hub, args.seconds, rate))
        r["core_fraction"] = max(0.0, r["cpu_s"] / r["wall_s"] - base)
        if r["iterations_fed"]:
            r["observe_iteration_us"] = r["feed_cpu_s"] / r["iterations_fed"] * 1e6
        if name == "sim":
            r["status_snapshot_ms"] = status_cost(hub) * 1e3
        r["sample_ms"] = sample_cost(hub) * 1e3
        r["sample_core_fraction_at_hz"] = r["sample_ms"] / 1e3 * args.hz
        out[name] = r
    print(f"{'setup':<6} {'samples/dev':>11} {'CPU % of one core':>18} {'ms/sample':>10}  notes")
    for name in ("nvml", "sim"):
        r = out[name]
        note = ""
        if name == "sim":
            note = (f"observe_iteration {r['observe_iteration_us']:.1f} us/record; "
                    f"status snapshot {r['status_snapshot_ms']:.2f} ms")
        print(f"{name:<6} {r['samples_per_device']:>11} {100 * r['core_fraction']:>17.2f}% "
              f"{r['sample_ms']:>10.3f}  {note}")
    print(f"(loop baseline {100 * base:.2f}% subtracted)")
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "sampler.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
