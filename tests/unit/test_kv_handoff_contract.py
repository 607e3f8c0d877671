"""The KV handoff's contract without a second process: a garbage handle is refused, a CUDA
handle opens on the local ordinal of its GPU, and the GPU copy runs on the side stream
where PyTorch runs it (checked against torch's own signatures, no GPU needed). (Across
real exec'd processes: tests/integration/test_kv_handoff.py.)"""
from __future__ import annotations

import inspect

import pytest
import torch

from appliance.kv.handoff import import_pool

torch.set_num_threads(1)


def test_import_rejects_garbage():
    with pytest.raises(ValueError):
        import_pool("not bytes")  # type: ignore[arg-type]


class _FakeCUuuid:
    """torch's ``_CUuuid``: str() is 8-4-4-4-12 lower-case hex, no 'GPU-' (NVML's form)."""

    def __init__(self, hex32: str):
        self.hex = hex32

    def __str__(self):
        h = self.hex
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@pytest.mark.parametrize("peer_access,opened_on", [(True, 0), (False, 2)])
def test_cuda_handle_opens_on_the_local_ordinal_of_its_gpu(monkeypatch, peer_access, opened_on):
    """The CUDA IPC import (not run on hardware) against the torch installed: the handle
    reduce_tensor makes is rebuild_cuda_tensor's arguments, where storage_device is the
    *exporter's* ordinal; we must open it on the ordinal the same GPU (by UUID) has here.
    Faked: only what needs a GPU (device count and properties)."""
    from types import SimpleNamespace

    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    from appliance.kv import handoff

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert "storage_device" in params and "storage_handle" in params
    here = {0: "a" * 32, 1: "b" * 32, 2: "c" * 32}     # this worker: own GPU, then peers
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(here))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=_FakeCUuuid(here[i])))
    asked = []
    monkeypatch.setattr(torch.cuda, "can_device_access_peer",
                        lambda a, b: asked.append((a, b)) or peer_access)
    args = [f"arg-{p}" for p in params]
    args[params.index("storage_device")] = 0           # its ordinal in the exporter
    calls = []
    # The exporter wrote its GPU's UUID as torch prints it; NVML's 'GPU-' form is the same GPU.
    assert handoff.normalize_uuid("GPU-" + str(_FakeCUuuid("c" * 32)).upper()) == \
        handoff.normalize_uuid(str(_FakeCUuuid("c" * 32)))
    meta = {"kind": "cuda", "uuid": handoff.normalize_uuid(str(_FakeCUuuid("c" * 32)))}
    handoff._import_cuda(meta, lambda *a: calls.append(a) or "tensor", tuple(args))
    (got,) = calls
    # With peer access the peer's memory is mapped into our own GPU's context (no context
    # on the peer's GPU); without, it can only be opened on the peer's ordinal here.
    assert asked == [(0, 2)]
    assert got[params.index("storage_device")] == opened_on
    assert [a for i, a in enumerate(got) if params[i] != "storage_device"] == \
        [a for i, a in enumerate(args) if params[i] != "storage_device"]

    meta["uuid"] = str(_FakeCUuuid("d" * 32))           # a GPU this worker cannot see
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    with pytest.raises(RuntimeError, match="cannot see.*CUDA_VISIBLE_DEVICES='GPU-aaaa'"):
        handoff._import_cuda(meta, lambda *a: calls.append(a), tuple(args))
    with pytest.raises(RuntimeError, match="differ from what applianced knows"):
        meta["uuid"] = str(_FakeCUuuid("c" * 32))
        handoff._import_cuda(meta, lambda *a: calls.append(a), tuple(args[:-1]))
    assert len(calls) == 1


class _FakeStream:
    def __init__(self, device):
        self.device = device
        self.waited = []
        self.synced = False

    def wait_stream(self, other):
        self.waited.append(other)

    def synchronize(self):
        self.synced = True


@pytest.mark.parametrize("src_dev,want_on", [("cuda:1", "cuda:1"), ("cuda:0", "cuda:0")])
def test_gpu_copy_runs_on_the_side_stream_where_pytorch_runs_it(monkeypatch, src_dev, want_on):
    """NOT RUN ON HARDWARE: PyTorch runs a copy between two GPUs on the source device's
    current stream, so the side stream must be current on the source device (a pool mapped
    through peer access is on our device: the side stream is ours). The copy must happen
    with that stream current, after it waited for our pending work, and be synchronized
    before copy_from_peer returns. Faked: torch.cuda's stream and device API."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from appliance.kv import handoff

    state = {"device": "cuda:0", "stream": None}
    made = []

    def stream_ctor(device):
        made.append(_FakeStream(str(device)))
        return made[-1]

    @contextmanager
    def device_ctx(dev):
        before, state["device"] = state["device"], str(dev)
        yield
        state["device"] = before

    @contextmanager
    def stream_ctx(stream):
        before, state["stream"] = state["stream"], stream
        yield
        state["stream"] = before

    monkeypatch.setattr(torch.cuda, "Stream", stream_ctor)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: f"current@{dev}")
    monkeypatch.setattr(torch.cuda, "device", device_ctx)
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    copies = []
    monkeypatch.setattr(handoff, "copy_blocks", lambda *a: copies.append(
        (state["device"], state["stream"], state["stream"].synced)))
    src = SimpleNamespace(device=torch.device(src_dev))
    dst = SimpleNamespace(device=torch.device("cuda:0"))
    handoff.copy_from_peer(src, [1], dst, [2])
    (stream,) = made
    assert stream.device == want_on
    assert copies == [(want_on, stream, False)]     # on the side stream, before the sync
    assert stream.waited == ["current@cuda:0"] and stream.synced
