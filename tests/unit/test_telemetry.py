"""The telemetry package without a daemon: bins and windows, the samplers (fake NVML,
RAPL files in a tmp dir, the CPU model, the simulated power model), the ratio, latency."""
from __future__ import annotations

import os
import re
from collections import namedtuple
from pathlib import Path

import pytest

from helpers import fake_nvml
from appliance.accounting.records import RequestRecord
from appliance.engines.messages import IterationRecord
from appliance.partitions import discover, plan_partition
from appliance.partitions import nvml as nvml_module
from appliance.partitions.catalogue import H100_SXM, H200
from appliance.partitions.nvml import Nvml
from appliance.telemetry import (
    ESTIMATED, MEASURED, SIMULATED, DeviceSample, Telemetry, TelemetryDevice, TelemetryWorker,
    build_telemetry,
)
from appliance.telemetry.bins import Bins
from appliance.telemetry.cpu import CpuSampler, Rapl
from appliance.telemetry.nvml_sampler import NvmlSampler
from appliance.telemetry.status import latency, metric_values, status_fields
from appliance.telemetry.sim_power import CEIL, FLOOR, SimPowerModel, ridge_tokens

TELEMETRY_DIR = Path(__file__).resolve().parents[2] / "appliance" / "telemetry"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def it(worker, phase, start, wall, devices, entries=(("r", 1, 10),)):
    return IterationRecord(worker, phase, start, wall, tuple(devices), True, list(entries))


# --------------------------------------------------------------------------- bins

def test_bins_split_an_interval_exactly_across_edges():
    b = Bins(0.25, 10.0, 1)
    b.add(0.875, 1.625, (0.75,))          # 0.125 in bin 3, 0.5 in bins 4-5, 0.125 in bin 6
    assert b.sum_bins(3, 4) == [0.125]
    assert b.sum_bins(4, 6) == [0.5]
    assert b.sum(1.0, 1.5) == [0.5]        # whole bins: exact
    assert b.sum(0.0, 2.0) == [0.75]
    # A ragged edge pro-rates its bin as if uniform inside it (true: 0.125); the hub's
    # windows end on bin edges for this reason.
    assert b.sum(1.5, 1.625) == pytest.approx([0.0625])


def test_bins_forget_what_is_older_than_their_span():
    b = Bins(1.0, 5.0, 1)
    b.add(0.0, 0.5, (1.0,))
    b.add(100.0, 100.5, (2.0,))            # the ring moved on: bin 0 is gone
    assert b.sum(0.0, 1.0) == [0.0]
    assert b.sum(99.0, 101.0) == [2.0]
    b.add(0.0, 0.5, (5.0,))                # too old to record
    assert b.sum(0.0, 200.0) == [2.0]


# --------------------------------------------------------------------------- windows

def _sim_hub(clock, mode="disagg", spec=H100_SXM, **kw):
    model = SimPowerModel.for_gpu(spec, weight_bytes=1.0)
    devices = [TelemetryDevice("sim0", spec.name, "sim", True, spec.mem_bytes, spec.idle_w, model),
               TelemetryDevice("sim1", spec.name, "sim", True, spec.mem_bytes, spec.idle_w, model)]
    if mode == "agg":
        workers = [TelemetryWorker("agg0", "agg", ("sim0",)), TelemetryWorker("agg1", "agg", ("sim1",))]
    else:
        workers = [TelemetryWorker("prefill0", "prefill", ("sim0",)),
                   TelemetryWorker("decode0", "decode", ("sim1",))]
    return Telemetry(devices, workers, mode=mode, clock=clock, bin_s=0.125, **kw)


