"""One request's path through the workers: prefill -> KV handoff -> decode.

Which worker gets a request is `appliance.routing`'s policy (the planner's replay uses
the same one): the prefill worker with the fewest queued prompt tokens, the decode
worker with the most free KV. The router applies it to the ready workers and owns the handoff bookkeeping:
the source worker's blocks are released as soon as the decode worker reports its
copy, or when the request ends any other way.

Each request carries its tenant's share (`daemon.fairness`): the weight and priority
class go to the workers with the request (their schedulers share prefill steps by
them), and a tenant at its `max_concurrent` waits at the gate here before any worker
is chosen, so a worker is picked when the request can actually go. When every worker
of the request's first stage (prefill, or aggregated) is saturated, the request then
waits in the router's fair queue (`daemon.dispatch`) for the next worker with room.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from appliance.engines.messages import (
    Abort, Decode, KvHandle, KvImported, Prefill, PrefillDone, Release, RemoteKv,
    RequestFailed, SamplingParams, TokenLogprob, Tokens,
)
from appliance.config import TenantConfig
from appliance.daemon.cluster_wire import DecodeOrder
from appliance.daemon.dispatch import DispatchQueue, decode_room, pick_with_room
from appliance.daemon.fairness import NO_SHARE, Share, TenantGate
from appliance.daemon.peers import PeerFailed, Peers, PeerUnavailable
from appliance.kv.nixl_transport import NixlKvHandle, to_json
from appliance.daemon.workers import Channel, WorkerGone, WorkerLink, WorkerPool
from appliance.routing import Rotation, most_free


# What a request yields per event: new tokens, finish reason or None, logprobs or None.
Step = tuple[list[int], str | None, list[TokenLogprob] | None]


class NoWorker(Exception):
    """No worker of a needed role is ready (starting or restarting)."""


class EngineError(Exception):
    def __init__(self, message: str, code: str = "engine_error"):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Trace:
    """What the request path learned, for the request record."""

    request_id: str
    arrival: float
    prefill_worker: str | None = None
    decode_worker: str | None = None
    first_token: float | None = None
    cached_tokens: int = 0
    prompt_logprobs: list | None = None     # from the first token's event, when asked
    simulated_ttft: float | None = None     # the simulator's, on its clock (PrefillDone)


async def _next(channel: Channel):
    """The next event; token events already waiting behind it are merged into it, so a
    daemon that falls behind catches up with fewer, larger writes (adaptive batching)."""
    ev = await channel.get()
    if isinstance(ev, Tokens) and ev.finish_reason is None:
        items = channel.items
        while items and isinstance(items[0], Tokens):
            nxt = items.popleft()
            ev.tokens.extend(nxt.tokens)
            if ev.logprobs is not None and nxt.logprobs is not None:
                ev.logprobs.extend(nxt.logprobs)
            ev.finish_reason = nxt.finish_reason
            if nxt.finish_reason is not None:
                break
    return ev


def _free_blocks(w: WorkerLink) -> int:
    """Free KV as last reported, less what was sent since and not yet imported."""
    return (w.stats.kv_blocks_free if w.stats else 0) - w.pending_kv_blocks


def _rides(w: WorkerLink) -> bool:
    """Whether a prompt sent to decode worker `w` now would ride on its decode steps
    (`Scheduler.ride_rows`): it rides, and fewer sequences than that decode there."""
    rows = w.hello.ride_rows if w.hello is not None else 0
    return bool(rows) and w.inflight < rows


def _whole(w: WorkerLink) -> WorkerLink:
    """`w`, to run the prompt placed on it whole (`WorkerLink.ride_next`)."""
    w.ride_next = False
    return w


class Router:
    def __init__(self, pool: WorkerPool, mode: str, conditional_tokens: int = 0,
                 tenants: dict[str, TenantConfig] | None = None, fair_queuing: bool = True,
                 role: str = "both", peers: Peers | None = None,
                 model_name: Callable[[], str] = lambda: "", decode_kv_gate: bool = False,
                 decode_kv_gate_wait_s: float = 10.0, queue_tokens: int = 0,
                 prefill_share: float = 1.0, decode_max_seqs: int = 0):
        self.pool = pool
        self._model_name = model_name   # what the decode boxes are told the request is for
        self.role = role            # cluster.role: both | prefill (decodes go to peers) | decode
        self.peers = peers          # a prefill box's decode peers (None: role both)
        self.gate = TenantGate(tenants)
        self.mode = mode
        # disagg, when on (`engine.decode_kv_gate`, off by default: it costs throughput
        # when the decode KV is the bottleneck, docs/operations/tenants.md): a request goes
        # to a prefill worker only when the decode side can take its KV too
        # (`dispatch.decode_room`); until then it waits in the fair queue.
        # Its blocks (prompt + longest answer, as the decode worker reserves them) count
        # from its placement to its end. A front's decodes go to its peers (their KV is
        # theirs to refuse): not gated here. No request waits there longer than
        # `decode_kv_gate_wait_s`: it then goes on as it would ungated (the decode
        # worker's own admission decides), so long answers can delay others, never block them.
        on_decode_side = mode == "disagg" and role != "prefill"
        self.kv_gated = decode_kv_gate and on_decode_side
        # The sequences-in-decode cap (`engine.decode_max_seqs`, off by default), in the same
        # place and with the same bound on a wait: a request goes to a prefill worker (or a
        # decode worker prefilling it itself) only while fewer than so many per ready
        # decode worker are placed and unfinished. A decode step's time grows with its
        # batch, and every running sequence waits for the whole step: past a host's point
        # (~28 sequences for the 82M bench model on a 2-core Xeon with AMX, session 59 of
        # docs/benchmarks.md) a bigger batch adds little to the rate and all to each
        # token's wait, so the requests beyond wait for their first token instead.
        self.max_seqs = decode_max_seqs if on_decode_side else 0
        self.gated = self.kv_gated or self.max_seqs > 0
        # Conditional disaggregation by queue (`engine.conditional_disagg_queue_tokens`,
        # Dynamo's rule): while so many prompt tokens wait for the prefill workers, a
        # decode worker with no prompt of its own under way prefills the next request
        # itself, in its fair turn, and decodes it there (no handoff). The decode worker
        # then pauses its decodes for that prompt's step, but spends fewer steps a token,
        # each on more sequences; with one prompt at a time it never stops for long, and
        # its prompts take at most `prefill_share` of its time (`_decode_for_a_while`).
        self.queue_tokens = (queue_tokens if mode == "disagg" and role == "both"
                             and not self.kv_gated else 0)
        self.prefill_share = prefill_share
        self._decodes_until: dict[str, float] = {}    # decode worker -> no prompt before
        self.dispatch = DispatchQueue(
            fair_queuing, self._decode_room if self.gated else None, decode_kv_gate_wait_s,
            (lambda tokens: self._local_prefill(tokens, True)) if self.queue_tokens else None)
        # The placed requests' decode KV, one entry each, added when a prefill worker is
        # claimed for it and popped when it ends (`_uncommit`, however it ends): the total
        # changes only with the entries, so it cannot drift from them.
        self._committed: dict[str, int] = {}
        self.decode_committed = 0                     # sum(self._committed.values())
        self.conditional_tokens = conditional_tokens
        self.routed: set[str] = set(pool.workers)
        self._rotation = Rotation()
        self.refresh()
        # Room appears when a worker (re)starts; a dead one fails its waiters' hopes.
        pool.ready_listeners.append(lambda w: self._pump())
        pool.death_listeners.append(lambda w: self._pump())

    def set_routing(self, names) -> None:
        """Switch the workers new requests may go to, all at once (one event-loop turn:
        no request ever sees half a switch). Requests already placed stay where they are."""
        self.routed = set(names)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the pool (workers added, removed or replaced) under the routing set."""
        links = [w for w in self.pool.workers.values() if w.id in self.routed]
        self.prefill = [w for w in links if w.role == "prefill"]
        self.decode = [w for w in links if w.role == "decode"]
        self.agg = [w for w in links if w.role == "agg"]
        self._pump()      # waiting requests go to the new set (or learn there is none)

    def depth(self, tenant: str) -> int:
        """`tenant`'s requests waiting at the router: for a `max_concurrent` slot, or
        for a worker with room."""
        return self.gate.depth(tenant) + self.dispatch.depth(tenant)

    def _first(self) -> list[WorkerLink]:
        """Ready workers of a request's first stage (the one that queues prompts)."""
        if self.mode == "agg":
            return self._ready(self.agg, "aggregated")
        return self._ready(self.prefill, "prefill")

    def _pump(self) -> None:
        if self.dispatch.queue:
            self.dispatch.pump(self._first)

    async def _place(self, rid: str, tokens: int, share: Share, need: int = 0):
        """A first-stage worker for the request, claimed (its channel open, its prompt
        counted, its `need` decode KV blocks committed): at once when one has room and
        nobody waits, else in fair order."""
        if not self.dispatch.queue and (not need or self._decode_room(need)):
            w = ((self.queue_tokens and self._local_prefill(tokens))
                 or pick_with_room(self._first(), tokens))
            if w is not None:
                queue = w.open(rid)
                w.pending_prefill_tokens += tokens
                self._commit(rid, need)
                return w, queue

        def claim(w: WorkerLink):
            queue = w.open(rid)
            w.pending_prefill_tokens += tokens
            if need and self._decode_room(need):
                # (one that goes on after its wait is not counted: the decode worker's
                # admission decides for it, as ungated, and what the gate admitted still
                # leaves room for another tenant's short request)
                self._commit(rid, need)
            return w, queue

        def unclaim(placed) -> None:
            w = placed[0]
            w.pending_prefill_tokens = max(0, w.pending_prefill_tokens - tokens)
            self._uncommit(rid)
            w.close(rid)

        return await self.dispatch.wait(tokens, share.tenant, share.weight, share.priority,
                                        claim, unclaim, self._first, need)

    # ---- the decode-KV gate ---------------------------------------------------------
    def _decode_need(self, prompt: int, max_tokens: int) -> int:
        """KV blocks a request will hold on a decode worker at most: its prompt, its first
        token and its longest answer, reserved as the decode worker reserves them
        (`engine.reserve_ratio` of `max_tokens`, `block_manager`)."""
        spec = self.decode[0].spec if self.decode else None
        block = spec.block_size if spec else 16
        ratio = spec.reserve_ratio if spec else 1.0
        return -(-(prompt + int(max_tokens * ratio)) // block) + 1

    def _largest_decode(self) -> int:
        """The largest ready decode worker's KV pool in blocks (0: none has reported)."""
        return max((w.stats.kv_blocks_total for w in self.decode if w.ready and w.stats),
                   default=0)

    def _commit(self, rid: str, need: int) -> None:
        if need:
            # Never more than a decode worker's whole pool: the worker reserves no more
            # (it ends a sequence at its pool's capacity).
            largest = self._largest_decode()
            need = min(need, largest) if largest else need
            self.decode_committed += need - self._committed.get(rid, 0)
            self._committed[rid] = need

    def _uncommit(self, rid: str) -> None:
        need = self._committed.pop(rid, 0)
        if need:
            self.decode_committed -= need
            self._pump()

    def _refuse_what_never_fits(self, prompt: int) -> None:
        """A prompt whose KV no decode worker here could import even empty: an error at
        once, never a wait at the gate."""
        largest = self._largest_decode()
        floor = self._decode_need(prompt, 0)
        if largest and floor > largest:
            raise EngineError(
                f"the prompt's KV ({floor} blocks of {self.decode[0].spec.block_size} "
                f"tokens) is larger than any decode worker's KV pool (the largest holds "
                f"{largest})", "kv_capacity")

    def decode_admission(self) -> dict:
        """What holds prompts back before their prefill, as applied, and how many it holds:
        the sequences-in-decode cap per ready decode worker (0: off), the decode-KV gate,
        the requests counted against them (placed, not ended) and those waiting at the
        router for any worker or room."""
        return {"max_seqs_per_decode_worker": self.max_seqs, "kv_gate": self.kv_gated,
                "counted": len(self._committed), "kv_blocks_counted": self.decode_committed,
                "waiting": len(self.dispatch)}

    def _decode_room(self, need: int) -> bool:
        if self.max_seqs:
            # (no decode worker ready: nothing to judge by, held back no more than ungated)
            ready = sum(1 for w in self.decode if w.ready)
            if ready and len(self._committed) >= self.max_seqs * ready:
                return False
        return not self.kv_gated or decode_room(
            [w for w in self.decode if w.ready], self.decode_committed, need)

    def ready(self) -> bool:
        """Whether a request can be served: on a decode box, when a decode worker is
        ready (it has no prefill workers by design); on a prefill box, when a prefill
        worker is and some decode capacity exists (an up decode peer or its own)."""
        if self.mode == "agg":
            return any(w.ready for w in self.agg)
        decode = any(w.ready for w in self.decode)
        if self.role == "decode":
            return decode
        if self.role == "prefill" and self.peers is not None:
            decode = decode or self.peers.any_decode_up()
        return any(w.ready for w in self.prefill) and decode

    def _ready(self, workers: list[WorkerLink], role: str) -> list[WorkerLink]:
        """Ready workers, rotated each call so that ties go round-robin."""
        ready = [w for w in workers if w.ready]
        if len(ready) < 2:      # (one worker: nothing to rotate; the usual single box)
            if not ready:
                raise NoWorker(f"no {role} worker is ready")
            return ready
        return self._rotation.rotate(ready, role)

    def _local_prefill(self, tokens: int, waiting: bool = False) -> WorkerLink | None:
        """A decode worker to prefill a prompt of `tokens` itself (`waiting`: one of the
        requests queued at the router): one with no prompt of its own under way, when
        the prompt tokens queued for the prefill workers, this one's included, reach
        `queue_tokens`, and the prompt fits one step of a prefill worker (on a CPU,
        `engine.cpu_prefill_step_ms`: the decodes never pause longer than that).
        A decode worker with no request at all takes it whenever every ready prefill
        worker has a prompt already (this one would wait behind it): nothing of its own
        pauses for it, and its core would otherwise idle while the prompt waits (on a
        2-core CPU box that was ~10% of the decode worker's time at C = 8). Under
        `queue_tokens`, one whose decode steps have rows to spare (`Hello.ride_rows`)
        takes it in the same case, to ride on those steps (`WorkerLink.ride_next`)."""
        idle = [w for w in self.decode if w.ready and w.pending_prefill_tokens == 0]
        if not idle or not self.prefill:
            return None
        if tokens > min(w.spec.max_batch_tokens for w in self.prefill):
            return None
        behind = all(w.pending_prefill_tokens for w in self.prefill if w.ready)
        empty = [w for w in idle if w.inflight == 0]
        if empty and behind:
            return _whole(most_free(empty, _free_blocks))
        queued = (0 if waiting else tokens) + sum(w.pending_prefill_tokens for w in self.prefill)
        if queued < self.queue_tokens:
            queued += self.dispatch.tokens()
        if queued < self.queue_tokens:
            # A short queue: only one whose decode steps would carry the prompt's rows
            # (`Hello.ride_rows`) takes it, when it would wait behind another: they cost
            # it a fraction of a whole prompt's step, and its decodes do not pause.
            riders = [w for w in idle if _rides(w)] if behind else []
            if not riders:
                return None
            w = most_free(riders, _free_blocks)
            w.ride_next = True
            return w
        if self._decodes_until:
            now = asyncio.get_running_loop().time()
            idle = [w for w in idle if self._decodes_until.get(w.id, 0.0) <= now]
            if not idle:
                return None
        return _whole(most_free(idle, _free_blocks))

    def _decode_for_a_while(self, worker: WorkerLink, sent: float) -> None:
        """After a prompt it prefilled (sent at `sent`, its first token now), a decode
        worker takes no other until it has decoded long enough for its prompts to take
        at most `prefill_share` of its time; the queue is looked at again then."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        until = now + (now - sent) * (1 - self.prefill_share) / self.prefill_share
        self._decodes_until[worker.id] = until
        loop.call_at(until, self._pump)

    def _most_free(self, workers: list[WorkerLink]) -> WorkerLink:
        return most_free(self._ready(workers, "decode"), _free_blocks)

    def _decode_for(self, pw: WorkerLink) -> WorkerLink:
        """A decode worker that can import pw's KV. Across a model swap the routing set
        may have switched to the new model while this request was in its prefill on the
        old one: it then finishes on an old-model decode worker (draining, not routed; the
        swap waits for it) rather than one whose KV layout differs."""
        layout = pw.hello.layout if pw.hello else None
        routed = [w for w in self.decode if w.hello is None or w.hello.layout == layout]
        if routed or layout is None:
            return self._most_free(routed or self.decode)
        same = [w for w in self.pool.workers.values() if w.role == "decode" and w.ready
                and w.hello and w.hello.layout == layout]
        if not same:
            raise NoWorker("no decode worker holds this request's model any more")
        return self._most_free(same)

    async def generate(self, trace: Trace, prompt: list[int], params: SamplingParams,
                       tenant: str = "", priority: int | None = None) -> AsyncIterator[Step]:
        """Yield (new tokens, finish reason or None, their logprobs or None) until the
        request finishes. `tenant` and the request's `priority` (None: the tenant's
        class) decide its share (`daemon.fairness`).

        Closing the generator early (client gone, stop string) aborts the request on
        whichever worker holds it and releases any handed-off KV."""
        share = self.gate.share(tenant, priority)
        if not self.gate.try_acquire(share):
            await self.gate.acquire(share)
        gen = None
        try:
            # (No generator of its own for the choice of path: every token passes
            # through each layer, and this one is on every request's path.)
            if self.mode == "agg":
                gen = self._run_local(trace, None, prompt, params, share)
            elif (self.conditional_tokens and len(prompt) < self.conditional_tokens
                  and (self.role != "prefill" or any(w.ready for w in self.decode))):
                # (a front without decode workers of its own sends even short ones on)
                worker = self._most_free(self.decode)
                gen = self._run_local(trace, worker, prompt, params, share)
            else:
                need = 0
                if self.gated:      # (no bookkeeping on the request path when ungated)
                    need = self._decode_need(len(prompt), params.max_tokens)
                    if self.kv_gated:
                        self._refuse_what_never_fits(len(prompt))
                gen = self._run_disagg(trace, prompt, params, share, need)
            async for item in gen:
                yield item
        finally:
            if gen is not None:
                await gen.aclose()      # (as contextlib.aclosing, without its frames)
            self.gate.release(share.tenant)
            if self._committed:
                # however it ended (finished, failed, cancelled, client gone, its worker
                # dead or replaced): its decode KV is given back, once
                self._uncommit(trace.request_id)

    async def _run_local(self, trace: Trace, worker: WorkerLink | None, prompt: list[int],
                         params: SamplingParams, share: Share = NO_SHARE,
                         queue: Channel | None = None):
        """The whole request on one worker: `worker` (with `queue`: already claimed by
        `_place`), or (None) an aggregated worker with room, waiting for one in fair
        order when all are saturated."""
        rid = trace.request_id
        if worker is None:
            worker, queue = await self._place(rid, len(prompt), share)
        elif queue is None:
            queue = worker.open(rid)
            worker.pending_prefill_tokens += len(prompt)
        trace.prefill_worker = trace.decode_worker = worker.id
        counted = True
        done = False
        sent = asyncio.get_running_loop().time()
        # (a prompt that rides on the decode steps pauses none: no pause after it)
        ride, worker.ride_next = worker.ride_next, False
        pause = worker.role == "decode" and self.prefill_share < 1 and not ride
        try:
            worker.send(Prefill(rid, prompt, params, False, share.tenant, share.weight,
                                share.priority, ride))
            while True:
                ev = await _next(queue)
                if isinstance(ev, Tokens):
                    if counted:
                        worker.pending_prefill_tokens = max(
                            0, worker.pending_prefill_tokens - len(prompt))
                        counted = False
                        if pause:
                            self._decode_for_a_while(worker, sent)
                        self._pump()
                        trace.first_token = time.time()
                        trace.cached_tokens = ev.cached_tokens
                        trace.prompt_logprobs = ev.prompt_logprobs
                    done = ev.finish_reason is not None
                    yield ev.tokens, ev.finish_reason, ev.logprobs
                    if done:
                        return
                else:
                    self._raise(ev)
        finally:
            if counted:
                worker.pending_prefill_tokens = max(0, worker.pending_prefill_tokens - len(prompt))
            if not done:
                worker.send(Abort(rid))
            worker.close(rid)
            self._pump()

    async def _run_disagg(self, trace: Trace, prompt: list[int], params: SamplingParams,
                          share: Share, need: int = 0):
        rid = trace.request_id
        pw, queue = await self._place(rid, len(prompt), share, need)
        if pw.role == "decode":     # the prefill side's queue was long (`queue_tokens`)
            async with contextlib.aclosing(
                    self._run_local(trace, pw, prompt, params, share, queue)) as local:
                async for step in local:
                    yield step
            return
        trace.prefill_worker = pw.id
        prefilled = False
        try:
            pw.send(Prefill(rid, prompt, params, True, share.tenant, share.weight,
                            share.priority))
            ev = await queue.get()
            if not isinstance(ev, PrefillDone):
                self._raise(ev)
            prefilled = True
        finally:
            pw.pending_prefill_tokens = max(0, pw.pending_prefill_tokens - len(prompt))
            if not prefilled:
                pw.send(Abort(rid))
            pw.close(rid)
            self._pump()
        trace.first_token = time.time()
        trace.cached_tokens = ev.cached_tokens
        trace.prompt_logprobs = ev.prompt_logprobs
        trace.simulated_ttft = ev.simulated_ttft_s
        if ev.handle is None:
            yield [ev.first_token], ev.finish_reason or "length", ev.logprobs
            return
        # From here the prefill worker holds KV for us until we release it (and a
        # workflow waiting for it to be idle must wait for that too).
        released = False
        pw.kv_holds += 1
        done = False
        dw: WorkerLink | None = None
        pending = 0

        def release() -> None:
            nonlocal released
            if not released:
                pw.send(Release(rid))
                released = True
                pw.kv_holds = max(0, pw.kv_holds - 1)
        try:
            yield [ev.first_token], None, ev.logprobs
            if self.role == "prefill" and self.peers is not None:
                try:
                    async with contextlib.aclosing(
                            self._decode_on_peer(trace, pw, ev, prompt, params, share,
                                                 release)) as remote:
                        async for step in remote:
                            yield step
                            if step[1] is not None:
                                done = True
                                return
                except PeerUnavailable as exc:
                    # Nothing started there and the KV is still here: decode locally if
                    # this box has decode workers of its own.
                    if not any(w.ready for w in self.decode):
                        raise NoWorker(f"{exc}; this box has no decode worker of its own") \
                            from None
            dw = self._decode_for(pw)
            trace.decode_worker = dw.id
            dqueue = dw.open(rid)
            pending = len(ev.handle.block_ids) + 1
            dw.pending_kv_blocks += pending
            dw.send(Decode(rid, prompt, ev.first_token, params, ev.handle, share.tenant,
                           share.weight, share.priority))
            while True:
                dev = await _next(dqueue)
                if isinstance(dev, Tokens):
                    done = dev.finish_reason is not None
                    yield dev.tokens, dev.finish_reason, dev.logprobs
                    if done:
                        return
                elif isinstance(dev, KvImported):
                    release()
                    dw.pending_kv_blocks = max(0, dw.pending_kv_blocks - pending)
                    pending = 0
                else:
                    self._raise(dev)
        finally:
            release()
            if dw is not None:
                # Clamped: a worker that died meanwhile has already reset its counters.
                dw.pending_kv_blocks = max(0, dw.pending_kv_blocks - pending)
                if not done:
                    dw.send(Abort(rid))
                dw.close(rid)
                if not dw.inflight:     # an empty decode worker may take a waiting prompt
                    self._pump()

    # ---- across boxes (docs/operations/cluster.md) ----------------------------------
    def decode_capacity(self) -> tuple[int, str | None]:
        """(free KV blocks of the ready decode workers, their KV layout or, with none, the
        prefill workers'): what this box tells its peers (`GET /cluster/v1/status`)."""
        ready = [w for w in self.decode if w.ready]
        layouts = [w.hello.layout for w in (ready or [w for w in self.prefill if w.ready])
                   if w.hello is not None]
        return sum(max(0, _free_blocks(w)) for w in ready), (layouts[0] if layouts else None)

    async def _decode_on_peer(self, trace: Trace, pw: WorkerLink, ev: PrefillDone,
                              prompt: list[int], params: SamplingParams, share: Share,
                              release) -> AsyncIterator[Step]:
        """The decode of a request prefilled on `pw`, on the decode peer with the most free
        KV: it pulls the blocks (NIXL READ) and streams the tokens back. `release` is
        called once the peer has the KV. Raises `PeerUnavailable` when no peer could take
        it before anything started there and the KV is still on `pw` (the caller may
        decode locally), `PeerFailed` once something had."""
        layout = pw.hello.layout if pw.hello else None
        peer = self.peers.pick(layout)
        if peer is None:
            raise PeerUnavailable("no decode peer is up" if not self.peers.any_decode_up()
                                  else f"no decode peer holds KV layout {layout}")
        pool, handle = remote_kv(pw, ev.handle)
        order = DecodeOrder(
            request_id=trace.request_id, tenant=share.tenant, model=self._model_name(),
            prompt=prompt, first_token=ev.first_token, params=params, layout=layout or "",
            kv_pool=pool, kv_handle=handle, weight=share.weight, priority=share.priority)
        trace.decode_worker = f"peer:{peer.url}"
        imported = False
        async with contextlib.aclosing(self.peers.decode(peer, order)) as events:
            try:
                async for e in events:
                    kind = e.get("event")
                    if kind == "kv_imported":
                        imported = True
                        release()
                    elif kind == "tokens":
                        yield e["tokens"], e.get("finish_reason"), e.get("logprobs")
            except PeerFailed as exc:
                if not imported:    # the prefill worker still holds the KV: it may go elsewhere
                    raise PeerUnavailable(str(exc)) from None
                raise

    async def decode_order(self, trace: Trace, order: DecodeOrder, handle: NixlKvHandle
                           ) -> AsyncIterator[KvImported | Tokens]:
        """A decode box's side: run `order` (another box's request, prefilled there) on
        the decode worker with the most free KV, which pulls the prompt's KV from the
        prefill box itself. Yields the worker's KvImported (once) and Tokens events;
        closing early aborts the request on the worker."""
        rid = order.request_id
        same = [w for w in self.decode if w.hello is None or w.hello.layout == order.layout]
        if not same and any(w.ready for w in self.decode):
            raise EngineError(f"no decode worker here holds KV layout {order.layout} (another "
                              "model or block size?)", "kv_layout_mismatch")
        dw = self._most_free(same)
        trace.decode_worker = dw.id
        left = handle.expires_at - time.time()
        kv = KvHandle(worker=f"peer:{handle.agent}", request_id=rid,
                      block_ids=list(handle.block_ids), num_tokens=handle.num_tokens,
                      layout=order.layout, payload=RemoteKv(order.kv_pool, order.kv_handle),
                      expires_at=time.monotonic() + left)
        queue = dw.open(rid)
        pending = len(handle.block_ids) + 1
        dw.pending_kv_blocks += pending
        done = False
        try:
            dw.send(Decode(rid, order.prompt, order.first_token, order.params, kv, order.tenant,
                           order.weight, order.priority))
            while True:
                ev = await _next(queue)
                if isinstance(ev, Tokens):
                    if trace.first_token is None:
                        trace.first_token = time.time()
                    done = ev.finish_reason is not None
                    yield ev
                    if done:
                        return
                elif isinstance(ev, KvImported):
                    dw.pending_kv_blocks = max(0, dw.pending_kv_blocks - pending)
                    pending = 0
                    yield ev
                else:
                    self._raise(ev)
        finally:
            dw.pending_kv_blocks = max(0, dw.pending_kv_blocks - pending)
            if not done:
                dw.send(Abort(rid))
            dw.close(rid)

    @staticmethod
    def _raise(ev) -> None:
        if isinstance(ev, WorkerGone):
            raise WorkerGone(str(ev))   # one event, many requests: a fresh exception each
        if isinstance(ev, RequestFailed):
            raise EngineError(ev.message, ev.code)
        raise EngineError(f"unexpected worker event {type(ev).__name__}")


def remote_kv(pw: WorkerLink, handle: KvHandle) -> tuple[str, str]:
    """(pool info JSON, handle JSON) a decode box pulls `handle`'s blocks of `pw` with:
    the worker's NIXL pool as its Hello gave it, the handle's deadline in wall-clock time
    (boxes share no monotonic clock). A simulated worker has no pool: "" (the decode
    box's simulator only takes the time a transfer takes)."""
    pool = pw.hello.nixl_pool if pw.hello else None
    if pool:
        info = json.loads(pool)
        agent, pool_id = info["agent"], info["pool_id"]
    elif pw.hello is not None and pw.hello.simulated:
        agent, pool_id, pool = f"sim-{pw.id}", "", ""
    else:
        raise PeerUnavailable(f"prefill worker {pw.id} has no NIXL agent (its engine cannot "
                              "hand KV to another box)")
    left = handle.expires_at - time.monotonic() if math.isfinite(handle.expires_at) else 30.0
    return pool, to_json(NixlKvHandle(agent=agent, pool_id=pool_id,
                                      request_id=handle.request_id,
                                      block_ids=tuple(handle.block_ids),
                                      num_tokens=handle.num_tokens,
                                      expires_at=time.time() + left))
