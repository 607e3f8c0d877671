"""Sharing a worker's KV pool with its peers: exported once, imported once, then block copies.

Each worker allocates ONE pool ``[2, layers, blocks, block_size, kv_heads, head_dim]`` at
start-up (`allocate_pool`) and exports it ONCE (`export_pool`) through
``torch.multiprocessing.reductions.reduce_tensor``. The result is pickled here, inside the
worker, so what crosses the daemon (``Hello.peer_handle`` -> ``AttachPeer.handle``) is
opaque ``bytes``: the daemon never unpickles torch objects and never imports torch. A peer
calls `import_pool` once; after that a handoff is only block ids (`copy_from_peer`).

CPU (what CI runs): the pool lives in /dev/shm, created by torch's ``file_system``
strategy (a named shm object plus a torch_shm_manager that unlinks the name once every
process registered with it is gone). The default ``file_descriptor`` strategy cannot
work for us: it passes the fd through multiprocessing's resource_sharer, which
authenticates with ``multiprocessing.current_process().authkey``; our workers are exec'd
by the daemon, not children of a multiprocessing parent, so each has its own random
authkey and the import fails with ``AuthenticationError: digest sent was rejected``
(checked on torch 2.13, see tests/integration/test_kv_handoff.py). The torch_shm_manager binary
(torch/bin) must therefore ship with a frozen build.

A peer maps the pool's /dev/shm file itself (``UntypedStorage.from_file``, shared), and
never through torch's ``rebuild_storage_filename``. That one registers the mapping with
the *exporter's* torch_shm_manager over a socket that libshm keeps open for the life of
the process (its client sockets live in a static map and are never closed): when the
exporter died, its manager stayed up for as long as any peer lived, one orphaned
manager (~57 MB) per worker crash. Mapped directly, a pool's manager has one client, its
exporter, and exits with it (torch_shm_manager's 2 s shutdown timeout), unlinking the
name; a peer's mapping stays valid until it drops it. The file is the storage's bytes
behind a small header (torch's refcount), whose size the importer derives from the file
size and the exporter's byte count.

Lifetime: the exporter must keep its pool alive for as long as it runs (the engine holds
it). A peer drops a dead exporter's pool as soon as the daemon reports the death
(`PeerGone`), or at the latest when the restarted worker attaches (`forget_pool`), and
unlinks its name if that is still there. Handles name the pool incarnation they come from
(`KvHandle.pool_id`), so one from a dead pool is never read from its successor.

GPU (NOT RUN ON HARDWARE; written against torch's CUDA IPC API, tested only with device
queries faked): the handle carries the exporting GPU's UUID, because ordinals differ
between processes with different ``CUDA_VISIBLE_DEVICES``. CUDA IPC can only open memory
on a device the importer can see, so the daemon starts every worker with
``CUDA_VISIBLE_DEVICES=<own uuids>,<peer uuids>``: its own devices first (the engine
runs on ``cuda:0``), then the GPUs of every worker it exchanges KV with. With peer access
between the two GPUs the importer opens the handle in its *own* device's context (CUDA
maps the peer's memory there), so it never makes the peer's GPU current and creates no
context on it; without peer access it must open it on the peer's ordinal, which creates
a context (and its memory) on the prefill worker's GPU in the decode worker: that
remains, for GPUs without P2P. Pools must come from plain cudaMalloc (no
``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF``: IPC handles of expandable
segments are not supported; the daemon forces it off for GPU workers,
appliance/worker/cuda_env.py). The exporter must have finished writing the KV before it
reports the handle: ``sample()`` reads the logits back to the host, which synchronizes
the stream that wrote the KV. `copy_from_peer` copies on a side stream (on the source
device when the copy crosses devices: that is where PyTorch runs it) and synchronizes
before it returns, i.e. before the decode worker acknowledges (``KvImported``) and the
source frees.
"""
from __future__ import annotations

import inspect
import os
import pickle
from dataclasses import dataclass

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from appliance.kv.blocks import copy_blocks

HANDLE_VERSION = 2

