"""The worker process: one engine, a socket to the daemon, and a loop.

The loop blocks on the socket only when the engine is idle, so an idle worker costs
nothing and a busy one never waits for a message between iterations. Messages that
arrive during an iteration are queued by a reader thread and applied before the next.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import sys
import threading
import time

from appliance.engines.messages import (
    Abort, AttachPeer, Decode, Hello, IterationRecord, PeerGone, Prefill, Release, RequestFailed,
    Shutdown, StartFailed,
)
from appliance.worker import wire
from appliance.worker.spec import WorkerSpec

STATS_INTERVAL_S = 0.05
IDLE_WAKE_S = 0.5
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the daemon dies, even by kill -9."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent or parent == 1:   # the parent died before prctl took effect
        os._exit(1)


def pin(spec: WorkerSpec) -> None:
    """Keep to the cores the daemon gave us, so two workers' threads never compete for
    one core (and one worker's threads stay near its own caches)."""
    if spec.cpu_cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(spec.cpu_cores))
        except OSError as exc:   # the cores went away (cpuset changed): run unpinned
            print(f"applianced worker {spec.worker}: cannot pin to cores {spec.cpu_cores}: "
                  f"{exc}", file=sys.stderr)


def frames(events: list, records: list) -> bytes:
    """One write: the events, then the iteration records in a frame of their own, so the
    daemon can pass that frame on to the accounting process as it came (no re-pickling
    on its event loop, and the accounting process unpickles no tokens)."""
    out = wire.pack(events) if events else b""
    return out + wire.pack(records) if records else out


class HeldRecords:
    """Iteration records wait for the next stats (every `STATS_INTERVAL_S`, and when the
    engine goes idle) instead of a frame per step: the daemon reads one frame per step
    instead of two, and in a frame of many steps pickle writes each request id once
    (a decoding request is in every step). Nothing that reads them needs them sooner:
    the live windows are 1 s, and a device window closes 1.5 s after its end."""

    def __init__(self) -> None:
        self.records: list[IterationRecord] = []

    def split(self, events: list) -> list:
        """The events to send now; the iteration records among them are held."""
        rest = []
        for e in events:
            (self.records if type(e) is IterationRecord else rest).append(e)
        return rest

    def take(self) -> list[IterationRecord]:
        records, self.records = self.records, []
        return records


def run(fd: int, spec: WorkerSpec) -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the daemon decides when we stop
    pin(spec)
    # Children the engine may start (torch's shm manager) must not inherit our end of
    # the socket: the daemon notices our death by the socket closing.
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    from appliance.worker.engine_factory import build_engine
    try:
        engine = build_engine(spec)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"applianced worker {spec.worker}: cannot start engine: {message}", file=sys.stderr)
        try:
            sock.sendall(wire.pack([StartFailed(spec.worker, message)]))
        except OSError:
            pass
        return 3
    info = engine.hello_info()
    sock.sendall(wire.pack([Hello(spec.worker, os.getpid(), spec.role, engine.name,
                                  engine.simulated, tuple(spec.devices), info["layout"],
                                  info["block_size"], info["kv_blocks_total"],
                                  info["peer_handle"], info.get("max_context", 0),
                                  info.get("threads", 0), info.get("nixl_pool"),
                                  info.get("ride_rows", 0)),
                        engine.stats()]))
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def reader() -> None:
        while True:
            try:
                frame = wire.recv(sock)      # the daemon sends lists of messages
            except OSError:                  # reset: the daemon is gone, as at EOF
                frame = None
            if frame is None:
                inbox.put((None, 0.0))
                return
            received = time.time()       # the requests' arrival (`Sequence.arrival`)
            for msg in frame:
                inbox.put((msg, received))

    threading.Thread(target=reader, name="worker-reader", daemon=True).start()
    last_stats = 0.0
    held = HeldRecords()
    while True:
        msgs = []
        try:
            msgs.append(inbox.get(block=not engine.has_work(), timeout=IDLE_WAKE_S))
            while True:
                msgs.append(inbox.get_nowait())
        except queue.Empty:
            pass
        events: list = []
        for msg, received in msgs:
            if msg is None:
                return 0
            if isinstance(msg, Shutdown):
                if held.records:
                    try:
                        sock.sendall(frames([], held.take()))
                    except OSError:
                        pass
                return 0
            if isinstance(msg, (Prefill, Decode)):
                try:
                    events += engine.add(msg, received)
                except Exception as exc:   # one bad request must not end everyone's
                    print(f"applianced worker {spec.worker}: request {msg.request_id} "
                          f"refused: {exc!r}", file=sys.stderr)
                    events.append(RequestFailed(msg.request_id, f"engine refused the request: "
                                                f"{type(exc).__name__}: {exc}"))
            elif isinstance(msg, Abort):
                engine.abort(msg.request_id)
            elif isinstance(msg, Release):
                engine.release(msg.request_id)
            elif isinstance(msg, AttachPeer):
                engine.attach_peer(msg.worker, msg.handle)
            elif isinstance(msg, PeerGone):
                events += engine.detach_peer(msg.worker)
        if engine.has_work():
            try:
                events += engine.step()
            except Exception as exc:   # an engine bug must not take the process down silently
                print(f"applianced worker {spec.worker}: engine step failed: {exc!r}",
                      file=sys.stderr)
                raise
        now = time.monotonic()
        due = now - last_stats >= STATS_INTERVAL_S or (events and not engine.has_work())
        if due:
            events += engine.sweep(time.monotonic())
            events.append(engine.stats())
            last_stats = now
        if events:
            out = frames(held.split(events), held.take() if due else [])
            try:
                if out:
                    sock.sendall(out)
            except OSError:
                return 0

