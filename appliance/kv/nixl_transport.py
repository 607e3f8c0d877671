"""The KV handoff between two boxes: the decode worker PULLS the prefill worker's blocks
with a NIXL READ (NVIDIA Inference Xfer Library; UCX underneath: RDMA between GPU boxes,
TCP or shared memory between CPUs).

Within one box the handoff stays on /dev/shm or CUDA IPC (`appliance.kv.handoff`): a
mapping of the peer's pool, faster than any transport. Across boxes there is no mapping;
NIXL moves registered memory from one agent to another, one-sided: the prefill side only
registers its pool, the decode side reads.

Protocol (what vLLM's NixlConnector and Dynamo do too): each worker registers its KV pool
ONCE and publishes a `NixlPoolInfo` (its agent's metadata, the pool's base address and
layout). A peer loads it once (`NixlKvAgent.connect`). After that a handoff is only a
`NixlKvHandle` (block ids and a deadline): the decode side turns the block ids into
NIXL descriptors itself, since it knows the source layout. Both records are plain
dataclasses of bytes, ints and strings: what the boxes' control channel carries, pickled
by nobody: `to_json` / `from_json` (a box never unpickles what another box sent).

Pool layout: ``[2, layers, blocks, block_size, kv_heads, head_dim]`` (see
`appliance.engines.kv_pool`). One block is therefore ``2 * layers`` separate rows, each
``block_size * kv_heads * head_dim`` elements; consecutive block ids within a row are
adjacent, so a run of consecutive source and destination ids is one descriptor per row.

Deadline: the prefill side keeps a handle's blocks until ``expires_at`` plus a margin
(`appliance.engines.base.HANDOFF_MARGIN_S` within a box). Across boxes CLOCK_MONOTONIC
means nothing, so ``expires_at`` here is wall-clock time (``time.time()``): the boxes
must be NTP-synchronised, and their clock skew eats into the margin. The decode side
refuses a handle already past its deadline before reading, and checks deadline + margin
after the read: a read that raced the source freeing its blocks is detected, not used.

Failure: a peer that died ends the read with an error state (UCX sees the disconnect);
one that hangs never completes it: the read waits at most until the handle's deadline
plus the margin, then releases it and raises `KvTransferError` with ``dst_unsafe`` set,
because a read released in flight may still land (see `KvTransferError`). It never hangs.

The package (``nixl-cu12``, the ``cluster`` extra) is imported on first use: a box that
never joins another never loads it. NOT RUN ON HARDWARE: VRAM pools (GPU boxes, RDMA)
are registered the same way (NIXL takes the tensor's device); only DRAM over UCX's
shared-memory and TCP transports was run here.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import os
import sys
import time
import uuid
import importlib.util
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is imported where a pool is handled: the daemon checks
    import torch   # `nixl_installed` at start-up without loading either.

__all__ = [
    "INSTALL_HINT", "KvHandleExpired", "KvTransferError", "NixlKvAgent", "NixlKvHandle",
    "NixlPoolInfo", "NixlPull", "NixlUnavailable", "block_descriptors", "from_json",
    "import_nixl", "loopback_check", "nixl_available", "nixl_installed", "to_json",
]

INSTALL_HINT = ("NIXL is not installed: pip install 'applianced[cluster]' "
                "(nixl-cu12: a ~70 MB wheel, no CUDA runtime)")

# How long past a handle's deadline the prefill side keeps its blocks (as within a box).
DEFAULT_MARGIN_S = 2.0


class NixlUnavailable(RuntimeError):
    """The nixl package is missing; the message says what to install."""


class KvTransferError(RuntimeError):
    """A KV pull failed (peer gone, refused, layout differs); the request must recompute.

    ``dst_unsafe``: the read was given up on while in flight, so its destination blocks
    may still be written later: the caller must not hand them to another request (leak
    them until the worker restarts rather than corrupt another request's KV). Releasing
    the NIXL request does not prevent that: seen here over UCX TCP, a read given up on
    while its peer was stopped landed after the release, once the peer resumed
    (tests/integration/test_nixl_transport.py). A read that ended in an error state is not in flight."""

    dst_unsafe: bool = False


class KvHandleExpired(KvTransferError):
    """The handle's deadline has passed: its blocks may already hold another request's KV."""


# Where the single binary (packaging/applianced.spec) puts the plugins NIXL and UCX
# dlopen() by path at run time: the wheel's own layout under PyInstaller's _internal/.
FROZEN_PLUGIN_DIRS = (("NIXL_PLUGIN_DIR", "nixl_cu12.libs/nixl"),
                      ("UCX_MODULE_DIR", "nixl_cu12.libs/ucx"))


def _frozen_plugin_dirs() -> None:
    """In the single binary, point NIXL at its backend plugins and UCX at its transport
    modules: both find them relative to where the wheel installed them, which a frozen
    program does not reproduce. An operator's own settings win."""
    base = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or not base:
        return
    for var, sub in FROZEN_PLUGIN_DIRS:
        path = os.path.join(base, sub)
        if os.path.isdir(path):
            os.environ.setdefault(var, path)


def import_nixl() -> Any:
    """The ``nixl`` API module. The nixl-cu12 wheel installs it as ``nixl_cu12``; the
    ``nixl`` meta package (and source builds) as ``nixl``."""
    _frozen_plugin_dirs()
    for name in ("nixl._api", "nixl_cu12._api"):
        try:
            api = __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
        _quiet_nixl_logger()
        return api
    raise NixlUnavailable(INSTALL_HINT)


def _quiet_nixl_logger() -> None:
    """nixl logs every agent's start at INFO to *stdout*, where a worker's output is not
    for it: to stderr, warnings and up, unless NIXL_LOG_LEVEL asks for more."""
    log = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        log.setLevel(logging.WARNING)
    for h in log.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)