__all__ = [
    "PeerPool", "allocate_pool", "copy_from_peer", "export_pool", "forget_pool",
    "import_pool", "normalize_uuid", "shm_free_bytes",
]


def _use_file_system_sharing() -> None:
    if torch_mp.get_sharing_strategy() != "file_system":
        torch_mp.set_sharing_strategy("file_system")


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed pool that can be exported: in /dev/shm on the CPU, cudaMalloc'd on a GPU.

    On the CPU the storage is created in shared memory directly (no private copy first),
    after checking that /dev/shm has room: touching a shm page beyond the tmpfs size is a
    SIGBUS, not an exception."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.zeros(shape, dtype=dtype, device=device)
    _use_file_system_sharing()
    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * elem
    free = shm_free_bytes()
    if free is not None and nbytes > free:
        raise MemoryError(
            f"KV pool needs {nbytes / 2**20:.0f} MiB of shared memory but /dev/shm has "
            f"{free / 2**20:.0f} MiB free; lower kv_cache_bytes or enlarge /dev/shm "
            f"(docker: --shm-size)")
    storage = torch.UntypedStorage._new_shared(nbytes)  # fresh shm object: zero-filled
    pool = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    assert pool.is_shared() and pool.is_contiguous()
    return pool


def _device_uuid(index: int) -> str:
    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def normalize_uuid(uuid: str) -> str:
    """NVML says 'GPU-8f6c...', torch says '8f6c...': compare without prefix, lower case."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def export_pool(pool: torch.Tensor) -> bytes:
    """Opaque bytes a peer passes to `import_pool`. Call once; keep `pool` alive."""
    meta = {"version": HANDLE_VERSION, "shape": tuple(pool.shape), "dtype": str(pool.dtype)}
    if pool.device.type == "cuda":
        fn, args = reduce_tensor(pool)
        meta.update(kind="cuda", uuid=_device_uuid(pool.device.index or 0))
        # ForkingPickler applies torch's CUDA reductions: an IPC handle, never the data.
        return bytes(ForkingPickler.dumps((meta, fn, args)))
    if not pool.is_shared() or pool.storage_offset() != 0 or not pool.is_contiguous():
        raise ValueError("export a CPU pool allocated by allocate_pool (shared memory)")
    _use_file_system_sharing()
    _, shm_name, nbytes = pool.untyped_storage()._share_filename_cpu_()
    meta.update(kind="cpu", nbytes=int(nbytes),
                shm_name=shm_name.decode() if isinstance(shm_name, bytes) else shm_name)
    return pickle.dumps((meta, None, None))


@dataclass(slots=True)
class PeerPool:
    """A peer's pool mapped into this process."""

    tensor: torch.Tensor
    kind: str
    shm_name: str | None = None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KV pool handle has an unknown dtype {name!r}")
    return dtype


def import_pool(handle: bytes) -> PeerPool:
    """Map a peer's exported pool. Raises ValueError/RuntimeError with a reason."""
    if not isinstance(handle, (bytes, bytearray)):
        raise ValueError(f"a KV pool handle is bytes, got {type(handle).__name__}")
    meta, fn, args = pickle.loads(handle)
    if meta.get("version") != HANDLE_VERSION:
        raise ValueError(f"KV pool handle version {meta.get('version')} != {HANDLE_VERSION}")
    if meta["kind"] == "cuda":
        return PeerPool(_import_cuda(meta, fn, args), "cuda")
    return PeerPool(_map_shm(meta), "cpu", meta["shm_name"])