def test_busy_fraction_clips_iterations_to_the_window_exactly():
    clock = Clock(1000.0)
    hub = _sim_hub(clock)
    # Windows end on the last bin edge before now: 1100.0. The 1-s window is [1099, 1100).
    hub.observe_iteration(it("prefill0", "prefill", 1098.5, 0.75, ["sim0"]))   # 0.25 inside
    hub.observe_iteration(it("prefill0", "prefill", 1099.5, 0.25, ["sim0"]))   # all inside
    hub.observe_iteration(it("prefill0", "prefill", 1099.875, 0.5, ["sim0"]))  # 0.125 inside
    clock.t = 1100.0625
    st = status_fields(hub, [])
    pre = st["groups"]["prefill"]
    assert pre["busy_fraction"]["1s"] == pytest.approx(0.625, abs=1e-9)
    assert pre["gpu_seconds"]["1s"] == pytest.approx(0.625, abs=1e-9)
    # The 10-s window holds all of the first two and the third up to the edge.
    assert pre["gpu_seconds"]["10s"] == pytest.approx(0.75 + 0.25 + 0.125, abs=1e-9)
    assert pre["busy_fraction"]["60s"] == pytest.approx(1.125 / 60, abs=1e-9)
    dev = next(d for d in st["devices"] if d["id"] == "sim0")
    assert dev["busy_fraction"]["1s"] == pytest.approx(0.625, abs=1e-9)
    assert st["groups"]["decode"]["busy_fraction"]["1s"] == 0.0
    # Counters see the whole of every iteration at once.
    assert metric_values(hub)["group_busy_seconds"]["prefill"] == pytest.approx(1.5)


def test_tp_worker_counts_every_device_and_group_capacity():
    clock = Clock(1000.0)
    devices = [TelemetryDevice(f"sim{i}", "H100-SXM", "sim", True) for i in range(4)]
    workers = [TelemetryWorker("prefill0", "prefill", ("sim0", "sim1")),
               TelemetryWorker("decode0", "decode", ("sim2", "sim3"))]
    hub = Telemetry(devices, workers, clock=clock, bin_s=0.125)
    hub.observe_iteration(it("prefill0", "prefill", 1000.0, 0.5, ["sim0", "sim1"]))
    clock.t = 1001.0
    pre = status_fields(hub, [])["groups"]["prefill"]
    assert pre["gpu_seconds"]["1s"] == pytest.approx(1.0)      # 2 devices x 0.5 s
    assert pre["busy_fraction"]["1s"] == pytest.approx(0.5)    # of 2 device-seconds


def test_ratio_in_three_currencies_and_history():
    clock = Clock(1000.0)
    hub = _sim_hub(clock)
    prompt = [("p", 4000, 4000)]
    batch = [(f"d{i}", 1, 500) for i in range(32)]
    for k in range(8):                          # 8 s: prefill busy 0.5 s/s, decode 0.25 s/s
        hub.observe_iteration(it("prefill0", "prefill", 1000 + k, 0.5, ["sim0"], prompt))
        hub.observe_iteration(it("decode0", "decode", 1000 + k, 0.25, ["sim1"], batch))
    clock.t = 1010.0
    hub.sample()
    st = status_fields(hub, [])
    r = st["ratio"]
    assert r["window"] == "10s"
    assert r["gpu_seconds"] == pytest.approx(2.0)
    model = hub.devices["sim0"].power_model
    p_pre, p_dec = model.power_w("prefill", prompt), model.power_w("decode", batch)
    e_pre = model.idle_w * 10 + (p_pre - model.idle_w) * 4.0
    e_dec = model.idle_w * 10 + (p_dec - model.idle_w) * 2.0
    assert r["energy"] == pytest.approx(e_pre / e_dec, rel=1e-4)
    assert r["activity"] == pytest.approx(2.0)       # simulated: activity = util = busy
    assert st["sources"] == {"energy": SIMULATED, "utilization": SIMULATED, "activity": "utilization"}
    hist = dict((int(t), v) for t, v in r["history"])
    assert hist[1001] == pytest.approx(2.0) and hist[1009] is None   # second 1008-1009 idle
    tps = st["groups"]["prefill"]["tokens_per_s"]["10s"]
    assert tps == pytest.approx(8 * 4000 / 10)
    assert st["phase_tokens_per_s"]["decode"]["10s"] == pytest.approx(8 * 32 / 10)


