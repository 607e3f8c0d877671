"""Where workers run, decided before any starts: GPU workers see their own GPUs first and
then their peers (by UUID), and CPU workers split the cores of the daemon's cpuset."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest


def test_gpu_workers_see_their_own_gpus_first_then_their_peers():
    """CUDA_VISIBLE_DEVICES by UUID: own devices first, then the other phase's devices
    (CUDA IPC can only open a peer's pool on a visible GPU). Checked on the plan for a
    4-GPU box, without GPUs."""
    from appliance.config import Config
    from appliance.daemon.setup import worker_specs
    from appliance.daemon.workers import worker_env
    from appliance.partitions import Device, Inventory, lookup_gpu, plan_partition

    h100 = lookup_gpu("H100")
    gpus = tuple(Device(f"gpu{i}", "gpu", "NVIDIA H100 80GB HBM3", False, i, f"GPU-{i}",
                        spec=h100) for i in range(4))
    inv = Inventory(gpus, {(a.id, b.id): "nvlink" for a in gpus for b in gpus
                           if a.index < b.index}, "nvml", None)
    specs = worker_specs(Config(), inv, plan_partition(inv), "torch", Path("/models/x"))
    env = {s.worker: worker_env(s, {})["CUDA_VISIBLE_DEVICES"] for s in specs}
    assert env == {"prefill0": "GPU-0,GPU-2,GPU-3", "prefill1": "GPU-1,GPU-2,GPU-3",
                   "decode0": "GPU-2,GPU-0,GPU-1", "decode1": "GPU-3,GPU-0,GPU-1"}
    assert all(s.cpu_cores == [] and s.gpu_name == "H100-SXM" for s in specs)


@pytest.mark.parametrize("mode, threads, cores, want", [
    ("disagg", 0, [0, 1], {"prefill0": [0], "decode0": [1]}),           # this box
    ("disagg", 0, list(range(16)), {"prefill0": list(range(8)), "decode0": list(range(8, 16))}),
    ("disagg", 0, [2, 3, 5, 7, 11], {"prefill0": [2, 3], "decode0": [5, 7]}),   # a cpuset
    ("disagg", 3, list(range(16)), {"prefill0": [0, 1, 2], "decode0": [3, 4, 5]}),
    ("disagg", 0, [4], {"prefill0": [4], "decode0": [4]}),               # one core: shared
    ("disagg", 2, [0, 1, 2], {"prefill0": [0, 1], "decode0": [0, 2]}),   # too few: overlap
    ("agg", 0, list(range(8)), {"agg0": list(range(8))}),
    ("agg", 1, [0, 1], {"agg0": [0], "agg1": [1]}),                      # one per core
])
def test_cpu_workers_split_the_cores(mode, threads, cores, want):
    from appliance.config import Config
    from appliance.daemon.setup import worker_specs
    from appliance.partitions import discover, plan_partition

    cfg = Config()
    cfg.engine.cpu_threads = threads
    inv = discover("cpu")
    inv = dataclasses.replace(inv, devices=(dataclasses.replace(inv.devices[0], cores=len(cores)),))
    plan = plan_partition(inv, mode=mode, cpu_threads=threads)
    specs = worker_specs(cfg, inv, plan, "torch", Path("/m"), cores)
    assert {s.worker: s.cpu_cores for s in specs} == want
    assert {s.worker: s.cpu_threads for s in specs} == {
        w: threads or len(c) for w, c in want.items()}


@pytest.mark.parametrize("mode, threads, cores, engine, setting, want", [
    ("disagg", 0, [0, 1], "torch", "on", {"prefill0": -1, "decode0": 0}),       # this box
    ("disagg", 0, [2, 7], "torch", "on", {"prefill0": -1, "decode0": 2}),       # a cpuset
    ("disagg", 0, [0, 1], "torch", "off", {"prefill0": -1, "decode0": -1}),
    ("disagg", 0, [0, 1], "sim", "on", {"prefill0": -1, "decode0": -1}),
    ("disagg", 0, [4], "torch", "on", {"prefill0": -1, "decode0": -1}),         # shared core
    ("disagg", 0, list(range(16)), "torch", "on", {"prefill0": -1, "decode0": -1}),
    ("agg", 1, [0, 1], "torch", "on", {"agg0": -1, "agg1": -1}),
    ("disagg", 0, [0, 1], "torch", "auto+amx", {"prefill0": -1, "decode0": 0}),
    ("disagg", 0, [0, 1], "torch", "auto", {"prefill0": -1, "decode0": -1}),    # no AMX
])
def test_a_one_core_decode_worker_may_borrow_the_prefill_core(mode, threads, cores, engine,
                                                              setting, want, monkeypatch):
    """`engine.cpu_decode_helper = "on"` ("auto" on a CPU with AMX): a CPU decode worker of
    one core and one thread gets the prefill worker's core to borrow while it idles;
    workers of more threads (torch's path), agg workers, a shared core, other engines,
    "off" and "auto" on a CPU without AMX get none."""
    from appliance.config import Config
    from appliance.daemon.setup import worker_specs
    from appliance.partitions import devices, discover, plan_partition
    from appliance.worker.spec import WorkerSpec

    setting, _, amx = setting.partition("+")
    flags = {"avx512f", "avx512_bf16", *(["amx_bf16", "amx_tile"] if amx else [])}
    monkeypatch.setattr(devices, "cpu_flags", lambda *a: frozenset(flags))  # /proc/cpuinfo's
    cfg = Config()
    cfg.engine.cpu_threads = threads
    cfg.engine.cpu_decode_helper = setting
    inv = discover("cpu")
    inv = dataclasses.replace(inv, devices=(dataclasses.replace(inv.devices[0], cores=len(cores)),))
    plan = plan_partition(inv, mode=mode, cpu_threads=threads)
    specs = worker_specs(cfg, inv, plan, engine, Path("/m"), cores)
    assert {s.worker: s.cpu_helper_core for s in specs} == want
    assert {s.worker: s.cpu_helper_lender for s in specs} == {
        w: "prefill0" if core >= 0 else "" for w, core in want.items()}
    # the lender knows it lends (it takes its core back before each step); each borrower
    # has its own word in the lender's page
    lent = any(core >= 0 for core in want.values())
    assert {s.worker: s.cpu_core_lent for s in specs} == {
        w: w == "prefill0" and lent for w in want}
    assert {s.worker: s.cpu_helper_slot for s in specs} == {
        w: 0 if core >= 0 else -1 for w, core in want.items()}
    # through the process boundary as it goes (JSON on the worker's command line)
    assert [WorkerSpec.from_json(s.to_json()).cpu_helper_core for s in specs] == list(want.values())


def test_borrowers_of_one_core_get_their_own_slots_and_share_one_page():
    """Two decode workers borrowing one prefill worker's core: slots 0 and 1 of its page,
    which the daemon makes once (a memfd the size of the kernel's page) and gives to all
    three at every start; a worker that neither lends nor borrows gets none."""
    import os
    from appliance.daemon.setup import lend_prefill_cores
    from appliance.daemon.workers import LEND_PAGE_BYTES, WorkerPool
    from appliance.engines.cpu_kernels.core_lending import PAGE_BYTES
    from appliance.worker.spec import WorkerSpec

    def spec(name, role, core):
        return WorkerSpec(worker=name, role=role, engine="torch", model_dir="/m", devices=[],
                          device_kind="cpu", cpu_cores=[core], cpu_threads=1)
    specs = [spec("prefill0", "prefill", 0), spec("decode0", "decode", 1),
             spec("decode1", "decode", 2), spec("prefill1", "prefill", 3)]
    lend_prefill_cores(specs)
    by = {s.worker: s for s in specs}
    assert (by["decode0"].cpu_helper_lender, by["decode0"].cpu_helper_slot) == ("prefill0", 0)
    assert (by["decode1"].cpu_helper_lender, by["decode1"].cpu_helper_slot) == ("prefill1", 0)
    specs.append(spec("decode2", "decode", 4))
    lend_prefill_cores(specs)
    assert (by["decode0"].cpu_helper_slot, specs[-1].cpu_helper_lender,
            specs[-1].cpu_helper_slot) == (0, "prefill0", 1)
    pool = WorkerPool(specs)
    fds = {s.worker: pool.lend_page_fd(s) for s in specs}
    try:
        assert fds["prefill0"] == fds["decode0"] == fds["decode2"] != fds["prefill1"]
        assert fds["prefill1"] == fds["decode1"] is not None
        assert os.fstat(fds["prefill0"]).st_size == LEND_PAGE_BYTES == PAGE_BYTES
        assert pool.lend_page_fd(spec("agg0", "agg", 5)) is None
    finally:
        for fd in {fd for fd in fds.values() if fd is not None}:
            os.close(fd)


@pytest.mark.parametrize("mode, threads, cores, engine, want", [
    ("disagg", 0, [0, 1], "torch", [0]),                  # this box: the prefill core
    ("disagg", 0, list(range(8)), "torch", [0, 1, 2, 3]),
    ("disagg", 3, list(range(8)), "torch", [0, 1, 2, 6, 7]),   # cores no worker has, too
    ("disagg", 0, [4], "torch", None),                    # one core: nowhere else to go
    ("disagg", 0, [0, 1], "sim", None),                   # the simulator sleeps its steps
    ("agg", 1, [0, 1], "torch", None),                    # no decode worker
])
def test_the_daemon_keeps_off_the_torch_decode_workers_cores(mode, threads, cores, engine, want):
    """`engine.daemon_cores = "auto"` (`daemon.affinity`): the cores the daemon's threads
    keep to are the allowed ones no torch decode worker on the CPU is pinned to."""
    from appliance.config import Config
    from appliance.daemon.affinity import DaemonAffinity, daemon_cores
    from appliance.daemon.setup import worker_specs
    from appliance.partitions import discover, plan_partition

    cfg = Config()
    cfg.engine.cpu_threads = threads
    inv = discover("cpu")
    inv = dataclasses.replace(inv, devices=(dataclasses.replace(inv.devices[0], cores=len(cores)),))
    specs = worker_specs(cfg, inv, plan_partition(inv, mode=mode, cpu_threads=threads),
                         engine, Path("/m"), cores)
    assert daemon_cores(specs, cores) == want
    # GPU workers (no cores of their own) leave it anywhere; "all" never narrows it.
    gpu = [dataclasses.replace(s, device_kind="gpu", cpu_cores=[]) for s in specs]
    assert daemon_cores(gpu, cores) is None
    assert DaemonAffinity("all").update(specs, set()) is None


def test_daemon_cores_is_checked():
    from appliance.config import ConfigError, parse
    with pytest.raises(ConfigError, match="engine.daemon_cores must be auto or all"):
        parse('[engine]\ndaemon_cores = "decode"\n')