def _map_shm(meta: dict) -> torch.Tensor:
    """Map the exporter's /dev/shm object directly (see the module docstring: no socket
    to the exporter's torch_shm_manager). The data follows torch's refcount header."""
    dtype = _dtype(meta["dtype"])
    shape = tuple(meta["shape"])
    path = os.path.join("/dev/shm", meta["shm_name"].lstrip("/"))
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise ValueError(f"peer KV pool {meta['shm_name']} is gone ({exc.strerror})") from None
    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    header = size - meta["nbytes"]
    if numel * elem != meta["nbytes"] or not 0 <= header <= 4096 or header % elem:
        raise ValueError(f"peer KV pool {meta['shm_name']} has {size} bytes; the handle says "
                         f"{meta['nbytes']} of data in shape {shape}")
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    return torch.empty(0, dtype=dtype).set_(storage, header // elem, shape)


def _import_cuda(meta: dict, fn, args) -> torch.Tensor:  # NOT RUN ON HARDWARE
    """Open the peer's CUDA IPC handle without making the peer's GPU current here where
    CUDA allows it.

    torch opens the handle (cudaIpcOpenMemHandle, with cudaIpcMemLazyEnablePeerAccess)
    under a device guard for the handle's ``storage_device``, which torch set to the
    exporter's ordinal: another device under another CUDA_VISIBLE_DEVICES, and the peer's
    GPU, whose primary context (hundreds of MB on that GPU) this process would create.
    With peer access between our GPU and the peer's, CUDA maps the peer's memory into
    *our* device's context instead: we pass our own ordinal, and the pool is a tensor
    that torch sees on our device, read by our kernels through peer access. Without peer
    access that is not possible: the handle is opened on the peer's ordinal here (found
    by UUID), which does create a context on the peer's GPU; the copies then go through
    `copy_from_peer`'s cross-device path. The argument is found by name in
    ``rebuild_cuda_tensor``'s signature (tests/unit/test_kv_handoff_contract.py checks it against the
    torch installed)."""
    want = meta["uuid"]
    local = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    if want not in local:
        raise RuntimeError(
            f"peer KV pool is on GPU {want}, which this worker cannot see "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}); "
            "the daemon must list peer GPUs after the worker's own")
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    if "storage_device" not in params or len(args) != len(params):
        raise RuntimeError("this torch's CUDA IPC handles differ from what applianced knows "
                           f"(rebuild_cuda_tensor{tuple(params)}); cannot remap the device")
    own, peer = OWN_DEVICE, local[want]
    on = own if own == peer or torch.cuda.can_device_access_peer(own, peer) else peer
    args = list(args)
    args[params.index("storage_device")] = on
    return fn(*args)


# The engine of a GPU worker runs on cuda:0: its own GPUs come first in its
# CUDA_VISIBLE_DEVICES, the peers' after (see the module docstring).
OWN_DEVICE = 0


def copy_from_peer(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
                   dst_ids: list[int]) -> None:
    """Copy whole blocks from a peer pool into ours; complete when this returns."""
    if dst.device.type != "cuda":
        copy_blocks(src, src_ids, dst, dst_ids)
        return
    # NOT RUN ON HARDWARE. On a side stream, ordered after our own pending work on dst,
    # and synchronized before the caller acknowledges (the source frees the blocks then).
    # PyTorch runs a copy between two devices on the *source* device's current stream
    # (ATen's copy_kernel_cuda), so the side stream must be current there; a pool mapped
    # through peer access (`_import_cuda`) is on our device, and so is the stream.
    on = src.device if src.device != dst.device else dst.device
    stream = torch.cuda.Stream(device=on)
    stream.wait_stream(torch.cuda.current_stream(dst.device))
    with torch.cuda.device(on), torch.cuda.stream(stream):
        copy_blocks(src, src_ids, dst, dst_ids)
    stream.synchronize()


def forget_pool(peer: PeerPool, owner_dead: bool) -> None:
    """Drop a peer pool. If its owner is known dead (it restarted with a new pool), unlink
    its name in case its torch_shm_manager has not yet (the memory is freed by the kernel
    once the last mapping closes). The mapping holds no torch refcount, so nothing of
    torch's tries to unlink the name again."""
    if owner_dead and peer.kind == "cpu" and peer.shm_name and not _owner_alive(peer.shm_name):
        try:
            os.unlink(os.path.join("/dev/shm", peer.shm_name.lstrip("/")))
        except OSError:
            pass
    peer.tensor = torch.empty(0)


def _owner_alive(shm_name: str) -> bool:
    """torch names shm objects /torch_<pid>_<random>_<n>; a live pid keeps its name."""
    try:
        pid = int(shm_name.lstrip("/").split("_")[1])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
