"""Each tenant's share of the box as the router applies it: its weight and priority
class (sent with every request to the workers, whose schedulers share prefill steps
by them: `engines.fair_queue`), and its `max_concurrent` generations in flight.

A request over its tenant's `max_concurrent` waits here, not refused (refusals are
rate limits' and budgets' business): the first of its tenant's waiting requests to go
when a slot frees is the one of the best priority class, then the oldest. The gate
costs one dict lookup for a tenant without a limit.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass

from appliance.config import TenantConfig

DEFAULT_TENANT = "default"      # [tenants.default]: what a tenant not named gets


@dataclass(frozen=True, slots=True)
class Share:
    tenant: str
    weight: float
    priority: int
    max_concurrent: int          # 0 = unlimited


NO_SHARE = Share("", 1.0, 0, 0)  # the daemon's own requests (a worker's warm-up)


class TenantGate:
    def __init__(self, tenants: dict[str, TenantConfig] | None = None):
        self.tenants: dict[str, TenantConfig] = dict(tenants or {})
        self._shares: dict[tuple[str, int | None], Share] = {}   # made once per tenant
        self.inflight: dict[str, int] = {}
        self._waiting: dict[str, list] = {}          # tenant -> heap of (priority, n, future)
        self._order = itertools.count()

    def set_tenants(self, tenants: dict[str, TenantConfig]) -> None:
        """New shares for requests from now on (a reload); ones in flight keep theirs.
        A raised `max_concurrent` lets waiting requests go at once."""
        self.tenants = dict(tenants)
        self._shares.clear()
        for tenant in list(self._waiting):
            self._wake(tenant)

    def _config(self, tenant: str) -> TenantConfig | None:
        return self.tenants.get(tenant) or self.tenants.get(DEFAULT_TENANT)

    def share(self, tenant: str, priority: int | None = None) -> Share:
        """The request's share. A request's own `priority` may only lower its standing
        below its tenant's class, never raise it above: the classes are the operator's."""
        share = self._shares.get((tenant, priority))
        if share is None:
            share = self._shares[(tenant, priority)] = self._share(tenant, priority)
            if len(self._shares) > 10_000:       # (priorities are the clients' to pick)
                self._shares.clear()
        return share

    def _share(self, tenant: str, priority: int | None) -> Share:
        cfg = self._config(tenant)
        if cfg is None:
            return Share(tenant, 1.0, priority if priority is not None and priority > 0 else 0, 0)
        klass = cfg.priority if priority is None else max(priority, cfg.priority)
        return Share(tenant, cfg.weight, klass, cfg.max_concurrent)

    def depth(self, tenant: str) -> int:
        """Requests of `tenant` waiting for a slot."""
        return len(self._waiting.get(tenant, ()))

    def try_acquire(self, share: Share) -> bool:
        """Take a slot at once if one is free and nobody of the tenant waits for one (no
        coroutine: this is every request's path); False: `acquire` waits for one."""
        tenant = share.tenant
        n = self.inflight.get(tenant, 0)
        if share.max_concurrent <= 0 or (n < share.max_concurrent and not self._waiting.get(tenant)):
            self.inflight[tenant] = n + 1
            return True
        return False

    async def acquire(self, share: Share) -> None:
        """Take a slot of the tenant's `max_concurrent`, waiting for one if need be."""
        if self.try_acquire(share):
            return
        tenant = share.tenant
        fut = asyncio.get_running_loop().create_future()
        heap = self._waiting.setdefault(tenant, [])
        heapq.heappush(heap, (share.priority, next(self._order), fut))
        try:
            await fut          # the slot is ours once it resolves (`_wake` counted it)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(tenant)     # granted as we were cancelled: pass it on
            else:
                fut.cancel()
                self._prune(tenant)
            raise

    def release(self, tenant: str) -> None:
        n = self.inflight.get(tenant, 0) - 1
        if n > 0:
            self.inflight[tenant] = n
        else:
            self.inflight.pop(tenant, None)
        if tenant in self._waiting:
            self._wake(tenant)

    def _limit(self, tenant: str) -> int:
        cfg = self._config(tenant)
        return cfg.max_concurrent if cfg is not None else 0

    def _wake(self, tenant: str) -> None:
        heap = self._waiting.get(tenant)
        limit = self._limit(tenant)
        while heap and (limit <= 0 or self.inflight.get(tenant, 0) < limit):
            _, _, fut = heapq.heappop(heap)
            if fut.done():                  # its request went away while waiting
                continue
            self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
            fut.set_result(None)
        self._prune(tenant)

    def _prune(self, tenant: str) -> None:
        heap = self._waiting.get(tenant)
        if heap is not None:
            heap[:] = [w for w in heap if not w[2].done()]
            heapq.heapify(heap)
            if not heap:
                del self._waiting[tenant]
