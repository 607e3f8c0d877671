"""Which request goes to a worker next, when every worker of a role is full.

A request normally goes straight to the least-queued worker and waits, if at all, in
that worker's scheduler, whose fair queue orders tenants. But a worker's queue is
only fair among what reached it: a flood that arrives first can fill every worker's
queue, and TensorRT-LLM's scheduler is its own. So the router stops sending once a
worker is *saturated* by what the router knows of it (`has_room`), and the requests
beyond wait here, in the same per-tenant virtual-time fair queue the engines use
(`engines.fair_queue`, charged in prompt tokens as the engine scheduler charges), each
going to the next worker with room as soon as one has it.

The fast path (nothing waiting, a worker with room) is a length test and one
comparison per worker looked at; the queue only exists while workers are saturated.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, TypeVar

from appliance.engines.fair_queue import FairQueue
from appliance.routing import least_queued

# A worker with this many full prefill steps (its `max_batch_tokens`) of prompt tokens
# queued is saturated: one step under way, the next ones ready, so it never idles
# waiting for the router, and a short prompt still fits beside a long one waiting.
QUEUE_STEPS = 4


class Admits(Protocol):
    """What `has_room` reads of a worker: the router's own live counters and its spec."""

    pending_prefill_tokens: int
    inflight: int


W = TypeVar("W", bound=Admits)


def has_room(w, tokens: int) -> bool:
    """Whether `w` would take a prompt of `tokens` without queueing it behind a full
    admission: fewer requests in its first stage than its `max_seqs` (the scheduler's
    admission limit), and its queued prompt tokens with this one within `QUEUE_STEPS`
    prefill steps. An idle worker always has room (any prompt, however long)."""
    n = w.inflight
    if n == 0:
        return True
    spec = w.spec
    return (n < spec.max_seqs
            and w.pending_prefill_tokens + tokens <= QUEUE_STEPS * spec.max_batch_tokens)


def decode_room(decode: Sequence, committed: int, need: int) -> bool:
    """Whether the decode side can take one more request of `need` KV blocks (its prompt
    and its longest answer) beside the `committed` blocks of the requests the router has
    already sent on their way to it (placed on a prefill worker, and not yet finished).
    Without this a flood is prefilled faster than its decodes finish: the decode worker
    has no KV to import the handoffs into, and those that wait past `handoff_timeout_s`
    are prefilled again there (the prefill work thrown away). A request larger than
    the largest decode worker's pool counts as that pool (the worker reserves no more:
    it ends a sequence at its pool's capacity). With nothing committed (an idle decode
    side) or a decode side that has not reported its size yet, nothing is held back (the
    decode worker's own admission decides, as before)."""
    if committed == 0 or not decode:
        return True
    capacity = 0
    largest = 0
    for w in decode:
        if w.stats is None:
            return True
        capacity += w.stats.kv_blocks_total
        largest = max(largest, w.stats.kv_blocks_total)
    return committed + min(need, largest) <= capacity


def pick_with_room(candidates: Sequence[W], tokens: int,
                   room: Callable[[W, int], bool] = has_room) -> W | None:
    """The least-queued candidate with room for the prompt; None when all are saturated."""
    best = candidates[0] if len(candidates) == 1 else least_queued(candidates)
    if room(best, tokens):
        return best
    fits = [w for w in candidates if w is not best and room(w, tokens)]
    return least_queued(fits) if fits else None


