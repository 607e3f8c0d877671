"""The cross-box KV transport (appliance/kv/nixl_transport.py): two REAL processes, as a
prefill worker and a decode worker on two boxes would be, joined on loopback by NIXL.
This test process only relays what the boxes' control channel would carry (the pool
info and the handles, as JSON lines); the decode process PULLS the blocks with a NIXL
READ. Needs the `cluster` extra (nixl-cu12); without it those tests skip, saying so.

The descriptor arithmetic and the wire format are checked without nixl."""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from appliance.kv.nixl_transport import (
    INSTALL_HINT, NixlKvHandle, NixlPoolInfo, block_descriptors, from_json, nixl_available,
    to_json,
)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STDERR = subprocess.DEVNULL
SHAPE = (2, 4, 64, 16, 2, 64)          # the tiny preset's layout, 64 blocks (4 MiB)

needs_nixl = pytest.mark.skipif(
    not nixl_available(),
    reason=f"{INSTALL_HINT}; then: pytest tests/test_nixl_transport.py")

# One script, two roles. Lines in, lines out: the prefill side prints its pool info, then
# a handle per "handle <ttl_s> <ids,...>" line; the decode side connects to the info on
# its first line, then pulls each handle line ("<handle json>\t<dst ids>") and prints
# "OK <bytes> <elapsed_s>" or "ERR <ExceptionClass> <message>".
WORKER = r"""
import sys, time, torch
torch.set_num_threads(1)
from appliance.kv.nixl_transport import (NixlKvAgent, NixlKvHandle, NixlPoolInfo,
                                         KvTransferError, from_json, to_json)
SHAPE = (2, 4, 64, 16, 2, 64)

def pattern(block):
    g = torch.Generator().manual_seed(1000 + block)
    return torch.randn((SHAPE[0], SHAPE[1], SHAPE[3], SHAPE[4], SHAPE[5]), generator=g)

role = sys.argv[1]
# Each box sizes its own pool: the decode side's has more blocks (another row stride).
pool = torch.zeros(SHAPE if role == "prefill" else (2, 4, 80, 16, 2, 64))
if role == "prefill":
    for b in range(SHAPE[2]):
        pool[:, :, b] = pattern(b)
agent = NixlKvAgent(pool, name=f"{role}-worker")
if role == "prefill":
    print(to_json(agent.info()), flush=True)
    for line in sys.stdin:
        _, ttl, ids = line.split()
        h = agent.handle("req-1", [int(i) for i in ids.split(",")], 100, float(ttl))
        print(to_json(h), flush=True)
else:
    agent.connect(from_json(NixlPoolInfo, sys.stdin.readline()))
    print("READY", flush=True)
    quarantined = set()     # destination blocks of reads given up on while in flight
    for line in sys.stdin:
        text, dst = line.rstrip("\n").split("\t")
        h = from_json(NixlKvHandle, text)
        dst = [int(i) for i in dst.split(",")]
        before = pool.clone()
        t0 = time.monotonic()
        try:
            n = agent.pull(h, dst)
        except KvTransferError as exc:
            # A refused pull must not have written anything (it read nothing).
            kept = "kept" if torch.equal(pool, before) else "WROTE"
            if exc.dst_unsafe:
                quarantined.update(dst)
            print("ERR", type(exc).__name__, kept, str(exc).replace("\n", " "), flush=True)
            continue
        for s, d in zip(h.block_ids, dst):
            if not torch.equal(pool[:, :, d], pattern(s)):
                print("ERR Mismatch", f"block {s}->{d} differs", flush=True)
                break
        else:
            others = [b for b in range(pool.shape[2]) if b not in dst and b not in quarantined]
            untouched = torch.equal(pool[:, :, others], before[:, :, others])
            print("OK" if untouched else "ERR Overwrote", n, time.monotonic() - t0, flush=True)
agent.close()
"""


class Box:
    """One worker process, line-driven, with a bounded wait for each answer."""

    def __init__(self, role: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, role], env={**ENV, **(env or {})}, cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=STDERR)

    def ask(self, line: str | None = None, timeout: float = 60.0) -> str:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no answer within {timeout} s (hang)")
        out = self.proc.stdout.readline().strip()
        assert out, f"worker exited (rc {self.proc.poll()})"
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _pair(env: dict | None = None):
    pre, dec = Box("prefill", env), Box("decode", env)
    try:
        info = pre.ask()
        assert dec.ask(info) == "READY"
        yield pre, dec
    finally:
        pre.close()
        dec.close()