def test_ratio_is_null_without_decode_time_and_in_agg_mode():
    clock = Clock(1000.0)
    hub = _sim_hub(clock)
    hub.observe_iteration(it("prefill0", "prefill", 1005, 0.5, ["sim0"]))
    clock.t = 1010.0
    assert status_fields(hub, [])["ratio"]["gpu_seconds"] is None
    agg = _sim_hub(clock, mode="agg")
    agg.observe_iteration(it("agg0", "prefill", 1005, 0.5, ["sim0"]))
    agg.observe_iteration(it("agg1", "decode", 1005, 0.5, ["sim1"]))
    st = status_fields(agg, [])
    assert list(st["groups"]) == ["agg"]
    assert st["ratio"]["gpu_seconds"] is None and st["ratio"]["history"] == []
    assert st["groups"]["agg"]["gpu_seconds"]["10s"] == pytest.approx(1.0)


def test_queue_depths_come_from_the_workers_rows():
    hub = _sim_hub(Clock())
    rows = [{"role": "prefill", "waiting": 3, "running": 1, "queued_prefill_tokens": 900},
            {"role": "decode", "waiting": 0, "running": 40, "queued_prefill_tokens": 0},
            {"role": "prefill", "waiting": None, "running": None, "queued_prefill_tokens": None}]
    g = status_fields(hub, rows)["groups"]
    assert g["prefill"]["queue"] == {"waiting": 3, "queued_prefill_tokens": 900, "running": 1}
    assert g["decode"]["queue"]["running"] == 40


def _request(arrival, first, finish, tokens, choices=1):
    return RequestRecord("id", "t", "m", "chat", 10, tokens, 0, arrival, first, finish,
                         "prefill0", "decode0", "ok", "stop", choices=choices)


def test_latency_percentiles_and_requests_per_s():
    clock = Clock(1000.0)
    hub = _sim_hub(clock)
    for i in range(100):   # TTFT i ms; ITL (finish - first) / (tokens - 1) = 10 ms
        hub.observe_request(_request(990.0, 990.0 + i / 1000, 990.0 + i / 1000 + 0.5, 51))
    hub.observe_request(_request(995.0, 995.1, 995.1, 1))    # 1 token: no ITL
    hub.observe_request(_request(995.0, 995.1, 995.5, 6, choices=2))   # 3 per choice: 0.2
    lat = latency(hub)
    assert lat["ttft_p50_s"] == pytest.approx(0.05)     # nearest rank of 102: the 51st
    assert lat["ttft_p99_s"] == pytest.approx(0.1)
    assert lat["itl_p50_s"] == pytest.approx(0.01)
    assert lat["itl_p99_s"] == pytest.approx(0.01)
    assert lat["requests"] == 102
    assert status_fields(hub, [])["requests_per_s"] == pytest.approx(10.2)
    clock.t = 1100.0       # all older than 60 s
    assert latency(hub)["ttft_p50_s"] is None


# --------------------------------------------------------------------------- sim power

def test_sim_power_model_prefill_near_tdp_decode_well_below():
    m = SimPowerModel.for_gpu(H200, weight_bytes=1.0)         # Llama-70B FP8 on an H200
    assert m.ridge == pytest.approx(ridge_tokens(H200.flops_fp8, H200.mem_bw, 1.0))
    prefill = m.power_w("prefill", [("p", 4000, 4000)])
    decode = m.power_w("decode", [(f"d{i}", 1, 1000) for i in range(16)])
    assert prefill > 0.85 * H200.tdp_w and prefill <= H200.tdp_w
    assert 137 <= decode <= 300                  # DOMAIN.md: decode draws ~137-300 W of 700 W
    idle_gap = m.power_w("kv_import", [("x", 0, 100)]) - H200.idle_w
    assert idle_gap == pytest.approx((H200.tdp_w - H200.idle_w) * FLOOR)
    assert CEIL < 1.0


