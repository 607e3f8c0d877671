"""keep_freed_memory: freed scratch memory is reused without page faults (glibc only).

Each case runs in a fresh interpreter: malloc settings are process-wide and one-way.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.memory_maps import resident_bytes

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")

SCRIPT = r"""
import json, resource, sys
import torch
from appliance.engines.cpu_heap import keep_freed_memory

ok = keep_freed_memory() if sys.argv[1] == "keep" else None
again = keep_freed_memory() if sys.argv[1] == "keep" else None

def faults_of_one_step():
    # A step's scratch: five 16 MiB tensors alive at once (gathered K and V, activations),
    # written, then all freed at the end of the step.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones(4 << 20) for _ in range(5)]
    del xs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(json.dumps(dict(ok=ok, again=again, faults=[faults_of_one_step() for _ in range(8)])))
"""


def _run(mode: str) -> dict:
    # (Without the settings, glibc's adaptive thresholds make this pattern fault every step
    # or only the first few, depending on what the process allocated before; only the
    # kept behaviour is deterministic enough to assert.)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                       timeout=120, check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(r.stdout)


def test_steps_reuse_freed_scratch_memory():
    keep = _run("keep")
    assert keep["ok"] is True and keep["again"] is True
    assert keep["faults"][0] > 15_000       # 80 MiB really was touched: ~20,000 pages
    assert sum(keep["faults"][4:]) < 100    # ... and later steps found it still mapped


def test_pool_populator_faults_pages_in_and_keeps_what_they_hold():
    """MADV_POPULATE_WRITE commits the pages without writing them: what the worker wrote
    before and while the thread ran stays, and the whole range is resident after."""
    import torch

    from appliance.engines import cpu_kernels
    from appliance.engines.cpu_heap import PoolPopulator

    pool = cpu_kernels.huge_page_zeros(32 << 20, torch.float32)       # 128 MiB, untouched
    pool[:4096] = 7.0
    PoolPopulator.CHUNK, chunk = 1 << 20, PoolPopulator.CHUNK          # many calls
    try:
        populator = PoolPopulator(pool)
        pool[-4096:] = 3.0                                             # meanwhile
        assert populator.finished.wait(120)
    finally:
        PoolPopulator.CHUNK = chunk
    if populator.error is not None:
        pytest.skip(f"this kernel has no MADV_POPULATE_WRITE: {populator.error}")
    assert populator.share == 1.0 and populator.cpu_s > 0
    assert bool(pool[:4096].eq(7.0).all()) and bool(pool[-4096:].eq(3.0).all())
    assert float(pool[4096:-4096].abs().sum()) == 0.0
    # resident: the mapping the pool lies in holds it all in memory
    assert (resident_bytes(pool.data_ptr()) or 0) >= 128 << 20


def test_a_pool_dropped_while_it_populates_is_freed_where_it_was_dropped():
    """The thread never holds the pool: the worker that drops it frees it there and then,
    and the thread stops at its next call. (Held by the thread for the length of a call,
    the pool was mostly freed by the thread; as the interpreter finalized, that aborted
    the process.)"""
    import threading
    import weakref

    import torch

    from appliance.engines import cpu_kernels
    from appliance.engines.cpu_heap import PoolPopulator

    size = 256 << 20
    PoolPopulator.CHUNK, chunk = 1 << 20, PoolPopulator.CHUNK          # a call at a time
    try:
        for _attempt in range(5):
            pool = cpu_kernels.huge_page_zeros(size // 4, torch.float32)   # untouched
            freed_in: list[str] = []
            weakref.finalize(pool, lambda: freed_in.append(threading.current_thread().name))
            populator = PoolPopulator(pool)
            while populator.done == 0 and not populator.finished.is_set():
                threading.Event().wait(0.001)                          # the thread is under way
            if populator.error is not None:
                pytest.skip(f"this kernel has no MADV_POPULATE_WRITE: {populator.error}")
            del pool
            assert freed_in == [threading.current_thread().name]       # here, at once
            # The drop came with at least one call still to come, which must see it (on a
            # loaded machine this thread can stall until the pool is all but faulted in:
            # then the case did not happen, and it is tried again).
            if populator.done <= size - 2 * PoolPopulator.CHUNK:
                break
            assert populator.finished.wait(30)
        else:
            pytest.fail("the populator faulted the whole pool in before it was dropped, 5 times")
        assert populator.finished.wait(30)
    finally:
        PoolPopulator.CHUNK = chunk
    assert populator.error == "the pool was freed" and populator.share < 1.0


RELEASE = r"""
import json
import torch
from appliance.engines.cpu_heap import keep_freed_memory, release_freed

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("RssAnon:"))

keep_freed_memory()
# A load's pattern: each weight read (1 MiB), then a copy kept in another layout; the
# reads are freed between the kept copies, so no free heap top is left to trim.
kept, read = [], []
for _ in range(96):
    read.append(torch.ones(1 << 18))
    kept.append(torch.ones(1 << 18))
del read
before = anon()
released = release_freed()
after = anon()
print(json.dumps(dict(released=released, freed=before - after,
                      kept=float(sum(t.sum() for t in kept)))))
"""


def test_release_freed_gives_a_loads_freed_heap_back():
    """With freed memory kept (as a worker keeps it), what a load freed stays resident
    until `release_freed`, which the worker calls once its model is built."""
    r = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                       timeout=120, check=True, cwd=Path(__file__).resolve().parents[2])
    out = json.loads(r.stdout)
    assert out["released"] is True
    assert out["freed"] > 64 << 20          # most of the 96 MiB freed went back
    assert out["kept"] == 96 * (1 << 18)    # and the kept copies are whole