def nixl_available() -> bool:
    """Whether nixl imports (loads it, and torch)."""
    try:
        import_nixl()
    except NixlUnavailable:
        return False
    return True


def nixl_installed() -> bool:
    """Whether a nixl package is installed, without importing it (for start-up checks)."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12"))


def loopback_check(blocks: int = 16) -> dict:
    """Two agents in this process, one KV pool each, and a NIXL READ of some blocks from
    one into the other over UCX: does NIXL work here (its plugins found, UCX's transports
    loaded), byte for byte? What `applianced config check` runs for a cluster role, so
    a box (or the single binary) proves it can move KV before it joins a cluster.
    Raises NixlUnavailable or KvTransferError with one line."""
    import torch
    shape = (2, 2, blocks, 16, 2, 32)
    src = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    dst = torch.zeros(shape)
    a = NixlKvAgent(src, name=f"check-src-{uuid.uuid4().hex[:8]}")
    b = NixlKvAgent(dst, name=f"check-dst-{uuid.uuid4().hex[:8]}")
    try:
        b.connect(a.info())
        ids = list(range(0, blocks, 2))
        t0 = time.perf_counter()
        moved = b.pull(a.handle("check", ids, len(ids) * shape[3], ttl_s=10.0), ids)
        elapsed = time.perf_counter() - t0
        if not torch.equal(dst[:, :, ids], src[:, :, ids]) or dst[:, :, 1::2].any():
            raise KvTransferError("NIXL loopback read completed but the bytes differ")
    finally:
        b.close()
        a.close()
    return {"bytes": moved, "seconds": elapsed, "backend": "UCX",
            "plugin_dir": os.environ.get("NIXL_PLUGIN_DIR")}


@dataclass(frozen=True, slots=True)
class NixlPoolInfo:
    """A worker's registered KV pool, sent to its peers once (and again after a restart,
    with a new ``pool_id``)."""

    agent: str                  # NIXL agent name: unique per worker incarnation
    agent_metadata: bytes       # nixl_agent.get_agent_metadata(): connection info + registrations
    pool_id: str
    base_addr: int
    shape: tuple[int, ...]      # [2, layers, blocks, block_size, kv_heads, head_dim]
    dtype: str                  # "float32", "bfloat16", ...
    mem_type: str               # "DRAM" or "VRAM"
    dev_id: int                 # GPU ordinal on its box for VRAM; 0 for DRAM


@dataclass(slots=True)
class NixlPull:
    """A READ `NixlKvAgent.start_pull` posted: poll it with `check_pull` until it ends.
    Lives in the decode worker only (never crosses a process)."""

    handle: NixlKvHandle
    xfer: Any                   # the NIXL request handle (None: nothing to read)
    nbytes: int
    give_up: float              # wall clock: the handle's deadline + the margin
    state: str = "PROC"         # NIXL's transfer state: "PROC", "DONE" or "ERR"
    ended: bool = False         # its request released: no longer writing our blocks


@dataclass(frozen=True, slots=True)
class NixlKvHandle:
    """One request's prefilled KV on a peer: what the decode side needs to pull it."""

    agent: str
    pool_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float           # wall clock (time.time()); see the module docstring