def test_sim_prefill_draws_more_energy_than_decode_at_equal_busy_time():
    clock = Clock(1000.0)
    hub = _sim_hub(clock)
    hub.observe_iteration(it("prefill0", "prefill", 1000.0, 2.0, ["sim0"], [("p", 8000, 8000)]))
    hub.observe_iteration(it("decode0", "decode", 1000.0, 2.0, ["sim1"],
                             [(f"d{i}", 1, 500) for i in range(8)]))
    clock.t = 1005.0
    e_pre, src = hub.energy_j("sim0", 1000.0, 1004.0)
    e_dec, _ = hub.energy_j("sim1", 1000.0, 1004.0)
    assert src == SIMULATED
    model = hub.devices["sim0"].power_model
    assert e_pre == pytest.approx(model.idle_w * 4 + (model.power_w("prefill", [("p", 8000, 8000)])
                                                      - model.idle_w) * 2.0)
    assert e_pre > 1.5 * e_dec
    # Idle: exactly idle power over the span; none before the hub started.
    assert hub.energy_j("sim1", 1003.0, 1004.0)[0] == pytest.approx(H100_SXM.idle_w)
    assert hub.energy_j("sim1", 990.0, 1000.0)[0] == 0.0
    assert hub.idle_power_w("sim0") == H100_SXM.idle_w
    # The sampler's cumulative energy and power agree with the meter.
    samples = {s.device: s for s in hub.sample()}
    assert samples["sim0"].source == SIMULATED
    assert samples["sim0"].energy_j == pytest.approx(hub.energy_j("sim0", 1000.0, 1005.0)[0])
    assert samples["sim1"].power_w == pytest.approx(H100_SXM.idle_w)      # idle in the last 1 s


def test_build_telemetry_for_a_simulated_box():
    inv = discover("sim:8xH100")
    hub = build_telemetry(inv, plan_partition(inv), weight_bytes=1.0)
    assert hub.group_devices == {"prefill": ["sim0", "sim1", "sim2", "sim3"],
                                 "decode": ["sim4", "sim5", "sim6", "sim7"]}
    assert all(d.power_model is not None for d in hub.devices.values())
    assert hub.devices["sim0"].power_model.ridge == pytest.approx(
        ridge_tokens(H100_SXM.flops_fp8, H100_SXM.mem_bw, 1.0))
    rows = {d["id"]: d for d in status_fields(hub, [])["devices"]}
    assert rows["sim5"]["group"] == "decode" and rows["sim5"]["worker"] == "decode1"


# --------------------------------------------------------------------------- NVML

def _nvml_sampler(fake, clock, n=None):
    n = len(fake.gpus) if n is None else n
    return NvmlSampler([(f"gpu{i}", i) for i in range(n)], nvml=Nvml(module=fake), clock=clock)


def test_nvml_sampler_readings_energy_differences_and_gpm():
    fake = fake_nvml.FakeNvml(gpus=[fake_nvml.FakeGpu(util_gpu=87, memory_used=40 * 2**30,
                                                      temp_c=61, power_mw=612_345)])
    clock = Clock(1000.0)
    sampler = _nvml_sampler(fake, clock)
    first = sampler.read()[0]
    assert first.energy_j == 0.0 and first.source == MEASURED and not first.lost
    assert first.power_w == pytest.approx(612.345) and first.util == pytest.approx(0.87)
    assert first.mem_used_bytes == 40 * 2**30 and first.mem_total_bytes == fake_nvml.H100_MEMORY
    assert first.sm_clock_mhz == 1980.0 and first.temp_c == 61.0
    assert first.activity == {}                     # GPM needs two samples
    gpu = fake.gpus[0]
    gpu.energy_mj += 612_345
    gpu.gpm_values = {fake_nvml.NVML_GPM_METRIC_SM_UTIL: 72.5,
                      fake_nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0}   # no DRAM metric here
    clock.t += 1.0
    second = sampler.read()[0]
    assert second.energy_j == pytest.approx(612.345)
    assert second.activity == {"sm_activity": 0.725, "tensor_activity": 0.4}
    assert fake.gpm_live == 1                        # the previous sample was freed
    sampler.close()
    assert fake.gpm_live == 0


def test_nvml_missing_functions_are_none_and_asked_once():
    fake = fake_nvml.FakeNvml(gpus=[fake_nvml.FakeGpu(power_mw=300_000, gpm=False,
                                                      unsupported={"nvmlDeviceGetTemperature"})])
    fake.missing = {"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetClockInfo"}
    clock = Clock(1000.0)
    sampler = _nvml_sampler(fake, clock)
    samples = []
    for _ in range(3):
        samples.append(sampler.read()[0])
        clock.t += 2.0
    s = samples[-1]
    assert s.sm_clock_mhz is None and s.temp_c is None and s.activity == {}
    # No energy counter: the power readings integrated (300 W for 4 s).
    assert s.energy_j == pytest.approx(1200.0)
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert fake.calls["nvmlDeviceGetClockInfo"] == 1
    assert fake.calls["nvmlDeviceGetTemperature"] == 1     # NotSupported: remembered per device
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert fake.calls["nvmlGpmSampleAlloc"] == 0           # no GPM on this board


