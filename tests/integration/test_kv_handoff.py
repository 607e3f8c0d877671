"""The KV handoff across REAL processes started with exec (as the daemon starts workers),
never with multiprocessing: /dev/shm pools exported once as opaque bytes, imported by
another process, blocks copied both ways; then two real worker processes doing a
prefill -> decode handoff over their sockets."""
from __future__ import annotations
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from appliance.kv.handoff import allocate_pool, export_pool, import_pool

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

SHAPE = (2, 4, 64, 16, 2, 64)          # the tiny preset's layout, 64 blocks (4 MiB)


def pattern(block: int) -> torch.Tensor:
    """Known, block-specific contents for one block (all layers, K and V)."""
    g = torch.Generator().manual_seed(1000 + block)
    return torch.randn((SHAPE[0], SHAPE[1], SHAPE[3], SHAPE[4], SHAPE[5]), generator=g)


PEER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from appliance.kv.handoff import import_pool, allocate_pool
from appliance.kv.blocks import copy_blocks
from tests.integration.test_kv_handoff import pattern, SHAPE
handle = sys.stdin.buffer.read()
peer = import_pool(handle)
assert tuple(peer.tensor.shape) == SHAPE and peer.tensor.is_shared()
own = allocate_pool(SHAPE, torch.float32)
src, dst = [3, 17, 40], [0, 1, 2]
copy_blocks(peer.tensor, src, own, dst)          # the decode worker's handoff copy
for s, d in zip(src, dst):
    assert torch.equal(own[:, :, d], pattern(s)), f"block {s} differs after the copy"
assert own[:, :, 3:].abs().sum() == 0            # nothing else was written
# Write back into the exporter's pool: the mapping is shared, not a copy.
copy_blocks(own, [1], peer.tensor, [50])
print("OK", peer.shm_name)
"""


def test_pool_is_shared_with_an_execd_process():
    pool = allocate_pool(SHAPE, torch.float32)
    assert pool.is_shared() and float(pool.abs().sum()) == 0.0
    for b in (3, 17, 40):
        pool[:, :, b] = pattern(b)
    handle = export_pool(pool)
    # Opaque and small: names and sizes, never the 4 MiB of data.
    assert isinstance(handle, bytes) and len(handle) < 2048
    r = subprocess.run([sys.executable, "-c", PEER, str(ROOT)], input=handle,
                       capture_output=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stdout.decode().startswith("OK /torch_")
    assert torch.equal(pool[:, :, 50], pattern(17))       # the peer's write is visible here
    assert float(pool[:, :, 51:].abs().sum()) == 0.0
    # In-process import maps the same memory (two engines in one test process).
    again = import_pool(handle).tensor
    again[:, :, 60] = 5.0
    assert float(pool[:, :, 60].min()) == 5.0


def test_default_fd_strategy_cannot_cross_exec():
    """Why handoff.py uses file_system: the default strategy passes the fd through
    multiprocessing's resource_sharer, authenticated with the multiprocessing authkey,
    which an exec'd worker does not share."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing.reductions import reduce_tensor

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_descriptor")
    try:
        t = torch.ones(1024).share_memory_()
        handle = bytes(ForkingPickler.dumps(reduce_tensor(t)))
    finally:
        tmp.set_sharing_strategy(before)
    code = ("import pickle, sys, torch\n"
            "fn, args = pickle.loads(sys.stdin.buffer.read())\n"
            "print(float(fn(*args).sum()))\n")
    r = subprocess.run([sys.executable, "-c", code], input=handle, capture_output=True,
                       env=ENV, timeout=60)
    assert r.returncode != 0
    assert b"AuthenticationError" in r.stderr


# --------------------------------------------------------------------------- real workers


