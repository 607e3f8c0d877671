"""Device discovery, the NVML wrapper, the GPU catalogue and partition planning (no GPU needed)."""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from pathlib import Path

import pytest

from appliance.partitions import (
    Nvml,
    PlanError,
    discover,
    format_devices,
    inventory_json,
    lookup_gpu,
    match_nvml_name,
    plan_partition,
)
from appliance.partitions import nvml as nvml_module
from appliance.partitions.catalogue import CATALOGUE

from helpers import fake_nvml

# Import names through the one module object: two copies would mean two NVMLError trees.
FakeGpu, FakeNvml = fake_nvml.FakeGpu, fake_nvml.FakeNvml

PARTITIONS_DIR = Path(nvml_module.__file__).parent


def one_line(message: str) -> bool:
    return "\n" not in message and message.strip() == message and message != ""


def inv_from(fake: FakeNvml):
    return discover("auto", nvml=Nvml(module=fake))


def island_of(inv, device_id: str) -> int:
    return next(i for i, island in enumerate(inv.islands()) if device_id in island)


# --------------------------------------------------------------------------- catalogue


@pytest.mark.parametrize(
    "name, expected",
    [
        ("H100", "H100-SXM"),
        ("h100-80gb", "H100-SXM"),
        ("H100-SXM", "H100-SXM"),
        ("a100", "A100-80GB"),
        ("A100-80GB", "A100-80GB"),
        ("h200", "H200"),
        ("L40S", "L40S"),
        (" b200 ", "B200"),
    ],
)
def test_lookup_gpu_by_name_and_alias(name, expected):
    assert lookup_gpu(name).name == expected


def test_lookup_gpu_unknown_lists_known_names():
    with pytest.raises(ValueError) as err:
        lookup_gpu("H900")
    message = str(err.value)
    assert one_line(message)
    assert "H900" in message
    for spec in CATALOGUE:
        assert spec.name in message


def test_catalogue_figures_are_dense_and_consistent():
    names = {s.name for s in CATALOGUE}
    assert {"H100-SXM", "H200", "A100-80GB", "L40S", "B200"} <= names
    h100 = lookup_gpu("H100")
    assert h100.flops_bf16 == pytest.approx(989.5e12)  # dense, not the 1,979 sparse figure
    assert h100.flops_fp8 == pytest.approx(2 * h100.flops_bf16)
    assert lookup_gpu("A100").flops_fp8 == 0.0  # no FP8 tensor cores
    assert lookup_gpu("H200").mem_bw > h100.mem_bw
    assert not lookup_gpu("L40S").nvlink
    for spec in CATALOGUE:
        assert spec.tdp_w > spec.idle_w > 0
        assert spec.usd_per_hour > 0 and spec.embodied_kgco2e > 0 and spec.mem_bytes > 0


@pytest.mark.parametrize(
    "nvml_name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", None),  # different figures: better none than wrong
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", None),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA B200", "B200"),
        ("Tesla T4", None),
    ],
)
def test_match_nvml_name(nvml_name, expected):
    spec = match_nvml_name(nvml_name)
    assert (spec.name if spec else None) == expected


# --------------------------------------------------------------------------- nvml wrapper


def test_init_is_idempotent_and_shutdown_stops_calls():
    fake = FakeNvml()
    nvml = Nvml(module=fake)
    assert nvml.init() is None
    assert nvml.init() is None
    assert fake.calls["nvmlInit"] == 1
    assert nvml.call("nvmlDeviceGetCount") == 8
    nvml.shutdown()
    assert fake.calls["nvmlShutdown"] == 1
    assert nvml.call("nvmlDeviceGetCount", default=-1) == -1