@dataclass(eq=False, slots=True)
class Waiter:
    """One request waiting for a worker (hashable by identity for the fair queue)."""

    tokens: int
    tenant: str
    claim: Callable                      # (worker) -> what the request needs to go on
    kv: int = 0                          # KV blocks it will need on the decode side
    since: float = 0.0                   # when it began to wait (event-loop clock)
    left: bool = False
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DispatchQueue:
    """Requests waiting for a worker with room, in weighted-fair order.

    `pump(candidates)` is called whenever room may have appeared (a request left a
    worker's first stage, a worker became ready, the routing set changed): it hands the
    fair queue's head to a worker with room until none has. `candidates()` gives the
    ready workers (raising when there are none: the waiting requests then fail with
    that error, as a new request would, rather than wait for a worker that may never
    come). With `fair=False` every request is one tenant's: arrival order."""

    def __init__(self, fair: bool = True, admits: Callable[[int], bool] | None = None,
                 admits_wait_s: float = 10.0, overflow: Callable[[int], object] | None = None):
        self.fair = fair
        # `overflow(tokens)`: a worker outside the candidates that takes the queue's head
        # before them, or None.
        self.overflow = overflow
        # Room beyond the first stage's (disagg: the decode side's KV) for a request of
        # so many KV blocks; while the queue's head has none, everybody waits, in fair
        # order, but the head no longer than `admits_wait_s`: then it goes on without it
        # (what `admits` counts may be held for minutes by long answers; a bound, not a wall).
        self.admits = admits
        self.admits_wait_s = admits_wait_s
        self._recheck: asyncio.TimerHandle | None = None
        self.queue: FairQueue[Waiter] = FairQueue()
        self._depth: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.queue)

    def depth(self, tenant: str) -> int:
        return self._depth.get(tenant, 0)

    def tokens(self) -> int:
        """Prompt tokens of the requests waiting."""
        return sum(w.tokens for w in self.queue) if self.queue else 0

    async def wait(self, tokens: int, tenant: str, weight: float, priority: int,
                   claim: Callable, unclaim: Callable, candidates: Callable[[], list],
                   kv: int = 0):
        """Wait for a worker; returns `claim(worker)`, made when the worker was chosen
        (so its counters count this request before anything else is dispatched). A
        request cancelled after its worker was chosen gives the claim back (`unclaim`)
        and passes the room on."""
        waiter = Waiter(tokens, tenant, claim, kv, asyncio.get_running_loop().time())
        key = tenant if self.fair else ""
        self.queue.push(waiter, key, weight if self.fair else 1.0, priority if self.fair else 0)
        self._depth[tenant] = self._depth.get(tenant, 0) + 1
        try:
            self.pump(candidates)
            return await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                unclaim(fut.result())
                self._leave(waiter)
                self.pump(candidates)
            raise
        finally:
            self._leave(waiter)

    def _leave(self, waiter: Waiter) -> None:
        """Out of the queue however the wait ended (granted, failed, cancelled); once."""
        if waiter.left:
            return
        waiter.left = True
        try:
            self.queue.remove(waiter)
        except ValueError:
            pass                          # popped by `pump`
        n = self._depth.get(waiter.tenant, 0) - 1
        if n > 0:
            self._depth[waiter.tenant] = n
        else:
            self._depth.pop(waiter.tenant, None)
        if not self.queue:
            self.queue.clock.forget(())   # nobody backlogged: nobody has credit or debt

    def pump(self, candidates: Callable[[], list]) -> None:
        queue = self.queue
        while queue:
            waiter = queue.peek()
            if waiter.future.done():      # cancelled: its task has not run `_leave` yet
                queue.remove(waiter)
                continue
            try:
                ready = candidates()
            except Exception as exc:      # no worker of the role: nobody can wait for one
                for w in list(queue):
                    queue.remove(w)
                    if not w.future.done():
                        w.future.set_exception(exc)
                return
            if self.admits is not None and waiter.kv and not self.admits(waiter.kv):
                loop = asyncio.get_running_loop()
                left = waiter.since + self.admits_wait_s - loop.time()
                if left > 0:
                    # looked at again when its wait is up, if nothing else pumps before
                    if self._recheck is not None:
                        self._recheck.cancel()
                    self._recheck = loop.call_later(left, self.pump, candidates)
                    return
            worker = ((self.overflow is not None and self.overflow(waiter.tokens))
                      or pick_with_room(ready, waiter.tokens))
            if worker is None:
                return
            queue.pop()
            queue.charge(waiter.tenant if self.fair else "", max(1, waiter.tokens))
            waiter.future.set_result(waiter.claim(worker))