class WorkerProc:
    """One `python -m appliance worker` on a socketpair, as WorkerLink starts it."""

    def __init__(self, spec, events: queue.Queue):
        from appliance.worker import wire
        from appliance.daemon.workers import worker_command

        self.wire = wire
        self.id = spec.worker
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(worker_command(spec, child.fileno()),
                                     pass_fds=(child.fileno(),), env=ENV, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        child.close()
        self.sock = parent
        self.events = events
        self.hello = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                frame = self.wire.recv(self.sock)
            except OSError:
                frame = None
            self.events.put((self.id, frame))
            if frame is None:
                return

    def send(self, msg):
        self.sock.sendall(self.wire.pack([msg]))     # the daemon sends lists of messages

    def stop(self):
        from appliance.engines.messages import Shutdown
        try:
            self.send(Shutdown())
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


def test_two_worker_processes_hand_off_kv(tiny_model):
    from appliance.engines.messages import (
        AttachPeer, Decode, Hello, KvImported, Prefill, PrefillDone, Release, RequestFailed,
        SamplingParams, Tokens, WorkerStats,
    )
    from appliance.engines.torch_engine import build_torch_engine
    from appliance.worker.spec import WorkerSpec

    def spec(worker, role):
        return WorkerSpec(worker=worker, role=role, engine="torch", devices=["cpu"],
                          device_kind="cpu", model_dir=str(tiny_model),
                          kv_cache_bytes=128 * 65536, max_batch_tokens=512)

    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = {f"r{i}": [0] + [(37 * i + 11 * j) % 4000 + 5 for j in range(n)]
               for i, n in enumerate((3, 20, 33, 47, 8, 64))}

    # The same requests in-process, aggregated: the expected tokens.
    agg = build_torch_engine(spec("ref", "agg"), tiny_model)
    for rid, p in prompts.items():
        agg.add(Prefill(rid, p, params, handoff=False))
    expected: dict[str, list[int]] = {}
    while agg.has_work():
        for ev in agg.step():
            if isinstance(ev, Tokens):
                expected.setdefault(ev.request_id, []).extend(ev.tokens)

    events: queue.Queue = queue.Queue()
    workers = {"prefill0": WorkerProc(spec("prefill0", "prefill"), events),
               "decode0": WorkerProc(spec("decode0", "decode"), events)}
    try:
        stats: dict[str, WorkerStats] = {}
        got: dict[str, list[int]] = {}
        finished: set[str] = set()
        hellos = 0

        def pump(until, timeout=45.0):
            import time
            deadline = time.monotonic() + timeout
            nonlocal hellos
            while not until():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; got {got}, stats {stats}")
                try:
                    wid, frame = events.get(timeout=left)
                except queue.Empty:
                    continue
                w = workers[wid]
                if frame is None:
                    raise AssertionError(f"{wid} died: {w.proc.stderr.read().decode()[-3000:]}")
                for ev in frame:
                    if isinstance(ev, Hello):
                        # The daemon side sees plain bytes: nothing to unpickle, no torch.
                        # A decode worker's pool is its own (no peer maps it): no handle.
                        if wid == "prefill0":
                            assert isinstance(ev.peer_handle, bytes), type(ev.peer_handle)
                        else:
                            assert ev.peer_handle is None, type(ev.peer_handle)
                        w.hello = ev
                        hellos += 1
                    elif isinstance(ev, PrefillDone):
                        got[ev.request_id] = [ev.first_token]
                        assert ev.handle is not None
                        workers["decode0"].send(Decode(ev.request_id, prompts[ev.request_id],
                                                       ev.first_token, params, ev.handle))
                    elif isinstance(ev, KvImported):
                        workers[ev.source_worker].send(Release(ev.request_id))
                    elif isinstance(ev, Tokens):
                        got[ev.request_id].extend(ev.tokens)
                        if ev.finish_reason:
                            finished.add(ev.request_id)
                    elif isinstance(ev, RequestFailed):
                        raise AssertionError(f"{wid}: {ev}")
                    elif isinstance(ev, WorkerStats):
                        stats[wid] = ev

        pump(lambda: hellos == 2, timeout=60)
        p, d = workers["prefill0"], workers["decode0"]
        assert p.hello.layout == d.hello.layout
        # WorkerPool.on_ready: the decode worker learns the prefill worker's pool, once.
        d.send(AttachPeer(p.id, p.hello.peer_handle))
        for rid, prompt in prompts.items():
            p.send(Prefill(rid, prompt, params, handoff=True))
        pump(lambda: finished == set(prompts))
        assert got == expected
        total = p.hello.kv_blocks_total
        pump(lambda: all(s.kv_blocks_free == total and s.kv_blocks_handed_off == 0
                         and s.running == 0 for s in stats.values()) and len(stats) == 2)
    finally:
        for w in workers.values():
            w.stop()


EXPORTER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from appliance.kv.handoff import allocate_pool, export_pool
pool = allocate_pool((2, 1, 4, 16, 1, 8), torch.float32)
pool.fill_(2.0)
import os
os.write(1, export_pool(pool))
os.close(1)
sys.stdin.read()          # until the test closes stdin: then a clean exit
"""


@pytest.mark.parametrize("death", ["kill -9", "clean exit"])
def test_dead_exporters_pool_is_unlinked_on_forget(death):
    """A peer that restarted leaves its old pool behind; the importer unlinks its name
    (only once the owner is dead) so /dev/shm does not keep it while the importer lives,
    and without tripping torch's own refcounted unlink (which aborts on a missing name)."""
    from appliance.kv.handoff import forget_pool

    proc = subprocess.Popen([sys.executable, "-c", EXPORTER, str(ROOT)], env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        handle = proc.stdout.read()
        peer = import_pool(handle)
        path = Path("/dev/shm") / peer.shm_name.lstrip("/")
        assert float(peer.tensor.sum()) == 2.0 * peer.tensor.numel()
        forget_pool(peer, owner_dead=True)
        assert path.exists()                 # its owner lives: never unlinked under it
        peer = import_pool(handle)
        if death == "kill -9":
            proc.kill()
        else:
            proc.stdin.close()
        assert proc.wait(30) is not None
        assert float(peer.tensor.sum()) == 2.0 * peer.tensor.numel()   # still mapped
        forget_pool(peer, owner_dead=True)
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait()