def to_json(record: NixlPoolInfo | NixlKvHandle) -> str:
    """The record as JSON (bytes as base64), for the control channel between boxes."""
    out = {}
    for f in fields(record):
        v = getattr(record, f.name)
        out[f.name] = base64.b64encode(v).decode() if isinstance(v, bytes) else v
    return json.dumps(out)


def from_json(cls: type, text: str | bytes):
    """Parse what `to_json` wrote; a missing or mistyped field is a ValueError."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{cls.__name__}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object")
    kinds = {"bytes": bytes, "int": int, "float": float, "str": str,
             "tuple[int, ...]": tuple}
    args = {}
    for f in fields(cls):
        if f.name not in raw:
            raise ValueError(f"{cls.__name__}: missing field {f.name!r}")
        v, kind = raw[f.name], kinds[f.type]
        try:
            if kind is bytes:
                v = base64.b64decode(v, validate=True)
            elif kind is tuple:
                if not isinstance(v, list) or not all(type(x) is int for x in v):
                    raise TypeError
                v = tuple(v)
            elif kind is float:
                if type(v) not in (int, float):
                    raise TypeError
                v = float(v)
            elif type(v) is not kind:
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"{cls.__name__}: field {f.name!r} is not {f.type}") from None
        args[f.name] = v
    return cls(**args)


def _row_layout(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int, int]:
    """(rows, blocks per row, bytes of one block in one row)."""
    if len(shape) != 6:
        raise ValueError("KV pools must be 6-d [2, layers, blocks, block_size, kv_heads, head_dim]")
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    return shape[0] * shape[1], shape[2], shape[3] * shape[4] * shape[5] * elem


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, blocks): stretches where both ids run consecutively, in the
    order given."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def block_descriptors(src_base: int, src_blocks: int, dst_base: int, dst_blocks: int,
                      shape: Sequence[int], dtype: torch.dtype,
                      src_ids: Sequence[int], dst_ids: Sequence[int],
                      ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (address, length) pairs for moving ``src_ids`` of the pool at ``src_base``
    (``src_blocks`` blocks) into ``dst_ids`` of the pool at ``dst_base`` (``dst_blocks``
    blocks), both laid out as ``shape`` but for their block counts: element i of one list
    pairs with element i of the other. One pair per K/V layer row and run of consecutive
    ids (a row of a pool is all its blocks of one layer's K or V)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    rows, _, row_block = _row_layout(shape, dtype)
    for name, ids, nblocks in (("source", src_ids, src_blocks),
                               ("destination", dst_ids, dst_blocks)):
        for b in ids:
            if not 0 <= b < nblocks:
                raise ValueError(f"{name} block id {b} out of range [0, {nblocks})")
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("duplicate destination block ids")
    src_d: list[tuple[int, int]] = []
    dst_d: list[tuple[int, int]] = []
    for s0, d0, n in _runs(src_ids, dst_ids):
        for r in range(rows):
            src_d.append((src_base + (r * src_blocks + s0) * row_block, n * row_block))
            dst_d.append((dst_base + (r * dst_blocks + d0) * row_block, n * row_block))
    return src_d, dst_d


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class NixlKvAgent:
    """One worker's NIXL agent with its KV pool registered: the prefill side hands out
    `NixlKvHandle`s for it, the decode side pulls peers' blocks into it.

    Not thread-safe: one worker loop drives it (the agent runs UCX's progress thread
    itself)."""

    def __init__(self, pool: torch.Tensor, name: str | None = None,
                 margin_s: float = DEFAULT_MARGIN_S, backends: Sequence[str] = ("UCX",)):
        api = import_nixl()
        if pool.dim() != 6 or not pool.is_contiguous() or pool.storage_offset() != 0:
            raise ValueError("register a whole, contiguous 6-d KV pool")
        self.pool = pool
        self.margin_s = margin_s
        self.pool_id = uuid.uuid4().hex
        self.name = name or f"applianced-{self.pool_id[:12]}"
        # No listen thread: metadata travels through our own control channel.
        config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                       backends=list(backends))
        self._agent = api.nixl_agent(self.name, config)
        if not self._agent.backends:
            raise KvTransferError(f"NIXL has none of the backends {list(backends)} "
                                  f"(available: {self._agent.get_plugin_list()})")
        self._mem_type = "DRAM" if pool.device.type == "cpu" else "VRAM"
        self._dev_id = 0 if pool.device.type == "cpu" else (pool.device.index or 0)
        self._reg = self._agent.register_memory(pool)
        self._peers: dict[str, NixlPoolInfo] = {}
        self._closed = False

    # ---- both sides --------------------------------------------------------------

    def info(self) -> NixlPoolInfo:
        """What peers need to read this pool; computed after registration, so the agent
        metadata carries the pool's remote keys."""
        return NixlPoolInfo(
            agent=self.name, agent_metadata=bytes(self._agent.get_agent_metadata()),
            pool_id=self.pool_id, base_addr=int(self.pool.data_ptr()),
            shape=tuple(self.pool.shape), dtype=_dtype_name(self.pool.dtype),
            mem_type=self._mem_type, dev_id=self._dev_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            self.forget(name)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - teardown of a dying agent: nothing to recover
            pass

    # ---- prefill side ------------------------------------------------------------

    def handle(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
               ttl_s: float) -> NixlKvHandle:
        """A handle on blocks this side keeps for ``ttl_s`` (plus the margin)."""
        nblocks = self.pool.shape[2]
        ids = tuple(int(b) for b in block_ids)
        if any(not 0 <= b < nblocks for b in ids):
            raise ValueError(f"block ids must be in [0, {nblocks})")
        return NixlKvHandle(agent=self.name, pool_id=self.pool_id, request_id=request_id,
                            block_ids=ids, num_tokens=num_tokens,
                            expires_at=time.time() + ttl_s)

    # ---- decode side -------------------------------------------------------------

    def connect(self, peer: NixlPoolInfo) -> None:
        """Load a peer's agent metadata once. A peer whose pool differs in layout is
        refused: KV is never reinterpreted."""
        ours = self.pool
        if (tuple(peer.shape[:2]) != tuple(ours.shape[:2])
                or tuple(peer.shape[3:]) != tuple(ours.shape[3:])
                or peer.dtype != _dtype_name(ours.dtype)):
            raise KvTransferError(
                f"peer {peer.agent} has KV layout {tuple(peer.shape)} {peer.dtype}, this "
                f"worker {tuple(ours.shape)} {_dtype_name(ours.dtype)}")
        if peer.agent in self._peers:
            self.forget(peer.agent)
        try:
            loaded = self._agent.add_remote_agent(peer.agent_metadata)
        except Exception as exc:  # nixlBind raises its own exception types
            raise KvTransferError(f"cannot load NIXL metadata of peer {peer.agent}: {exc}") from None
        name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if name != peer.agent:
            self._agent.remove_remote_agent(name)
            raise KvTransferError(f"peer metadata names agent {name!r}, not {peer.agent!r}")
        self._peers[peer.agent] = peer
        try:
            # Connect now rather than on the first read (~150 ms here, once per peer).
            self._agent.make_connection(peer.agent)
        except Exception:  # noqa: BLE001 - the first read connects, or says what failed
            pass

    def connected(self, agent: str, pool_id: str) -> bool:
        """Whether this pool incarnation of `agent` is loaded (no `connect` needed)."""
        peer = self._peers.get(agent)
        return peer is not None and peer.pool_id == pool_id

    def forget(self, agent: str) -> None:
        """Drop a peer (it died or restarted): its handles are refused from now on."""
        if self._peers.pop(agent, None) is None:
            return
        try:
            self._agent.remove_remote_agent(agent)
        except Exception:  # noqa: BLE001 - a peer that is already gone
            pass

    def pull(self, handle: NixlKvHandle, dst_block_ids: Sequence[int],
             poll_s: float = 0.0002) -> int:
        """READ the handle's blocks into ``dst_block_ids`` of our pool and wait for it:
        `start_pull`, then `check_pull` every ``poll_s`` until it ends. Complete when this
        returns (the caller may then tell the prefill side to free). Returns the bytes read;
        raises what those two raise."""
        pending = self.start_pull(handle, dst_block_ids)
        while (moved := self.check_pull(pending)) is None:
            time.sleep(poll_s)
        return moved

    def start_pull(self, handle: NixlKvHandle, dst_block_ids: Sequence[int]) -> NixlPull:
        """Post the READ of the handle's blocks into ``dst_block_ids`` of our pool and
        return at once (NIXL's transfers are non-blocking: UCX's progress thread moves the
        bytes); `check_pull` says when it ended. A decode worker keeps stepping its running
        sequences meanwhile. Until `check_pull` has returned bytes or raised, the
        destination blocks are being written: the caller must not reuse them.

        Raises `KvHandleExpired` if the handle is past its deadline, `KvTransferError` if
        the peer is unknown or was replaced, or the read cannot be posted."""
        peer = self._peers.get(handle.agent)
        if peer is None:
            raise KvTransferError(f"KV handle from unknown peer {handle.agent}")
        if handle.pool_id != peer.pool_id:
            raise KvTransferError(
                f"KV handle from pool {handle.pool_id[:12]} of {handle.agent}, which now "
                f"has pool {peer.pool_id[:12]}")
        if time.time() > handle.expires_at:
            raise KvHandleExpired(
                f"KV handle for {handle.request_id} expired "
                f"{time.time() - handle.expires_at:.3f} s ago; recompute the prompt")
        src, dst = block_descriptors(peer.base_addr, peer.shape[2], int(self.pool.data_ptr()),
                                     self.pool.shape[2], peer.shape, self.pool.dtype,
                                     handle.block_ids, list(dst_block_ids))
        give_up = handle.expires_at + self.margin_s
        if not src:
            return NixlPull(handle, None, 0, give_up, "DONE", ended=True)
        local = self._agent.get_xfer_descs([(a, n, self._dev_id) for a, n in dst],
                                           self._mem_type)
        remote = self._agent.get_xfer_descs([(a, n, peer.dev_id) for a, n in src],
                                            peer.mem_type)
        try:
            xfer = self._agent.initialize_xfer("READ", local, remote, handle.agent)
        except Exception as exc:
            raise KvTransferError(f"cannot start the KV read from {handle.agent}: {exc}") from None
        pending = NixlPull(handle, xfer, sum(n for _, n in dst), give_up)
        try:
            pending.state = self._agent.transfer(xfer)
        except Exception as exc:  # nixlBind raises its own exception types
            self._end(pending, KvTransferError(f"KV read from {handle.agent} failed: {exc}"))
        return pending

    def check_pull(self, pending: NixlPull) -> int | None:
        """None while the READ is in flight (NIXL state "PROC") and not past the handle's
        deadline + margin; the bytes read once it is "DONE" (its request released: the
        caller may tell the prefill side to free). Raises `KvTransferError` when it ended
        in an error state, or was given up on in flight at deadline + margin (then with
        ``dst_unsafe``); `KvHandleExpired` when it finished after deadline + margin."""
        if pending.ended:
            if pending.state != "DONE":
                raise KvTransferError(f"KV read for {pending.handle.request_id} already failed")
            return pending.nbytes
        agent = pending.handle.agent
        failure: KvTransferError | None = None
        try:
            if pending.state == "PROC":
                if time.time() > pending.give_up:
                    failure = KvTransferError(
                        f"KV read from {agent} did not finish by the handle's "
                        f"deadline + {self.margin_s:g} s (peer unreachable?); its "
                        "destination blocks may still be written: do not reuse them")
                    failure.dst_unsafe = True
                else:
                    pending.state = self._agent.check_xfer_state(pending.xfer)
                    if pending.state == "PROC":
                        return None
            if failure is None and pending.state != "DONE":
                failure = KvTransferError(f"KV read from {agent} failed (peer gone?)")
        except Exception as exc:  # nixlBind raises its own exception types
            pending.state = "ERR"
            failure = KvTransferError(f"KV read from {agent} failed: {exc}")
        self._end(pending, failure)
        if time.time() > pending.give_up:
            raise KvHandleExpired(
                f"KV read for {pending.handle.request_id} finished after the source may have "
                "freed its blocks; recompute the prompt")
        return pending.nbytes

    def _end(self, pending: NixlPull, failure: KvTransferError | None) -> None:
        """Release the READ's request; raise ``failure`` (made ``dst_unsafe`` if a failed
        read could not be cancelled)."""
        pending.ended = True
        if failure is not None and pending.state == "DONE":
            pending.state = "ERR"
        try:
            # NIXL tries to cancel an active read here (see `dst_unsafe`).
            self._agent.release_xfer_handle(pending.xfer)
        except Exception:  # noqa: BLE001 - not cancellable: NIXL keeps the request
            if failure is not None and not failure.dst_unsafe:
                failure = KvTransferError(f"{failure}; the read could not be cancelled: do "
                                          "not reuse its destination blocks")
                failure.dst_unsafe = True
        if failure is not None:
            raise failure