# One pair for the tests that leave both alive (each process start imports torch and nixl).
boxes = pytest.fixture(scope="module")(_pair)
fresh_boxes = pytest.fixture(_pair)


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGSTOP ``proc`` and wait until every thread of it is stopped. kill() only queues
    a group stop: one thread is woken to act on it, and until it does the others (UCX's
    progress thread among them) keep running, so on a loaded box the peer could still
    serve part of a read posted right after the signal."""
    proc.send_signal(signal.SIGSTOP)
    end = time.monotonic() + timeout
    tasks = Path(f"/proc/{proc.pid}/task")
    while time.monotonic() < end:
        states = []
        for task in tasks.iterdir():
            try:
                # The state follows the parenthesised name, which may itself hold spaces.
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue                        # a thread that has just exited
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} not stopped within {timeout} s: {states}")


def pull(pre: Box, dec: Box, src: list[int], dst: list[int], ttl: float = 30.0,
         timeout: float = 60.0) -> list[str]:
    handle = pre.ask(f"handle {ttl} {','.join(map(str, src))}")
    return dec.ask(f"{handle}\t{','.join(map(str, dst))}", timeout=timeout).split(" ", 3)


@needs_nixl
def test_decode_process_pulls_prefill_blocks_byte_exact(boxes):
    pre, dec = boxes
    # Scattered ids (one descriptor per row and block) ...
    out = pull(pre, dec, [3, 17, 40, 41], [0, 9, 5, 6])
    assert out[0] == "OK", out
    assert int(out[1]) == 4 * 2 * 4 * 16 * 2 * 64 * 4
    # ... and a long run (one descriptor per row): the whole prompt of a 1k-token request.
    out = pull(pre, dec, list(range(0, 64)), list(range(16, 80)))
    assert out[0] == "OK", out
    assert int(out[1]) == 64 * 65536


@needs_nixl
def test_a_handle_past_its_deadline_is_refused(boxes):
    pre, dec = boxes
    out = pull(pre, dec, [1, 2], [1, 2], ttl=-0.5)
    assert out[:3] == ["ERR", "KvHandleExpired", "kept"], out
    # The connection is fine: the next, live handle is pulled.
    assert pull(pre, dec, [1, 2], [1, 2])[0] == "OK"


@needs_nixl
def test_a_dead_prefill_peer_gives_a_clean_error_not_a_hang(fresh_boxes):
    pre, dec = fresh_boxes
    assert pull(pre, dec, [7], [7])[0] == "OK"            # connected and working
    handle = pre.ask("handle 3 10,11,12")
    pre.proc.send_signal(signal.SIGKILL)
    pre.proc.wait(10)
    t0 = time.monotonic()
    out = dec.ask(f"{handle}\t20,21,22", timeout=60).split(" ", 3)
    elapsed = time.monotonic() - t0
    assert out[0] == "ERR" and out[1] in ("KvTransferError", "KvHandleExpired"), out
    # Bounded by the handle's deadline (3 s) plus the margin (2 s), with slack for load.
    assert elapsed < 3 + 2 + 15, elapsed
    assert dec.proc.poll() is None, "the decode worker must survive its peer's death"


@needs_nixl
def test_an_unresponsive_peer_is_given_up_on_at_the_deadline_plus_margin():
    """A peer that is alive but answers nothing (stopped; over TCP a read needs its
    progress thread): the read is cancelled at deadline + margin, no hang."""
    pair = _pair({"UCX_TLS": "tcp"})
    pre, dec = next(pair)
    try:
        assert pull(pre, dec, [7], [7])[0] == "OK"
        t0 = time.time()                    # before the handle's deadline is set
        handle = pre.ask("handle 1 10,11,12")
        stop(pre.proc)                      # every thread, before the read is posted
        out = dec.ask(f"{handle}\t20,21,22", timeout=60).split(" ", 3)
        elapsed = time.time() - t0
        assert out[:3] == ["ERR", "KvTransferError", "kept"], out
        assert "did not finish by the handle's deadline + 2 s" in out[3]
        assert "do not reuse them" in out[3]       # dst_unsafe: the read may still land
        # Not before deadline (1 s) + margin (2 s); soon after, with slack for load.
        assert 1 + 2 <= elapsed < 1 + 2 + 15, elapsed
        # Once the peer answers again, reads work; the given-up read may land meanwhile
        # (seen over TCP), but only in its quarantined blocks: the worker checks that
        # nothing else of its pool changed.
        pre.proc.send_signal(signal.SIGCONT)
        again = pull(pre, dec, [8], [8])
        assert again[0] == "OK", again
    finally:
        pre.proc.send_signal(signal.SIGCONT)
        pair.close()


# ---- without nixl: descriptors and the wire format --------------------------------

def test_block_descriptors_pair_rows_and_merge_runs():
    rows, row_block = 2 * 4, 16 * 2 * 64 * 4
    src, dst = block_descriptors(1000, 64, 5_000_000, 64, SHAPE, torch.float32,
                                 [3, 4, 5, 9], [0, 1, 2, 7])
    # Two runs (3..5 -> 0..2, and 9 -> 7), one descriptor per row each.
    assert len(src) == len(dst) == 2 * rows
    assert src[0] == (1000 + 3 * row_block, 3 * row_block)
    assert dst[0] == (5_000_000, 3 * row_block)
    with pytest.raises(ValueError, match="source block id 64 out of range"):
        block_descriptors(0, 64, 0, 64, SHAPE, torch.float32, [64], [0])
    with pytest.raises(ValueError, match="destination block id 40 out of range"):
        block_descriptors(0, 64, 0, 40, SHAPE, torch.float32, [50], [40])
    with pytest.raises(ValueError, match="duplicate"):
        block_descriptors(0, 64, 0, 64, SHAPE, torch.float32, [1, 2], [0, 0])


def test_block_descriptors_address_the_blocks_torch_sees_in_pools_of_different_sizes():
    """Source and destination pools differ in block count (each box sizes its own): each
    side's row stride is its own. Copying by the descriptors equals torch's block copy."""
    src_pool = torch.randn(SHAPE)
    dst_pool = torch.zeros((2, 4, 40, 16, 2, 64))
    src_ids, dst_ids = [63, 2, 3, 4, 10], [39, 0, 1, 2, 20]
    s, d = block_descriptors(src_pool.data_ptr(), 64, dst_pool.data_ptr(), 40, SHAPE,
                             torch.float32, src_ids, dst_ids)
    src_bytes = src_pool.view(torch.uint8).view(-1)
    dst_bytes = dst_pool.view(torch.uint8).view(-1)
    for (sa, n), (da, m) in zip(s, d):
        assert n == m
        so, do = sa - src_pool.data_ptr(), da - dst_pool.data_ptr()
        dst_bytes[do:do + n] = src_bytes[so:so + n]
    expect = torch.zeros_like(dst_pool)
    expect[:, :, dst_ids] = src_pool[:, :, src_ids]
    assert torch.equal(dst_pool, expect)


def test_pool_info_and_handle_round_trip_as_json_and_bad_input_is_refused():
    info = NixlPoolInfo(agent="a", agent_metadata=b"\x00\xffmd", pool_id="p", base_addr=2**47,
                        shape=SHAPE, dtype="float32", mem_type="DRAM", dev_id=0)
    handle = NixlKvHandle(agent="a", pool_id="p", request_id="r", block_ids=(1, 2),
                          num_tokens=20, expires_at=1.7e9)
    assert from_json(NixlPoolInfo, to_json(info)) == info
    assert from_json(NixlKvHandle, to_json(handle)) == handle
    bad = json.loads(to_json(handle))
    bad["block_ids"] = ["1"]
    with pytest.raises(ValueError, match="block_ids"):
        from_json(NixlKvHandle, json.dumps(bad))
    del bad["block_ids"]
    with pytest.raises(ValueError, match="missing field 'block_ids'"):
        from_json(NixlKvHandle, json.dumps(bad))
    with pytest.raises(ValueError, match="not JSON"):
        from_json(NixlKvHandle, "{")