INIT_FAILURES = [
    (fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML library not found (no NVIDIA driver installed?)"),
    (fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVIDIA driver not loaded"),
    (fake_nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "versions differ"),
    (fake_nvml.NVML_ERROR_NO_PERMISSION, "no permission"),
    (fake_nvml.NVML_ERROR_UNKNOWN, "NVML init failed: Unknown Error"),
]


@pytest.mark.parametrize("code, expected", INIT_FAILURES)
def test_init_failure_reasons(code, expected):
    reason = Nvml(module=FakeNvml(init_error=code)).init()
    assert reason is not None and one_line(reason)
    assert expected in reason


def test_init_without_pynvml_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    reason = Nvml().init()
    assert reason is not None and one_line(reason)
    assert "nvidia-ml-py" in reason


def test_call_before_init_returns_default():
    fake = FakeNvml()
    assert Nvml(module=fake).call("nvmlDeviceGetCount", default="n/a") == "n/a"
    assert fake.calls["nvmlDeviceGetCount"] == 0


def test_not_supported_is_remembered_per_call_site():
    fake = FakeNvml(gpus=[FakeGpu(mig=None), FakeGpu(mig=True)])
    nvml = Nvml(module=fake)
    nvml.init()
    h0 = nvml.call("nvmlDeviceGetHandleByIndex", 0)
    h1 = nvml.call("nvmlDeviceGetHandleByIndex", 1)
    assert nvml.call("nvmlDeviceGetMigMode", h0, default="N/A") == "N/A"
    assert nvml.call("nvmlDeviceGetMigMode", h0, default="N/A") == "N/A"
    assert fake.calls["nvmlDeviceGetMigMode"] == 1  # not retried on that GPU
    assert "Not Supported" in nvml.last_error
    assert nvml.call("nvmlDeviceGetMigMode", h1)[0] == fake_nvml.NVML_DEVICE_MIG_ENABLE  # other GPU still asked


def test_function_not_found_is_remembered_for_every_argument():
    fake = FakeNvml()
    calls = []

    def missing(handle):
        calls.append(handle)
        raise fake_nvml.NVMLError_FunctionNotFound()

    fake.nvmlDeviceGetName = missing
    nvml = Nvml(module=fake)
    nvml.init()
    h0 = nvml.call("nvmlDeviceGetHandleByIndex", 0)
    h1 = nvml.call("nvmlDeviceGetHandleByIndex", 1)
    assert nvml.call("nvmlDeviceGetName", h0) is None
    assert nvml.call("nvmlDeviceGetName", h1, default="?") == "?"
    assert len(calls) == 1


def test_function_absent_from_module_returns_default():
    nvml = Nvml(module=FakeNvml())
    nvml.init()
    assert nvml.call("nvmlDeviceGetSomethingNew", 1, default=0) == 0
    assert "not available" in nvml.last_error


def test_other_nvml_errors_return_default_and_are_retried():
    fake = FakeNvml(gpus=[FakeGpu(lost_reads=True)])
    nvml = Nvml(module=fake)
    nvml.init()
    handle = nvml.call("nvmlDeviceGetHandleByIndex", 0)
    assert nvml.call("nvmlDeviceGetName", handle) is None
    assert nvml.call("nvmlDeviceGetName", handle) is None
    assert fake.calls["nvmlDeviceGetName"] == 2  # a lost GPU may come back after a reset
    assert nvml.last_error == "nvmlDeviceGetName: GPU is lost"


# --------------------------------------------------------------------------- drift checks


def test_used_names_exist_in_real_pynvml_and_in_fake():
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml()
    names = nvml_module.USED_FUNCTIONS + nvml_module.USED_CONSTANTS + nvml_module.USED_ERRORS
    missing_real = [n for n in names if not hasattr(pynvml, n)]
    missing_fake = [n for n in names if not hasattr(fake, n)]
    assert missing_real == [] and missing_fake == []


def test_fake_matches_pynvml_signatures_constants_and_errors():
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml()
    for name in nvml_module.USED_FUNCTIONS:
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        mine = list(inspect.signature(getattr(fake, name)).parameters)
        assert mine == real, name
    for name in dir(fake_nvml):
        if name.startswith("NVML_"):
            assert getattr(fake_nvml, name) == getattr(pynvml, name), name
    for name in fake_nvml.ERROR_NAMES:
        real_cls = getattr(pynvml, name)
        fake_cls = getattr(fake_nvml, name)
        assert issubclass(real_cls, pynvml.NVMLError) and issubclass(fake_cls, fake_nvml.NVMLError)
        assert real_cls().value == fake_cls().value, name
        assert type(pynvml.NVMLError(real_cls().value)).__name__ == name
        assert type(fake_nvml.NVMLError(fake_cls().value)).__name__ == name


def test_code_only_calls_listed_nvml_names():
    used_calls, used_consts = set(), set()
    for path in PARTITIONS_DIR.glob("*.py"):
        text = path.read_text()
        used_calls |= set(re.findall(r"\.call\(\s*\"(\w+)\"", text))
        used_consts |= set(re.findall(r"\.const\(\s*\"(\w+)\"", text))
        used_consts |= set(re.findall(r"\(\"(NVML_\w+)\"", text))
    assert used_calls and used_calls <= set(nvml_module.USED_FUNCTIONS)
    assert used_consts and used_consts <= set(nvml_module.USED_CONSTANTS)


# --------------------------------------------------------------------------- discovery


def test_discover_all_nvlink_board():
    inv = inv_from(FakeNvml(gpus=[FakeGpu() for _ in range(8)], topology=fake_nvml.all_nvlink(8)))
    assert inv.source == "nvml" and inv.note is None
    assert [d.id for d in inv.devices] == [f"gpu{i}" for i in range(8)]
    gpu = inv.devices[3]
    assert (gpu.kind, gpu.index, gpu.simulated, gpu.lost) == ("gpu", 3, False, False)
    assert gpu.name == fake_nvml.H100_NAME and gpu.spec.name == "H100-SXM"
    assert gpu.memory_bytes == fake_nvml.H100_MEMORY
    assert gpu.uuid.startswith("GPU-")
    assert set(inv.links.values()) == {"nvlink"} and len(inv.links) == 28
    assert inv.islands() == [[f"gpu{i}" for i in range(8)]]


def test_discover_two_islands():
    inv = inv_from(FakeNvml(topology=fake_nvml.two_islands(8)))
    assert inv.islands() == [[f"gpu{i}" for i in range(4)], [f"gpu{i}" for i in range(4, 8)]]
    assert inv.link("gpu0", "gpu3") == "nvlink"
    assert inv.link("gpu5", "gpu1") == "pcie-system"


def test_discover_pcie_only():
    inv = inv_from(FakeNvml(topology=fake_nvml.pcie_only(8)))
    assert inv.islands() == [[f"gpu{i}"] for i in range(8)]
    assert inv.link("gpu0", "gpu1") == "pcie-switch"
    assert inv.link("gpu0", "gpu2") == "pcie-host-bridge"
    assert inv.link("gpu0", "gpu4") == "pcie-system"


def test_p2p_not_supported_falls_back_to_pcie_levels():
    fake = FakeNvml(topology=fake_nvml.all_nvlink(4), gpus=[FakeGpu() for _ in range(4)])
    fake.p2p_error = fake_nvml.NVML_ERROR_NOT_SUPPORTED
    inv = inv_from(fake)
    assert set(inv.links.values()) == {"pcie-system"}


def test_mig_mode_and_unknown_model():
    gpus = [FakeGpu(mig=True), FakeGpu(mig=None), FakeGpu(name="NVIDIA H100 PCIe", mig=False)]
    inv = inv_from(FakeNvml(gpus=gpus))
    assert [d.mig_enabled for d in inv.devices] == [True, False, False]
    assert inv.devices[2].spec is None


@pytest.mark.parametrize("code, expected", INIT_FAILURES)
def test_init_failure_falls_back_to_cpu_with_note(code, expected):
    inv = inv_from(FakeNvml(init_error=code))
    assert inv.source == "cpu"
    assert [d.id for d in inv.devices] == ["cpu0"]
    assert one_line(inv.note)
    assert inv.note.startswith("NVML unavailable: ") and inv.note.endswith("; using the CPU")
    assert expected in inv.note


def test_library_missing_note_is_exact():
    inv = inv_from(FakeNvml(init_error=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert inv.note == "NVML unavailable: NVML library not found (no NVIDIA driver installed?); using the CPU"


def test_zero_gpus_falls_back_to_cpu():
    inv = inv_from(FakeNvml(gpus=[]))
    assert inv.source == "cpu" and inv.note == "NVML found no GPUs; using the CPU"


def test_count_failure_mid_discovery_falls_back_to_cpu():
    inv = inv_from(FakeNvml(count_error=fake_nvml.NVML_ERROR_UNKNOWN))
    assert inv.source == "cpu"
    assert one_line(inv.note) and "could not count GPUs" in inv.note and "Unknown Error" in inv.note


@pytest.mark.parametrize("how", ["lost_handle", "lost_reads"])
def test_lost_gpu_becomes_a_row(how):
    gpus = [FakeGpu() for _ in range(8)]
    setattr(gpus[5], how, True)
    inv = inv_from(FakeNvml(gpus=gpus))
    assert inv.source == "nvml"
    lost = inv.devices[5]
    assert lost.id == "gpu5" and lost.lost and lost.kind == "gpu"
    assert "GPU is lost" in lost.name
    assert not any("gpu5" in pair for pair in inv.links)
    assert [d.lost for d in inv.devices].count(True) == 1
    assert "LOST" in format_devices(inv, None)

    plan = plan_partition(inv)
    used = [dev for w in plan.workers() for dev in w.devices]
    assert "gpu5" not in used and len(used) == 7
    assert (len(plan.prefill), len(plan.decode)) == (3, 4)
    assert "1 lost GPU excluded" in plan.reason


def test_all_gpus_lost_falls_back_to_cpu_and_keeps_rows():
    inv = inv_from(FakeNvml(gpus=[FakeGpu(lost_handle=True), FakeGpu(lost_handle=True)]))
    assert inv.source == "cpu"
    assert [d.id for d in inv.devices] == ["gpu0", "gpu1", "cpu0"]
    assert one_line(inv.note) and "none could be read" in inv.note
    plan = plan_partition(inv)
    assert [w.devices for w in plan.workers()] == [("cpu0",), ("cpu0",)]


def test_discovery_leaves_a_callers_session_open():
    fake = FakeNvml()
    nvml = Nvml(module=fake)
    discover("auto", nvml=nvml)
    assert nvml.initialised and fake.calls["nvmlShutdown"] == 0


def test_cpu_spec():
    inv = discover("cpu")
    assert inv.source == "cpu" and inv.note is None
    (cpu,) = inv.devices
    assert (cpu.id, cpu.kind, cpu.name, cpu.simulated) == ("cpu0", "cpu", "cpu", False)
    assert cpu.cores == len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------- sim specs


def test_sim_homogeneous():
    inv = discover("sim:8xH100")
    assert inv.source == "sim" and inv.note is None
    assert [d.id for d in inv.devices] == [f"sim{i}" for i in range(8)]
    d = inv.devices[2]
    assert d.simulated and d.kind == "sim" and d.spec.name == "H100-SXM" and d.name == "H100-SXM"
    assert d.uuid == "SIM-H100-SXM-2" and d.memory_bytes == d.spec.mem_bytes
    assert inv.islands() == [[f"sim{i}" for i in range(8)]]


def test_sim_mixed_and_alias():
    inv = discover("sim:4xH100+4xL40S")
    assert [d.spec.name for d in inv.devices] == ["H100-SXM"] * 4 + ["L40S"] * 4
    assert inv.link("sim0", "sim3") == "nvlink"
    assert inv.link("sim0", "sim4") == "pcie-system"
    assert inv.link("sim4", "sim5") == "pcie-system"  # L40S has no NVLink
    assert inv.islands()[0] == ["sim0", "sim1", "sim2", "sim3"]
    assert len(inv.islands()) == 5

    a100 = discover("SIM:2xa100-80gb")
    assert [d.spec.name for d in a100.devices] == ["A100-80GB", "A100-80GB"]


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("sim:", "empty sim spec"),
        ("sim:8H100", "malformed term '8H100'"),
        ("sim:xH100", "malformed term"),
        ("sim:4xH100+", "malformed term ''"),
        ("sim:-1xH100", "malformed term"),
        ("sim:0xH100", "count must be at least 1"),
        ("sim:8xH900", "unknown GPU 'H900'"),
        ("sim:100xH100", "more than 64 GPUs"),
        ("gpu", "unknown device spec 'gpu'"),
        ("", "unknown device spec ''"),
    ],
)
def test_sim_spec_errors(spec, fragment):
    with pytest.raises(ValueError) as err:
        discover(spec)
    message = str(err.value)
    assert one_line(message)
    assert fragment in message


def test_spec_errors_name_the_accepted_forms():
    for spec in ("sim:8H100", "bogus"):
        with pytest.raises(ValueError, match=r"sim:8xH100"):
            discover(spec)


# --------------------------------------------------------------------------- planning


def test_default_split_on_eight():
    plan = plan_partition(discover("sim:8xH100"))
    assert plan.mode == "disagg" and plan.tp == 1
    assert [w.worker for w in plan.prefill] == ["prefill0", "prefill1", "prefill2", "prefill3"]
    assert [w.devices for w in plan.prefill] == [("sim0",), ("sim1",), ("sim2",), ("sim3",)]
    assert [w.devices for w in plan.decode] == [("sim4",), ("sim5",), ("sim6",), ("sim7",)]
    assert {w.role for w in plan.prefill} == {"prefill"} and {w.role for w in plan.decode} == {"decode"}
    assert plan.agg == ()
    assert one_line(plan.reason)
    assert "8 simulated GPUs, tp=1: 4 prefill + 4 decode" in plan.reason


def test_odd_count_rounds_toward_decode():
    plan = plan_partition(discover("sim:7xH100"))
    assert (len(plan.prefill), len(plan.decode)) == (3, 4)


def test_tp2_on_two_islands_keeps_workers_inside_islands():
    inv = inv_from(FakeNvml(topology=fake_nvml.two_islands(8)))
    plan = plan_partition(inv, tp=2)
    assert (len(plan.prefill), len(plan.decode)) == (2, 2)
    for worker in plan.workers():
        assert len(worker.devices) == 2
        assert len({island_of(inv, d) for d in worker.devices}) == 1, worker
    # each phase contiguous: prefill on one board, decode on the other
    assert {island_of(inv, d) for w in plan.prefill for d in w.devices} == {0}
    assert {island_of(inv, d) for w in plan.decode for d in w.devices} == {1}
    assert "each worker inside one NVLink island" in plan.reason
    assert one_line(plan.reason)


def test_tp4_on_two_islands_is_one_island_per_worker():
    inv = inv_from(FakeNvml(topology=fake_nvml.two_islands(8)))
    plan = plan_partition(inv, tp=4)
    assert [w.devices for w in plan.workers()] == [
        ("gpu0", "gpu1", "gpu2", "gpu3"),
        ("gpu4", "gpu5", "gpu6", "gpu7"),
    ]


def test_tp2_without_nvlink_still_plans_and_says_so():
    inv = inv_from(FakeNvml(topology=fake_nvml.pcie_only(8)))
    plan = plan_partition(inv, tp=2)
    assert len(plan.workers()) == 4
    assert "span islands over PCIe" in plan.reason
    assert "no NVLink" in plan.reason


def test_tp1_on_two_islands_keeps_phases_together():
    inv = inv_from(FakeNvml(topology=fake_nvml.two_islands(8)))
    plan = plan_partition(inv, tp=1, split="3+5")
    assert [w.devices[0] for w in plan.prefill] == ["gpu0", "gpu1", "gpu2"]
    assert [w.devices[0] for w in plan.decode] == ["gpu3", "gpu4", "gpu5", "gpu6", "gpu7"]


def test_uneven_islands_pack_largest_first():
    # islands of 2 (gpu0-1) and 4 (gpu2-5): the tp=4 worker must take the 4-island
    links = {}
    for i in range(6):
        for j in range(i + 1, 6):
            same = (i < 2) == (j < 2)
            links[(i, j)] = fake_nvml.Link(nvlink=same, level=fake_nvml.NVML_TOPOLOGY_SYSTEM)
    inv = inv_from(FakeNvml(gpus=[FakeGpu() for _ in range(6)], topology=links))
    plan = plan_partition(inv, tp=2, split="2+1")
    assert [w.devices for w in plan.workers()] == [("gpu2", "gpu3"), ("gpu4", "gpu5"), ("gpu0", "gpu1")]
    assert "each worker inside one NVLink island" in plan.reason


@pytest.mark.parametrize(
    "split, tp, expected",
    [
        ("2+6", 1, (2, 6)),
        ("6+2", 1, (6, 2)),
        (" 1 + 3 ", 2, (1, 3)),
        ("1+2", 1, (1, 2)),
    ],
)
def test_manual_split_valid(split, tp, expected):
    plan = plan_partition(discover("sim:8xH100"), tp=tp, split=split)
    assert (len(plan.prefill), len(plan.decode)) == expected
    assert all(len(w.devices) == tp for w in plan.workers())
    assert "manual split" in plan.reason


def test_manual_split_with_idle_devices_says_so():
    plan = plan_partition(discover("sim:8xH100"), split="1+2")
    assert "uses 3 of 8 devices, 5 idle" in plan.reason


def test_manual_split_may_leave_a_remainder_when_tp_does_not_divide():
    plan = plan_partition(discover("sim:7xH100"), tp=2, split="1+2")
    assert len(plan.workers()) == 3 and "uses 6 of 7 devices" in plan.reason


@pytest.mark.parametrize(
    "split, tp, fragment",
    [
        ("4-4", 1, "malformed split '4-4'"),
        ("", 1, "malformed split ''"),
        ("a+b", 1, "malformed split"),
        ("4+4+1", 1, "malformed split"),
        ("0+4", 1, "zero prefill workers"),
        ("4+0", 1, "zero decode workers"),
        ("5+4", 1, "needs 9 devices, only 8 exist"),
        ("2+3", 2, "needs 10 devices, only 8 exist"),
    ],
)
def test_manual_split_rejected(split, tp, fragment):
    with pytest.raises(PlanError) as err:
        plan_partition(discover("sim:8xH100"), tp=tp, split=split)
    message = str(err.value)
    assert one_line(message) and fragment in message


@pytest.mark.parametrize(
    "spec, kwargs, fragment",
    [
        ("sim:8xH100", {"tp": 3}, "not divisible by tp=3"),
        ("sim:8xH100", {"tp": 16}, "tp=16 needs 16 devices per worker, only 8"),
        ("sim:8xH100", {"tp": 0}, "tp must be a whole number >= 1"),
        ("sim:8xH100", {"mode": "mixed"}, "unknown mode 'mixed'"),
        ("sim:8xH100", {"mode": "agg", "split": "4+4"}, "applies to disagg mode only"),
        ("sim:1xH100", {}, "disagg needs at least 2 workers"),
        ("sim:2xH100", {"tp": 2}, "or a smaller tp"),
        ("cpu", {"tp": 2}, "tp=2 needs GPUs"),
        ("cpu", {"split": "2+2"}, "not possible on the CPU"),
    ],
)
def test_plan_errors(spec, kwargs, fragment):
    with pytest.raises(PlanError) as err:
        plan_partition(discover(spec), **kwargs)
    message = str(err.value)
    assert one_line(message) and fragment in message
    assert isinstance(err.value, ValueError)


def test_single_gpu_disagg_suggests_agg():
    with pytest.raises(PlanError, match="--mode agg"):
        plan_partition(discover("sim:1xH100"))
    plan = plan_partition(discover("sim:1xH100"), mode="agg")
    assert [w.devices for w in plan.agg] == [("sim0",)]


def test_agg_mode_on_gpus():
    plan = plan_partition(discover("sim:8xH100"), mode="agg")
    assert plan.mode == "agg" and plan.prefill == () and plan.decode == ()
    assert [w.worker for w in plan.agg] == [f"agg{i}" for i in range(8)]
    assert {w.role for w in plan.agg} == {"agg"}
    assert plan_partition(discover("sim:8xH100"), mode="agg", tp=2).agg[3].devices == ("sim6", "sim7")


def test_cpu_plans():
    inv = discover("cpu")
    plan = plan_partition(inv)
    assert plan.mode == "disagg" and plan.tp == 1
    assert [(w.worker, w.role, w.devices) for w in plan.workers()] == [
        ("prefill0", "prefill", ("cpu0",)),
        ("decode0", "decode", ("cpu0",)),
    ]
    assert one_line(plan.reason) and "CPU" in plan.reason
    assert plan_partition(inv, split="1+1").workers() == plan.workers()
    agg = plan_partition(inv, mode="agg")
    assert [(w.worker, w.role, w.devices) for w in agg.agg] == [("agg0", "agg", ("cpu0",))]
    assert agg.prefill == () and agg.decode == ()


@pytest.mark.parametrize("cores, threads, workers", [
    (2, 0, 1), (2, 1, 2), (8, 3, 2), (8, 2, 4), (2, 4, 1), (1, 1, 1)])
def test_cpu_agg_workers_per_thread_count(cores, threads, workers):
    """Agg on the CPU: one worker on every core, or with engine.cpu_threads = T one per T
    cores; disagg is 1 + 1 whatever T."""
    import dataclasses
    inv = discover("cpu")
    inv = dataclasses.replace(inv, devices=(dataclasses.replace(inv.devices[0], cores=cores),))
    plan = plan_partition(inv, mode="agg", cpu_threads=threads)
    assert [(w.worker, w.role, w.devices) for w in plan.agg] == [
        (f"agg{i}", "agg", ("cpu0",)) for i in range(workers)]
    assert one_line(plan.reason) and f"{workers} agg worker" in plan.reason
    assert len(plan_partition(inv, cpu_threads=threads).workers()) == 2


# --------------------------------------------------------------------------- output


def test_json_contract():
    inv = inv_from(FakeNvml(init_error=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    plan = plan_partition(inv)
    out = inventory_json(inv, plan)
    assert set(out) == {"devices", "plan", "note", "source"}
    assert out["source"] == "cpu" and "driver not loaded" in out["note"]
    json.dumps(out)

    sim = discover("sim:8xH100")
    out = json.loads(json.dumps(inventory_json(sim, plan_partition(sim, tp=2))))
    device = out["devices"][0]
    assert {"id", "name", "kind", "simulated", "index", "uuid", "memory_bytes", "mig_enabled", "cores", "spec"} <= set(device)
    assert device["spec"] == "H100-SXM" and device["simulated"] is True
    assert set(out["plan"]) == {"mode", "prefill", "decode", "agg", "tp", "reason"}
    assert out["plan"]["prefill"][0] == {"worker": "prefill0", "devices": ["sim0", "sim1"]}
    assert out["plan"]["agg"] == [] and out["plan"]["tp"] == 2
    assert out["note"] is None and out["source"] == "sim"


def test_format_devices():
    inv = discover("sim:4xH100+4xL40S")
    text = format_devices(inv, plan_partition(inv))
    assert "(simulated)" in text and "80.0 GiB" in text and "48.0 GiB" in text
    assert "NVLink islands [sim0 sim1 sim2 sim3]" in text
    # Mixed box: prefill on the most FLOP/s per $ (L40S), decode on the most bandwidth
    # per $ (H100), from the catalogue's prices (Splitwise's placement).
    assert re.search(r"^\s+prefill0\s+sim4$", text, re.M)
    assert re.search(r"^\s+decode3\s+sim3$", text, re.M)
    assert "prefill on L40S, decode on H100-SXM" in text
    assert text.splitlines()[-1].startswith("reason: ")

    cpu = inv_from(FakeNvml(init_error=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    text = format_devices(cpu, plan_partition(cpu))
    assert "note: NVML unavailable: NVML library not found" in text
    assert "cpu0" in text


def test_fake_handles_are_unhashable_pointers_like_pynvmls():
    """pynvml's device handles are ctypes pointers: unhashable, a new object per call.
    The "not supported" memory must work with those (it keys by the device's address)."""
    import ctypes

    import pynvml
    fake = FakeNvml(gpus=[FakeGpu(mig=None), FakeGpu(mig=None)])
    nvml = Nvml(module=fake)
    nvml.init()
    a, b = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(0)
    for handle in (a, pynvml.c_nvmlDevice_t()):
        assert isinstance(handle, ctypes._Pointer)
        with pytest.raises(TypeError):
            hash(handle)
    assert a is not b and a != b
    for _ in range(3):      # a fresh handle each time, as callers get them
        assert nvml.call("nvmlDeviceGetMigMode", nvml.call("nvmlDeviceGetHandleByIndex", 0),
                         default="N/A") == "N/A"
    assert fake.calls["nvmlDeviceGetMigMode"] == 1
    nvml.call("nvmlDeviceGetMigMode", nvml.call("nvmlDeviceGetHandleByIndex", 1))
    assert fake.calls["nvmlDeviceGetMigMode"] == 2      # the other GPU is still asked


# ---- issue 24 §2: MIG and engines the plan cannot run ---------------------------------

def test_mig_enabled_gpus_are_left_out_of_the_plan_with_one_warning(caplog):
    gpus = [FakeGpu(mig=True)] + [FakeGpu(mig=False) for _ in range(3)] + [FakeGpu(mig=True)]
    inv = inv_from(FakeNvml(topology=fake_nvml.all_nvlink(5), gpus=gpus))
    with caplog.at_level("WARNING", logger="applianced.partitions"):
        plan = plan_partition(inv, tp=1, mode="agg")
    used = {d for s in plan.workers() for d in s.devices}
    assert used == {"gpu1", "gpu2", "gpu3"}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert one_line(warning) and warning.startswith("2 MIG-enabled GPUs excluded (gpu0, gpu4)")
    assert warning in plan.reason
    only_mig = inv_from(FakeNvml(gpus=[FakeGpu(mig=True), FakeGpu(mig=True)]))
    with pytest.raises(PlanError) as err:
        plan_partition(only_mig, tp=1, mode="disagg")
    assert one_line(str(err.value)) and "no usable devices: 2 MIG-enabled GPUs" in str(err.value)


def test_torch_engine_with_tp_above_1_is_refused_at_planning_time():
    from appliance.partitions.plan import check_engine
    plan2 = plan_partition(discover("sim:4xH100"), tp=2)
    with pytest.raises(PlanError) as err:
        check_engine(plan2, "torch")
    assert one_line(str(err.value)) and "devices.tp = 2" in str(err.value)
    check_engine(plan2, "trtllm")
    check_engine(plan2, "sim")
    check_engine(plan_partition(discover("sim:4xH100"), tp=1), "torch")
