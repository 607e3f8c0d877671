"""Weighted fair queuing between tenants: who is served next when several are waiting.

Start-time fair queuing (Goyal et al., SFQ), the discipline behind Linux's CFQ and
most API gateways' fair schedulers: each tenant has a virtual time, the service it
has received divided by its weight; the backlogged tenant with the least virtual time
goes next, and the clock of the whole queue (`now`) is the virtual time of the last
one served. A tenant that becomes backlogged starts at `now`, never below it: time
spent idle banks no credit, so a tenant that was away cannot then monopolize the box.
Priority classes come first (lower first, as vLLM's `priority`); fair sharing is among
the tenants of the best class waiting; between tenants level on the clock, the one with
fewer requests waiting goes first.

Service is counted in whatever the caller charges: the engine scheduler charges
prompt tokens as it prefills them (a chunk at a time), the daemon's concurrency gate
one per request. A tenant with few requests waiting is thus served ahead of one with
many, in proportion to the weights, whatever order they arrived in.

Pure and small: the engines know tenants only as opaque strings with a weight.
"""
from __future__ import annotations

from collections import deque
from typing import Generic, Hashable, Iterable, Iterator, TypeVar

T = TypeVar("T")


class VirtualClock:
    """Per-tenant virtual time (service / weight) and the queue's clock."""

    __slots__ = ("vt", "now")

    def __init__(self) -> None:
        self.vt: dict[str, float] = {}
        self.now = 0.0

    def join(self, tenant: str) -> None:
        """`tenant` has become backlogged: it starts no earlier than the clock."""
        if self.vt.get(tenant, -1.0) < self.now:
            self.vt[tenant] = self.now

    def time(self, tenant: str) -> float:
        return self.vt.get(tenant, self.now)

    def charge(self, tenant: str, weight: float, cost: float) -> None:
        """`tenant` is served `cost`: the clock moves to its start, its time past it."""
        start = self.vt.get(tenant, self.now)
        if start > self.now:
            self.now = start
        self.vt[tenant] = start + cost / (weight if weight > 0 else 1.0)

    def forget(self, active: Iterable[str]) -> None:
        """Drop tenants no longer seen (keeps the table as small as the live tenants);
        one that comes back rejoins at the clock, as it would anyway."""
        keep = set(active)
        for tenant in [t for t in self.vt if t not in keep]:
            del self.vt[tenant]


class FairQueue(Generic[T]):
    """FIFO per (priority, tenant); `pop` takes from the best class, the tenant with the
    least virtual time. One tenant in one class is a plain deque: O(1) per operation.
    Popping does not charge: the caller charges what the item then costs (`charge`)."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, str], deque] = {}
        self._weights: dict[str, float] = {}
        self._where: dict[Hashable, tuple[int, str]] = {}
        self.clock = VirtualClock()

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __iter__(self) -> Iterator[T]:
        for q in list(self._queues.values()):
            yield from list(q)

    def push(self, item: T, tenant: str = "", weight: float = 1.0, priority: int = 0) -> None:
        key = (priority, tenant)
        q = self._queues.get(key)
        if q is None:
            if not any(t == tenant for _, t in self._queues):
                self.clock.join(tenant)
            q = self._queues[key] = deque()
        q.append(item)
        self._weights[tenant] = weight
        self._where[item] = key

    def _best(self) -> tuple[int, str] | None:
        if not self._queues:
            return None
        if len(self._queues) == 1:
            return next(iter(self._queues))
        time, queues = self.clock.time, self._queues
        # Ties (tenants joining at the same clock) go to the one with fewer waiting.
        return min(queues, key=lambda k: (k[0], time(k[1]), len(queues[k])))

    def peek(self) -> T | None:
        key = self._best()
        return None if key is None else self._queues[key][0]

    def pop(self) -> T:
        key = self._best()
        if key is None:
            raise IndexError("pop from an empty FairQueue")
        return self._take(key, self._queues[key].popleft())

    def remove(self, item: T) -> None:
        key = self._where.get(item)
        if key is None:
            raise ValueError("item not in the queue")
        self._queues[key].remove(item)
        self._take(key, item)

    def _take(self, key: tuple[int, str], item: T) -> T:
        del self._where[item]
        if not self._queues[key]:
            del self._queues[key]
            if not any(t == key[1] for _, t in self._queues):
                self._weights.pop(key[1], None)
        return item

    def charge(self, tenant: str, cost: float = 1.0, weight: float | None = None) -> None:
        if weight is None:
            weight = self._weights.get(tenant, 1.0)
        self.clock.charge(tenant, weight, cost)

    def depth(self, tenant: str) -> int:
        return sum(len(q) for (_, t), q in self._queues.items() if t == tenant)


# How long one step may hold a waiting prompt up while tenants contend: a chunk of
# this much work is what a short prompt waits behind, at most.
FAIR_STEP_S = 0.05


def chunk_for_step_time(step_s, target_s: float = FAIR_STEP_S, *, align: int = 16,
                        lo: int = 16, hi: int = 8192) -> int:
    """The largest prompt chunk (a multiple of `align`, within [lo, hi]) whose prefill
    step takes at most `target_s` by `step_s(tokens) -> seconds` (a device's step-time
    model or profile); `lo` when even that is slower (the weights alone take longer
    to read than the target: a smaller chunk would only waste steps)."""
    if step_s(hi) <= target_s:
        return hi
    a, b = lo, hi                    # step_s(a) <= target (or a == lo), step_s(b) > target
    while b - a > align:
        mid = (a + b) // 2 // align * align
        if mid <= a:
            break
        if step_s(mid) <= target_s:
            a = mid
        else:
            b = mid
    return a
