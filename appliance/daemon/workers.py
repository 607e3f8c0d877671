"""Worker processes as the daemon sees them: start, watch, restart, talk.

Each worker is `applianced worker` started with exec (the spawn model: no fork of a
process that holds threads, CUDA contexts or an event loop), connected by a
socketpair. A worker that dies fails every request it held at once (their clients
get a clear error, never a hang) and is restarted with exponential backoff.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import time
from collections import deque
from typing import Callable

from appliance.engines.messages import (
    AttachPeer, Hello, IterationRecord, KvImported, PeerGone, PrefillDone, RequestFailed,
    Shutdown, StartFailed, Tokens, WorkerStats,
)
from appliance.daemon import supervisor
from appliance.daemon.supervisor import program_command
from appliance.worker import wire
from appliance.worker.cpu_env import cpu_worker_env
from appliance.worker.cuda_env import gpu_worker_env
from appliance.worker.spec import WorkerSpec

log = logging.getLogger("applianced.workers")
# The page a lent core's owner and borrowers share (linear_bf16.c's struct lend_page;
# core_lending.PAGE_BYTES, not imported here: its package loads torch into the daemon).
LEND_PAGE_BYTES = 4096

# A worker that stayed up this long is healthy again: its next crash backs off from the start.
HEALTHY_AFTER_S = 60.0
# Worker events addressed to one request's channel (one set look-up per event, instead
# of an isinstance walk over the types: a worker sends several per request).
TO_REQUEST = frozenset({Tokens, PrefillDone, KvImported, RequestFailed})


class WorkerGone(Exception):
    """The worker holding a request died or was stopped."""


class Channel:
    """A request's inbox of worker events: a deque and at most one waiter. Lighter than
    asyncio.Queue, and it lets the reader merge events that are already waiting."""

    __slots__ = ("items", "_waiter")

    def __init__(self):
        self.items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, ev) -> None:
        self.items.append(ev)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()


def worker_env(spec: WorkerSpec, base) -> dict[str, str]:
    env = dict(base)
    if spec.device_kind == "gpu":
        # Own GPUs first (the engine runs on cuda:0..tp-1), then the peers' GPUs:
        # CUDA IPC can only open a peer's KV pool on a device this process can see.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.device_uuids + spec.peer_uuids)
        env.update(gpu_worker_env(env))    # KV pools must be exportable: no expandable segments
    else:
        env.update(cpu_worker_env(env))    # OpenMP threads sleep, not spin, between ops
    return env


def worker_command(spec: WorkerSpec, fd: int) -> list[str]:
    return program_command() + ["worker", "--fd", str(fd), "--spec", spec.to_json()]


class WorkerLink:
    def __init__(self, spec: WorkerSpec, pool: "WorkerPool"):
        self.spec = spec
        self.pool = pool
        self.id = spec.worker
        self.role = spec.role
        self.state = "stopped"            # starting | ready | restarting | stopped | failed
        self.proc: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.hello: Hello | None = None
        self.stats: WorkerStats | None = None
        self.restarts = 0
        self.last_exit: str | None = None
        self.started_at = 0.0
        self.channels: dict[str, Channel] = {}
        self.pending_prefill_tokens = 0   # router's own count, fresher than stats
        self.pending_kv_blocks = 0        # handoffs sent here and not yet imported
        self.inflight = 0
        # A decode worker's next own prompt (the router's `_local_prefill` choice, read at
        # its send): True to ride on its decode steps, False to run whole.
        self.ride_next = False
        self.kv_holds = 0                 # handed-off requests whose KV is still here
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.stop_reason: str | None = None   # what requests cut off by a stop are told
        self._outbox: list = []

    # ---- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        self.state = "starting"
        env = worker_env(self.spec, os.environ)
        spec, keep = self.spec, ()
        page = self.pool.lend_page_fd(spec)
        if page is not None:        # this worker lends its core, or borrows another's
            spec, keep = dataclasses.replace(spec, cpu_lend_fd=page), (page,)
        self.proc, reader, self.writer = await supervisor.spawn(
            lambda fd: worker_command(spec, fd), env, keep)
        first = await supervisor.first_message(reader, self.pool.start_timeout_s)
        if not first or not isinstance(first[0], Hello):
            code = await self._reap()
            if first and isinstance(first[0], StartFailed):
                raise WorkerGone(f"worker {self.id} cannot start its {self.spec.engine} engine: "
                                 f"{first[0].message}")
            raise WorkerGone(f"worker {self.id} exited before it was ready ({code})")
        self.hello = first[0]
        self.stats = next((e for e in first if isinstance(e, WorkerStats)), None)
        self.state = "ready"
        self.started_at = time.monotonic()
        self._task = asyncio.create_task(self._read(reader), name=f"read-{self.id}")
        asyncio.create_task(self._watch(self.proc, self.writer), name=f"watch-{self.id}")
        self.pool.on_ready(self)

    @staticmethod
    async def _watch(proc: asyncio.subprocess.Process, writer: asyncio.StreamWriter) -> None:
        """A dead worker's socket may stay open if a child inherited it: when the process
        exits, close our end so the reader sees the end of the stream either way."""
        await proc.wait()
        writer.close()

    async def _reap(self) -> str:
        return await supervisor.reap(self.proc)

    async def stop(self, timeout: float = 10.0, reason: str | None = None) -> None:
        self._stopping = True
        self.stop_reason = reason
        if self.proc is None or self.proc.returncode is not None:
            self.state = "stopped"
            return
        self.send(Shutdown())
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
        self.state = "stopped"

    # ---- traffic ----------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def send(self, msg) -> None:
        """Queue msg; everything sent in one event-loop turn leaves as one frame (one
        syscall and one pickle instead of one per request)."""
        self._outbox.append(msg)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.writer is not None and not self.writer.is_closing():
            self.writer.write(wire.pack(batch))

    def open(self, request_id: str) -> Channel:
        channel = Channel()
        self.channels[request_id] = channel
        self.inflight += 1
        return channel

    def close(self, request_id: str) -> None:
        if self.channels.pop(request_id, None) is not None:
            self.inflight -= 1

    async def _read(self, reader: asyncio.StreamReader) -> None:
        pool = self.pool
        channels = self.channels
        while True:
            body = await wire.recv_body_async(reader)
            if body is None:
                break
            iterations = False
            for ev in pickle.loads(body):
                kind = type(ev)     # (exact types: the wire's message classes are final)
                if kind in TO_REQUEST:
                    channel = channels.get(ev.request_id)
                    if channel is not None:
                        channel.put(ev)
                    if kind is KvImported and ev.transport:
                        pool.on_kv_transfer(ev)
                elif kind is IterationRecord:
                    pool.on_iteration(ev)
                    iterations = True
                elif kind is WorkerStats:
                    self.stats = ev
            if iterations and pool.frame_tap is not None:
                pool.frame_tap(body)
        await self._died()

    async def _died(self) -> None:
        code = await self._reap()
        self.writer = None
        gone = WorkerGone((self.stop_reason or f"worker {self.id} stopped") if self._stopping
                          else f"worker {self.id} died ({code})")
        for channel in self.channels.values():
            channel.put(gone)
        self.channels.clear()
        self.inflight = 0
        self.kv_holds = 0
        self.pending_prefill_tokens = 0
        self.pending_kv_blocks = 0
        self.stats = None
        if self._stopping:
            return
        self.last_exit = code
        self.state = "restarting"      # before anyone hears of it: nothing is routed here
        log.warning("worker %s died (%s); restarting", self.id, code)
        self.pool.on_death(self)
        asyncio.create_task(self._restart(), name=f"restart-{self.id}")

    async def _restart(self) -> None:
        delay = self.pool.backoff_s
        if time.monotonic() - self.started_at < HEALTHY_AFTER_S:
            delay = min(self.pool.backoff_max_s, self.pool.backoff_s * 2 ** min(self.restarts, 10))
        self.state = "restarting"

        def failed(exc: BaseException) -> None:
            self.last_exit = str(exc)
            log.error("%s", exc)

        def attempt() -> None:
            self.restarts += 1

        if await supervisor.restart(self.start, delay=delay, max_delay=self.pool.backoff_max_s,
                                    stopping=lambda: self._stopping, failures=(WorkerGone, OSError),
                                    on_failure=failed, on_attempt=attempt):
            log.info("worker %s restarted (pid %s)", self.id, self.proc.pid)

    def status(self) -> dict:
        s = self.stats
        return {
            "worker": self.id, "role": self.role, "state": self.state,
            "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
            "engine": self.spec.engine, "devices": self.spec.devices,
            "cpu_cores": self.spec.cpu_cores or None,
            "threads": (self.hello.threads or None) if self.hello else None,
            # a decode worker whose own prompts ride on its decode steps, up to these rows
            "ride_rows": (self.hello.ride_rows or None) if self.hello else None,
            "simulated": self.hello.simulated if self.hello else self.spec.engine == "sim",
            "restarts": self.restarts, "last_exit": self.last_exit, "inflight": self.inflight,
            "kv_blocks_total": s.kv_blocks_total if s else None,
            "kv_blocks_free": s.kv_blocks_free if s else None,
            "kv_blocks_handed_off": s.kv_blocks_handed_off if s else None,
            "kv_populated": s.kv_populated if s else None,
            "waiting": s.waiting if s else None, "running": s.running if s else None,
            "queued_prefill_tokens": s.queued_prefill_tokens if s else None,
            "iterations": s.iterations if s else None, "busy_s": s.busy_s if s else None,
            "preemptions": s.preemptions if s else None,
            "prefix_hit_tokens": s.prefix_hit_tokens if s else None,
            "kv_recomputes": s.kv_recomputes if s else None,
            "borrowed_core": s.borrowed_core if s and s.borrowed_core >= 0 else None,
            "borrowed_core_steps": s.borrowed_core_steps if s else None,
            "borrowed_core_lender_busy_steps": s.borrowed_core_lender_busy_steps if s else None,
            "borrowed_core_taken_steps": s.borrowed_core_taken_steps if s else None,
            "borrowed_core_taken_back": s.borrowed_core_taken_back if s else None,
            "lent_core_steps": s.lent_core_steps if s else None,
            "lent_core_waits": s.lent_core_waits if s else None,
            "lent_core_wait_s": s.lent_core_wait_s if s else None,
            "lent_core_gave_up": s.lent_core_gave_up if s else None,
        }


class WorkerPool:
    """All worker processes of the partition plan."""

    def __init__(self, specs: list[WorkerSpec],
                 on_iteration: Callable[[IterationRecord], None] = lambda rec: None,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0, start_timeout_s: float = 600.0):
        self.workers = {s.worker: WorkerLink(s, self) for s in specs}
        self.on_iteration = on_iteration
        # Every KV import that moved bytes (the transfer metrics), whoever waits for it.
        self.on_kv_transfer: Callable[[KvImported], None] = lambda ev: None
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.start_timeout_s = start_timeout_s
        # Gets every frame that holds an iteration record, still pickled (the accounting
        # process reads them; forwarding the bytes costs the event loop next to nothing).
        self.frame_tap: Callable[[bytes], None] | None = None
        self.death_listeners: list[Callable[[WorkerLink], None]] = []
        self.ready_listeners: list[Callable[[WorkerLink], None]] = []
        self._lend_pages: dict[str, int] = {}     # lending worker -> its page's memfd

    def lend_page_fd(self, spec: WorkerSpec) -> int | None:
        """The page through which a prefill worker takes its core back from the decode
        workers that borrow it (`engines.cpu_kernels.core_lending`): a memfd of the
        daemon's, made at the first start of either side and kept across their restarts
        (each borrower clears its own word when it starts); None for other workers or
        where it cannot be made (the helper then runs without it)."""
        owner = spec.worker if spec.cpu_core_lent else (
            spec.cpu_helper_lender if spec.cpu_helper_core >= 0 else "")
        if not owner:
            return None
        if owner not in self._lend_pages:
            try:
                fd = os.memfd_create(f"applianced-lend-{owner}", os.MFD_CLOEXEC)
                os.ftruncate(fd, LEND_PAGE_BYTES)
            except OSError as exc:
                log.warning("no shared page for %s's lent core (%s): its borrowers' helper "
                            "may hold a step up while a prompt runs there", owner, exc)
                return None
            self._lend_pages[owner] = fd
        return self._lend_pages[owner]

    def add(self, spec: WorkerSpec) -> WorkerLink:
        """A new worker slot (not started): a workflow starts workers in new roles."""
        if spec.worker in self.workers:
            raise ValueError(f"worker {spec.worker} exists")
        link = self.workers[spec.worker] = WorkerLink(spec, self)
        return link

    async def remove(self, name: str, reason: str | None = None, timeout: float = 10.0) -> bool:
        """Stop a worker and forget it (its requests get `reason`). False: no such worker."""
        link = self.workers.get(name)
        if link is None:
            return False
        await link.stop(timeout, reason)
        self.workers.pop(name, None)
        return True

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self.workers.values()))

    def pids(self) -> dict[str, int | None]:
        """Worker id -> pid of its live process (read by the CPU sampler's thread)."""
        return {w.id: (w.proc.pid if w.proc is not None and w.proc.returncode is None else None)
                for w in list(self.workers.values())}

    async def stop(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(w.stop(timeout) for w in self.workers.values()),
                             return_exceptions=True)

    def on_ready(self, worker: WorkerLink) -> None:
        """Introduce a (re)started prefill worker's KV pool to the decode workers, and
        theirs to a (re)started decode worker. Only that way: KV flows from prefill to
        decode, and mapping any other pool costs memory (a CUDA context on the peer's GPU
        without P2P) for nothing."""
        for listener in self.ready_listeners:
            listener(worker)
        for other in self.workers.values():
            if other is worker or not other.ready:
                continue
            if kv_flows(worker, other) and worker.hello.peer_handle is not None:
                other.send(AttachPeer(worker.id, worker.hello.peer_handle))
            if kv_flows(other, worker) and other.hello and other.hello.peer_handle is not None:
                worker.send(AttachPeer(other.id, other.hello.peer_handle))

    def on_death(self, worker: WorkerLink) -> None:
        """Tell the dead worker's KV consumers at once: they drop its pool and recompute
        the imports they queued from it (its blocks are freed memory, and after the
        restart the same ids name another incarnation's blocks)."""
        for other in self.workers.values():
            if other is not worker and other.ready and kv_flows(worker, other):
                other.send(PeerGone(worker.id))
        for listener in self.death_listeners:
            listener(worker)


def kv_flows(source: WorkerLink, sink: WorkerLink) -> bool:
    """Whether `sink` imports KV from `source`: prefill -> decode only."""
    return source.role == "prefill" and sink.role == "decode"
