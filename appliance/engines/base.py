"""The engine contract, and the batch loop shared by the simulator and the torch engine.

`Engine` is what a worker process drives: messages in, events out, one `step()` per
iteration. TensorRT-LLM runs its own loop and implements `Engine` directly; the
simulator and the torch engine subclass `BatchEngine`, which owns the scheduler, the
block manager and the handoff table, so the only thing they differ in is
`run_batch` (and how KV is imported).

The handoff deadline: a prefill worker keeps handed-off blocks until the decode side
releases them, or until the handle's `expires_at` plus `HANDOFF_MARGIN_S` (time.monotonic:
CLOCK_MONOTONIC is one clock for every process on the host). The decode side imports
only when its scheduler admits the sequence, which under overload can be long after; it
refuses an import whose deadline has passed, and re-checks after the copy that the
source cannot yet have freed the blocks (now <= expires_at + margin). A refused import is
*recomputed* here from the prompt and the first token, as a preempted sequence is: the
client sees latency, never wrong tokens nor an error. The same happens at once to every
queued import from a source that died (`detach_peer`) or restarted (a handle whose
`pool_id` is not the attached pool's).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from appliance.engines.block_manager import BlockManager
from appliance.engines.messages import (
    Decode, IterationRecord, KvHandle, KvImported, Prefill, PrefillDone, RemoteKv, RequestFailed,
    Tokens, WorkerStats,
)
from appliance.engines.scheduler import Batch, Scheduler
from appliance.engines.sequence import Role, Sequence

Event = Any

# How long past a handle's deadline its source still keeps the blocks. The decode side
# checks the deadline before the copy and deadline + margin after it, so a copy that
# raced a free is detected whatever the margin; the margin only makes that rare.
HANDOFF_MARGIN_S = 2.0

# How long a step sleeps when nothing but pulls from another box is in flight: the worker
# waits for their READs without spinning a core, and sees one end within this.
PULL_POLL_S = 0.0005


class KvLayoutError(ValueError):
    """A KV handle whose layout does not match this pool: refused, never reinterpreted."""


class Engine(Protocol):
    name: str
    simulated: bool

    def hello_info(self) -> dict: ...
    def add(self, msg: Prefill | Decode, received: float | None = None) -> list[Event]: ...
    def abort(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> None: ...
    def attach_peer(self, worker: str, handle: Any) -> None: ...
    def detach_peer(self, worker: str) -> list[Event]: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[Event]: ...
    def sweep(self, now: float) -> list[Event]: ...
    def stats(self) -> WorkerStats: ...


class BatchEngine:
    """Continuous batching over a paged pool; subclasses run the batches."""

    name = "batch"
    simulated = False
    logprobs = False            # whether run_batch sets seq.logprob when asked
    # Set when every layer of the model attends over a sliding window of at most this many
    # tokens: a running sequence's blocks wholly before its window are given back.
    kv_window: int | None = None

    def __init__(self, worker: str, devices: tuple[str, ...], num_blocks: int, block_size: int,
                 max_batch_tokens: int, max_seqs: int, max_context: int,
                 eos_token_ids: tuple[int, ...] = (), handoff_timeout_s: float = 30.0,
                 reserve_ratio: float = 1.0, prefill_chunk_tokens: int = 0,
                 fair_queuing: bool = True, fair_chunk_tokens: int = 0):
        self.worker = worker
        self.devices = devices
        self.blocks = BlockManager(num_blocks, block_size, reserve_ratio)
        self.scheduler = Scheduler(self.blocks, max_batch_tokens, max_seqs, prefill_chunk_tokens,
                                   fair_chunk_tokens or self.default_fair_chunk(max_batch_tokens),
                                   fair_queuing)
        # A sequence may not outgrow the pool: past it, it could never be re-admitted
        # after preemption (and its reservation could never be admitted at all).
        self.max_context = min(max_context, num_blocks * block_size)
        self.eos_token_ids = eos_token_ids
        self.handoff_timeout_s = handoff_timeout_s
        self._seqs: dict[str, Sequence] = {}
        # request id -> (sequence, instant after which the blocks are freed unreleased)
        self._handed_off: dict[str, tuple[Sequence, float]] = {}
        # request id -> (sequence, pending pull, perf_counter at its start): KV in flight
        # from another box (`begin_pull`), polled at every step (`check_pull`).
        self._pulls: dict[str, tuple[Sequence, Any, float]] = {}
        # Aborted while their pull was in flight: their blocks are freed when it ends.
        self._abandoned: set[str] = set()
        self.kv_recomputes = 0
        self.iterations = 0
        self.busy_s = 0.0
        self.prefix_hit_tokens = 0

    # ---- backend hooks ----------------------------------------------------
    def default_fair_chunk(self, max_batch_tokens: int) -> int:
        """The prompt chunk while tenants contend, when `prefill_chunk_tokens` is unset:
        engines with a step-time model choose the chunk whose step takes ~50 ms
        (`fair_queue.FAIR_STEP_S`); this fallback is an eighth of the prompt budget."""
        return max(self.blocks.block_size, max_batch_tokens // 8)

    def layout(self) -> str:
        raise NotImplementedError

    def run_batch(self, batch: Batch) -> list[int | None]:
        """Run one forward pass over batch.seqs; return one sampled token per sequence.

        The first `batch.num_prefill` sequences are prompts: each computes `seq.step_tokens`
        tokens from `seq.num_cached` on, and one whose prompt that leaves unfinished (a
        chunk) gets None and draws no sample. The others decode their last token."""
        raise NotImplementedError

    def import_kv(self, seqs: list[Sequence]) -> None:
        """Copy each seq.handle's blocks from its source pool into seq.block_table."""
        raise NotImplementedError

    # How `import_kv` moves blocks, as the transfer metrics label it ("" = not reported).
    kv_transport = ""

    def kv_import_transport(self, seq: Sequence) -> str:
        """How seq's blocks moved: the engine's one way, unless its handle says otherwise
        (a decode worker that pulls some handles from another box over NIXL: "nixl")."""
        return self.kv_transport

    def kv_import_bytes(self, seq: Sequence) -> int:
        """Bytes `import_kv` moves for seq (its handle's whole blocks)."""
        return 0

    def kv_import_seconds(self, seqs: list[Sequence], wall_s: float) -> list[float]:
        """Seconds of the import per seq: one copy call moved them all, so its wall time
        is shared out by bytes (the simulator reports its modelled time instead)."""
        sizes = [self.kv_import_bytes(s) for s in seqs]
        total = sum(sizes)
        if not total:
            return [wall_s / len(seqs)] * len(seqs)
        return [wall_s * n / total for n in sizes]

    def new_sampler(self, request_id: str, params, drawn: int = 0) -> Any:
        """Sampling state for a request. `drawn`: tokens already sampled elsewhere (the
        prefill worker's first token), so a seeded request continues the same random
        stream and gives the same output in disagg and agg modes."""
        return None

    def peer_handle(self) -> Any:
        return None

    def pool_id(self) -> str:
        """This incarnation's KV pool, as handles name it ('' = no shared pool)."""
        return ""

    def can_import(self, handle: KvHandle) -> bool:
        """Whether the handle's source pool (this incarnation of it) is attached here."""
        return True

    def attach_peer(self, worker: str, handle: Any) -> None:
        pass

    def drop_peer_pool(self, worker: str) -> None:
        """Unmap a dead peer's pool (engines that map one)."""

    def detach_peer(self, worker: str) -> list[Event]:
        """A peer died: drop its pool and recompute, at once, every queued import from it."""
        self.drop_peer_pool(worker)
        events: list[Event] = []
        for seq in [s for s in self.scheduler.waiting
                    if s.handle is not None and s.handle.worker == worker]:
            self.scheduler.waiting.remove(seq)
            events += self._recompute(seq)
        return events

    # ---- contract ---------------------------------------------------------
    def hello_info(self) -> dict:
        return {"layout": self.layout(), "block_size": self.blocks.block_size,
                "kv_blocks_total": self.blocks.num_blocks, "peer_handle": self.peer_handle(),
                "max_context": self.max_context}

    def add(self, msg: Prefill | Decode, received: float | None = None) -> list[Event]:
        """`received`: time.time() when the worker read the message off its socket (its
        arrival; None: now)."""
        rid = msg.request_id
        arrival = time.time() if received is None else received
        if rid in self._seqs or rid in self._handed_off or rid in self._pulls:
            return [RequestFailed(rid, f"request id {rid} is already on worker {self.worker}")]
        if isinstance(msg, Decode):
            if msg.handle.layout != self.layout():
                return [RequestFailed(rid, f"KV layout mismatch: source {msg.handle.layout}, "
                                           f"this worker {self.layout()}", "kv_layout_mismatch")]
            seq = Sequence(rid, msg.prompt, msg.params, Role.DECODE, msg.handle,
                           msg.first_token, arrival, msg.tenant, msg.weight, msg.priority)
        else:
            seq = Sequence(rid, msg.prompt, msg.params,
                           Role.PREFILL if msg.handoff else Role.FULL, arrival=arrival,
                           tenant=msg.tenant, weight=msg.weight, priority=msg.priority)
            seq.ride = msg.ride
        if (msg.params.logprobs is not None or msg.params.prompt_logprobs is not None) \
                and not self.logprobs:
            return [RequestFailed(rid, f"logprobs are not available from the {self.name} engine",
                                  "invalid_request")]
        needed = self.blocks.blocks_for(len(seq.tokens) + 1)
        if needed > self.blocks.num_blocks:
            return [RequestFailed(rid, f"request needs {needed} KV blocks, the pool has "
                                       f"{self.blocks.num_blocks}", "kv_capacity")]
        seq.sampler = self.new_sampler(rid, msg.params, seq.num_output)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return []

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
            if request_id in self._pulls:    # a READ is still writing its blocks
                self._abandoned.add(request_id)
            else:
                self.blocks.free(seq)
        self.release(request_id)

    def release(self, request_id: str) -> None:
        held = self._handed_off.pop(request_id, None)
        if held is not None:
            self.blocks.free(held[0])

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pulls)

    def sweep(self, now: float) -> list[Event]:
        """Free handed-off KV whose decode side never acknowledged it (`now`:
        time.monotonic()), past the handle's deadline plus the margin: the decode side
        refuses imports past the deadline, so nothing can be copying these blocks."""
        expired = [rid for rid, (_, free_at) in self._handed_off.items() if free_at < now]
        for rid in expired:
            self.release(rid)
        return []

    def step(self) -> list[Event]:
        # Pulls from another box that ended since the last step join this one's batch.
        events: list[Event] = self._poll_pulls() if self._pulls else []
        batch = self.scheduler.schedule()
        if batch is None or not batch.seqs:
            if self._pulls and not events:      # only READs in flight: wait, don't spin
                time.sleep(PULL_POLL_S)
            return events
        start = time.time()
        t0 = time.perf_counter()
        P = batch.num_prefill
        entries = [(s.request_id, s.step_tokens, s.num_cached + s.step_tokens) if i < P
                   else (s.request_id, 1, len(s.tokens)) for i, s in enumerate(batch.seqs)]
        if batch.phase == "kv_import":
            events += self._import(batch.seqs)
            entries = [(s.request_id, 0, s.num_cached) for s in batch.seqs]
        else:
            tokens = self.run_batch(batch)
            events += self._postprocess(batch, tokens)
        wall = time.perf_counter() - t0
        self.iterations += 1
        self.busy_s += wall
        events.append(IterationRecord(self.worker, batch.phase, start, wall, self.devices,
                                      self.simulated, entries))
        return events

    def _recompute(self, seq: Sequence) -> list[Event]:
        """Give up the import of seq: prefill it here instead (prompt + first token), as a
        preempted sequence is. The source may free its blocks now: say so (KvImported
        is "the source may free it"; the router sends the Release)."""
        self.blocks.free(seq)
        source = seq.handle.worker
        self.scheduler.requeue(seq)
        self.kv_recomputes += 1
        return [KvImported(seq.request_id, source)]

    def _import(self, seqs: list[Sequence]) -> list[Event]:
        events: list[Event] = []
        now = time.monotonic()
        remote = [s for s in seqs if isinstance(s.handle.payload, RemoteKv)]
        if remote:      # on another box: each pulled on its own, a failure recomputed
            seqs = [s for s in seqs if s not in remote]
            events += self._pull_remote(remote, now)
            if not seqs:
                return events
        stale = [s for s in seqs if s.handle.expires_at < now or not self.can_import(s.handle)]
        if stale:
            seqs = [s for s in seqs if s not in stale]
            for seq in stale:
                events += self._recompute(seq)
        if not seqs:
            return events
        t0 = time.perf_counter()
        try:
            self.import_kv(seqs)
        except Exception as exc:  # a dead or mismatched source: fail these, keep serving
            for seq in seqs:
                self._finish(seq)
                events.append(RequestFailed(seq.request_id, f"KV import failed: {exc}",
                                            "kv_import_failed"))
            return events
        # The source frees unreleased blocks only after expires_at + margin: a copy that
        # ended before that read blocks nobody could have reused yet. One that ended
        # later may have raced a free and a new prefill: thrown away, recomputed.
        done = time.monotonic()
        seconds = dict(zip((s.request_id for s in seqs),
                           self.kv_import_seconds(seqs, time.perf_counter() - t0)))
        late = [s for s in seqs if s.handle.expires_at + HANDOFF_MARGIN_S < done]
        for seq in late:
            events += self._recompute(seq)
        seqs = [s for s in seqs if s not in late]
        for seq in seqs:
            events.append(KvImported(seq.request_id, seq.handle.worker,
                                     self.kv_import_transport(seq), self.kv_import_bytes(seq),
                                     seconds[seq.request_id]))
            seq.num_cached = seq.handle.num_tokens
        self.scheduler.mark_imported(seqs)
        return events

    def _pull_remote(self, seqs: list[Sequence], now: float) -> list[Event]:
        """Start pulling each sequence's KV from its source box (`begin_pull`); each then
        waits in the scheduler's `importing` list, its blocks allocated, while the running
        sequences keep decoding, and joins them in the step after its READ is done
        (`_poll_pulls`). One past its deadline, or whose pull cannot start, is recomputed
        here, as a bad local handle is: the answer stays right, only slower."""
        events: list[Event] = []
        for seq in seqs:
            if seq.handle.expires_at < now:
                events += self._recompute(seq)
                continue
            t0 = time.perf_counter()
            try:
                pending = self.begin_pull(seq)
            except Exception as exc:   # noqa: BLE001 - any failure: recompute, keep serving
                events += self._pull_failed(seq, exc)
                continue
            self._pulls[seq.request_id] = (seq, pending, t0)
            self.scheduler.importing.append(seq)
        return events + self._poll_pulls()

    def _poll_pulls(self) -> list[Event]:
        """Check every pull in flight (`check_pull`): a done one makes its sequence run, a
        failed one is recomputed (`_pull_failed`); the others stay in flight."""
        events: list[Event] = []
        done = []
        for rid, (seq, pending, t0) in list(self._pulls.items()):
            try:
                result = self.check_pull(pending)
            except Exception as exc:   # noqa: BLE001 - any failure: recompute, keep serving
                del self._pulls[rid]
                if rid in self._abandoned:          # aborted meanwhile: nobody to recompute
                    self._abandoned.discard(rid)
                    if not getattr(exc, "dst_unsafe", False):
                        self.blocks.free(seq)
                    continue
                events += self._pull_failed(seq, exc)
                continue
            if result is None:
                continue
            del self._pulls[rid]
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self.blocks.free(seq)
                continue
            nbytes, transport = result
            seq.num_cached = seq.handle.num_tokens
            done.append(seq)
            events.append(KvImported(seq.request_id, seq.handle.worker, transport, nbytes,
                                     time.perf_counter() - t0))
        if done:
            self.scheduler.mark_imported(done)
        return events

    def _pull_failed(self, seq: Sequence, exc: Exception) -> list[Event]:
        """Recompute seq after its pull failed. A pull given up on in flight
        (`dst_unsafe`) may still write its blocks: they are left allocated to nobody
        until the worker restarts."""
        print(f"applianced worker {self.worker}: KV pull for {seq.request_id} "
              f"failed, recomputing: {exc}", file=sys.stderr)
        if getattr(exc, "dst_unsafe", False):
            seq.block_table = []    # leaked on purpose (see KvTransferError)
            seq.num_cached = 0
        return self._recompute(seq)

    def begin_pull(self, seq: Sequence) -> Any:
        """Start bringing seq's KV from another box into seq.block_table; what it returns
        is polled with `check_pull` at every step until that returns (bytes, transport).
        Here, for engines without an asynchronous transport: `pull_remote`, done at once."""
        return self.pull_remote(seq)

    def check_pull(self, pending: Any) -> tuple[int, str] | None:
        """(bytes, transport) once the pull `begin_pull` started is complete, None while
        it is in flight; raises if it failed (``dst_unsafe`` set: its blocks may still
        be written)."""
        return pending

    def pull_remote(self, seq: Sequence) -> tuple[int, str]:
        """Bring seq's KV from another box into seq.block_table; (bytes, transport).
        Engines without a NIXL agent (the simulator) only take the time a copy takes;
        nothing moved, so no bytes are counted (a peer's kv_bytes_total stays real)."""
        self.import_kv([seq])
        return 0, "sim"

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.params.stop_token_ids or (
                not seq.params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output >= seq.params.max_tokens or len(seq.tokens) >= self.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self.blocks.free(seq)

    def _postprocess(self, batch: Batch, tokens: list[int]) -> list[Event]:
        events: list[Event] = []
        for i, (seq, token) in enumerate(zip(batch.seqs, tokens)):
            prefill = i < batch.num_prefill
            if token is None:       # a chunk of a longer prompt: its KV is in, no token yet
                seq.num_cached += seq.step_tokens
                self.blocks.commit(seq)
                continue
            seq.num_cached = len(seq.tokens)
            seq.tokens.append(token)
            self.blocks.commit(seq)
            lps = plps = None
            if seq.logprob is not None:
                lps, seq.logprob = [seq.logprob], None
            if seq.prompt_lps is not None:     # the prompt is done: its logprobs go out
                plps, seq.prompt_lps = seq.prompt_lps, None
            reason = self._finish_reason(seq, token)
            cached = seq.prefix_hit if prefill else 0
            if prefill:
                self.prefix_hit_tokens += seq.prefix_hit
            if prefill and seq.role is Role.PREFILL:
                handle = None
                if reason is None:
                    expires = time.monotonic() + self.handoff_timeout_s
                    handle = KvHandle(self.worker, seq.request_id, list(seq.block_table),
                                      seq.num_cached, self.layout(), expires_at=expires,
                                      pool_id=self.pool_id())
                    self._seqs.pop(seq.request_id, None)
                    self.scheduler.remove(seq)
                    self._handed_off[seq.request_id] = (seq, expires + HANDOFF_MARGIN_S)
                else:
                    self._finish(seq)
                events.append(PrefillDone(seq.request_id, token, handle, reason, cached, lps,
                                          plps, seq.sim_ttft))
                continue
            events.append(Tokens(seq.request_id, [token], reason, cached, lps, plps))
            if reason is not None:
                self._finish(seq)
            elif self.kv_window:   # the next step's query sees positions len-W .. len-1
                self.blocks.release_before(seq, len(seq.tokens) - self.kv_window)
        return events

    def stats(self) -> WorkerStats:
        return WorkerStats(
            worker=self.worker,
            # an import whose KV is still arriving from another box waits too
            waiting=len(self.scheduler.waiting) + len(self.scheduler.importing),
            running=len(self.scheduler.running),
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            kv_blocks_total=self.blocks.num_blocks, kv_blocks_free=self.blocks.num_free,
            kv_blocks_handed_off=sum(len(s.block_table) for s, _ in self._handed_off.values()),
            iterations=self.iterations, busy_s=self.busy_s,
            preemptions=self.scheduler.preemptions, prefix_hit_tokens=self.prefix_hit_tokens,
            kv_recomputes=self.kv_recomputes)