def test_nvml_lost_gpu_is_a_row_and_comes_back():
    fake = fake_nvml.FakeNvml(gpus=[fake_nvml.FakeGpu(), fake_nvml.FakeGpu()])
    clock = Clock(1000.0)
    sampler = _nvml_sampler(fake, clock)
    sampler.read()
    fake.gpus[1].lost_reads = True
    clock.t += 1
    ok, lost = sampler.read()
    assert not ok.lost and ok.power_w == 250.0
    assert lost.lost and lost.power_w is None and lost.util is None
    assert lost.energy_j == 0.0                    # the last energy known is kept
    fake.gpus[1].lost_reads = False
    fake.gpus[1].energy_mj += 1000
    clock.t += 1
    back = sampler.read()[1]
    assert not back.lost and back.energy_j == pytest.approx(1.0)


def test_nvml_init_failure_gives_rows_without_readings():
    fake = fake_nvml.FakeNvml(init_error=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    sampler = _nvml_sampler(fake, Clock(), n=2)
    assert "driver not loaded" in sampler.init_error
    rows = sampler.read()
    assert [r.device for r in rows] == ["gpu0", "gpu1"]
    assert all(r.power_w is None and r.energy_j is None for r in rows)


def test_nvml_through_the_hub_activity_uses_gpm_and_energy_is_measured():
    fake = fake_nvml.FakeNvml(gpus=[fake_nvml.FakeGpu(power_mw=600_000),
                                    fake_nvml.FakeGpu(power_mw=200_000)])
    clock = Clock(1000.0)
    devices = [TelemetryDevice("gpu0", "H100", "gpu", False, idle_w=70.0),
               TelemetryDevice("gpu1", "H100", "gpu", False, idle_w=70.0)]
    workers = [TelemetryWorker("prefill0", "prefill", ("gpu0",)),
               TelemetryWorker("decode0", "decode", ("gpu1",))]
    hub = Telemetry(devices, workers, [_nvml_sampler(fake, clock)], clock=clock, bin_s=0.125)
    for k in range(12):
        fake.gpus[0].energy_mj += 600_000            # 600 W
        fake.gpus[1].energy_mj += 200_000            # 200 W
        fake.gpus[0].gpm_values[fake_nvml.NVML_GPM_METRIC_SM_UTIL] = 90.0
        fake.gpus[1].gpm_values[fake_nvml.NVML_GPM_METRIC_SM_UTIL] = 30.0
        hub.observe_iteration(it("prefill0", "prefill", clock.t, 0.5, ["gpu0"]))
        hub.observe_iteration(it("decode0", "decode", clock.t, 0.5, ["gpu1"]))
        hub.sample()
        clock.t += 1.0
    st = status_fields(hub, [])
    assert st["sources"]["energy"] == MEASURED and st["sources"]["activity"] == "gpm_sm_activity"
    assert st["ratio"]["activity"] == pytest.approx(3.0)
    assert st["ratio"]["energy"] == pytest.approx(3.0, rel=1e-3)
    assert st["ratio"]["gpu_seconds"] == pytest.approx(1.0)
    # EnergyMeter between readings: interpolated (600 J per second).
    assert hub.energy_j("gpu0", 1002.25, 1005.75) == (pytest.approx(2100.0), MEASURED)
    assert hub.energy_j("gpu0", 900.0, 1001.0)[0] is None          # before the first reading
    assert metric_values(hub)["group_energy_joules"]["prefill"] == pytest.approx(11 * 600.0)


def test_idle_power_is_calibrated_from_idle_readings():
    fake = fake_nvml.FakeNvml(gpus=[fake_nvml.FakeGpu(power_mw=64_000)])
    clock = Clock(1000.0)
    hub = Telemetry([TelemetryDevice("gpu0", "H100", "gpu", False, idle_w=70.0)],
                    [TelemetryWorker("decode0", "decode", ("gpu0",))],
                    [_nvml_sampler(fake, clock)], clock=clock)
    assert hub.idle_power_w("gpu0") == 70.0                 # catalogue until calibrated
    for _ in range(7):
        hub.sample()
        clock.t += 1.0
    assert hub.idle_power_w("gpu0") == pytest.approx(64.0)


def test_telemetry_only_calls_listed_nvml_names():
    calls, consts = set(), set()
    for path in TELEMETRY_DIR.glob("*.py"):
        text = path.read_text()
        calls |= set(re.findall(r"\.call\(\s*\"(\w+)\"", text))
        consts |= set(re.findall(r"\.const\(\s*\"(\w+)\"", text))
        consts |= set(re.findall(r"\"(NVML_\w+)\"", text))
    assert calls and calls <= set(nvml_module.USED_FUNCTIONS)
    assert consts and consts <= set(nvml_module.USED_CONSTANTS)


def test_gpm_struct_matches_pynvml_fields():
    pynvml = pytest.importorskip("pynvml")
    real = [name for name, _ in pynvml.c_nvmlGpmMetricsGet_t._fields_]
    fake = list(vars(fake_nvml.c_nvmlGpmMetricsGet_t()))
    assert fake == real
    metric = [name for name, _ in pynvml.c_nvmlGpmMetric_t._fields_]
    assert set(vars(fake_nvml.FakeGpmMetric())) <= set(metric)


# --------------------------------------------------------------------------- CPU

def _rapl_zone(root: Path, name: str, energy: int, max_range: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "energy_uj").write_text(f"{energy}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range}\n")
    return zone


def test_rapl_sums_packages_and_handles_wraparound(tmp_path):
    p0 = _rapl_zone(tmp_path, "intel-rapl:0", 999_000_000, 1_000_000_000)
    p1 = _rapl_zone(tmp_path, "intel-rapl:1", 10_000_000, 1_000_000_000)
    _rapl_zone(tmp_path, "intel-rapl:0:0", 5, 1_000_000_000)        # a core domain: ignored
    rapl = Rapl(tmp_path)
    assert rapl.available and len(rapl.zones) == 2
    assert rapl.read() == 0.0
    (p0 / "energy_uj").write_text("3000000\n")        # wrapped: 1 J to the top + 3 J
    (p1 / "energy_uj").write_text("12000000\n")       # +2 J
    assert rapl.read() == pytest.approx(6.0)
    (p0 / "energy_uj").write_text("4000000\n")
    assert rapl.read() == pytest.approx(7.0)


def test_rapl_unreadable_means_not_available(tmp_path):
    assert not Rapl(tmp_path / "nothing").available
    zone = _rapl_zone(tmp_path, "intel-rapl:0", 1, 10)
    (zone / "energy_uj").unlink()
    assert not Rapl(tmp_path).available


CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")


def test_cpu_sampler_model_when_rapl_is_unreadable(tmp_path):
    clock = Clock(1000.0)
    times = [CpuTimes(10.0, 0, 5.0, 100.0, 1.0, 0, 0, 0, 3.0, 0)]
    sampler = CpuSampler("cpu0", rapl_dir=tmp_path, idle_w_per_core=2.0, busy_w_per_core=5.0,
                         clock=clock, cpu_times=lambda: times[-1], cores=4)
    first = sampler.read()[0]
    assert first.source == ESTIMATED and first.energy_j == 0.0 and first.power_w is None
    # 2 s later: 3 busy seconds (user + system), 5 idle: 1.5 busy cores of 4.
    times.append(CpuTimes(12.0, 0, 6.0, 105.0, 1.0, 0, 0, 0, 4.0, 0))
    clock.t += 2.0
    s = sampler.read()[0]
    assert s.util == pytest.approx(1.5 / 4)
    assert s.power_w == pytest.approx(4 * 2.0 + 1.5 * 5.0)
    assert s.energy_j == pytest.approx(2 * (8.0 + 7.5))
    assert sampler.idle_w == 8.0


def test_cpu_sampler_measures_with_rapl(tmp_path):
    zone = _rapl_zone(tmp_path, "intel-rapl:0", 0, 2**32)
    clock = Clock(1000.0)
    times = CpuTimes(1.0, 0, 1.0, 10.0, 0, 0, 0, 0, 0, 0)
    sampler = CpuSampler("cpu0", rapl_dir=tmp_path, clock=clock, cpu_times=lambda: times, cores=2)
    sampler.read()
    (zone / "energy_uj").write_text("50000000\n")
    clock.t += 2.0
    s = sampler.read()[0]
    assert s.source == MEASURED and s.energy_j == pytest.approx(50.0)
    assert s.power_w == pytest.approx(25.0)


def test_cpu_sampler_reads_each_workers_cpu_time(tmp_path):
    pids = {"prefill0": os.getpid()}
    sampler = CpuSampler("cpu0", rapl_dir=tmp_path, worker_pids=lambda: pids)
    sampler.read()
    start = sampler.worker_cpu_s["prefill0"]
    x = 0
    for i in range(2_000_000):     # burn some CPU in this process
        x += i * i
    sampler.read()
    assert sampler.worker_cpu_s["prefill0"] > start
    before = sampler.worker_cpu_s["prefill0"]
    pids["prefill0"] = os.getppid()        # "restarted": a new pid, time carried over
    sampler.read()
    assert sampler.worker_cpu_s["prefill0"] >= before


class _FakeCpu:
    """A blocking sampler standing in for the CPU: fixed power, worker CPU times given."""

    blocking = True
    devices = ("cpu0",)

    def __init__(self, clock):
        self.clock = clock
        self.energy = 0.0
        self.worker_cpu_s = {"prefill0": 0.0, "decode0": 0.0}

    def read(self):
        return [DeviceSample("cpu0", self.clock(), self.energy, 30.0, 0.5, None, None, None,
                             None, {}, ESTIMATED)]


def test_shared_cpu_energy_splits_by_worker_cpu_seconds():
    clock = Clock(1000.0)
    cpu = _FakeCpu(clock)
    hub = Telemetry([TelemetryDevice("cpu0", "cpu", "cpu", False, idle_w=3.0)],
                    [TelemetryWorker("prefill0", "prefill", ("cpu0",), (0.5,)),
                     TelemetryWorker("decode0", "decode", ("cpu0",), (0.5,))],
                    [cpu], clock=clock, bin_s=0.125)
    hub.sample()
    for _ in range(10):
        clock.t += 1.0
        cpu.energy += 30.0
        cpu.worker_cpu_s["prefill0"] += 0.75
        cpu.worker_cpu_s["decode0"] += 0.25
        hub.observe_iteration(it("prefill0", "prefill", clock.t - 1.0, 1.0, ["cpu0"]))
        hub.sample()
    totals = metric_values(hub)["group_energy_joules"]
    assert totals["prefill"] == pytest.approx(225.0) and totals["decode"] == pytest.approx(75.0)
    st = status_fields(hub, [])
    assert st["ratio"]["energy"] == pytest.approx(3.0, rel=0.02)
    # Busy time weighted by each worker's share of the CPU: 1 s per s on half of it.
    assert st["groups"]["prefill"]["busy_fraction"]["10s"] == pytest.approx(1.0, abs=0.02)
    assert st["groups"]["prefill"]["cpu_seconds"]["10s"] == pytest.approx(7.5, rel=0.05)
    row = next(d for d in st["devices"] if d["id"] == "cpu0")
    assert row["group"] == "decode+prefill" and row["source"] == ESTIMATED
    assert row["busy_fraction"]["10s"] == pytest.approx(0.5, abs=0.02)


def test_build_telemetry_for_the_cpu(tmp_path):
    inv = discover("cpu")
    plan = plan_partition(inv)
    cores = {"prefill0": [0], "decode0": [1]}
    hub = build_telemetry(inv, plan, worker_cores=cores, rapl_dir=str(tmp_path))
    w = hub.workers["prefill0"]
    assert w.shares == (1 / inv.devices[0].cores,)
    s = hub.sample()
    assert [x.device for x in s] == ["cpu0"] and s[0].source == ESTIMATED
    assert hub.idle_power_w("cpu0") == pytest.approx(1.5 * inv.devices[0].cores)
