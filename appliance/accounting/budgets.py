"""Per-tenant budgets (GPU-hours, $, kgCO2e per day/week/month) and their alerts.

An alert fires once per crossing of 80% and of 100% in a period: a warning in the log,
the `applianced_tenant_budget_used_ratio` gauge, and an entry in the usage API. A new
period starts from zero. After a restart the period's usage is read back from the
ledger; thresholds already crossed are shown as alerts again but not logged twice.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

log = logging.getLogger("applianced.budgets")

THRESHOLDS = (0.8, 1.0)
KINDS = ("gpu_hours", "usd", "kgco2e")


def period_start(period: str, t: float) -> float:
    d = datetime.fromtimestamp(t, timezone.utc)
    day = d.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day.timestamp()
    if period == "week":
        return (day - timedelta(days=day.weekday())).timestamp()
    return day.replace(day=1).timestamp()


@dataclass
class BudgetState:
    tenant: str
    budget: str             # gpu_hours | usd | kgco2e
    limit: float
    used: float = 0.0
    crossed: list[float] = field(default_factory=list)    # thresholds crossed this period
    alerts: list[dict] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.used / self.limit if self.limit > 0 else 0.0


class Budgets:
    def __init__(self, period: str, limits: dict[str, dict[str, float]], now: float | None = None):
        """limits: kind (gpu_hours|usd|kgco2e) -> tenant -> limit per period."""
        self.period = period
        self.states: dict[tuple[str, str], BudgetState] = {
            (tenant, kind): BudgetState(tenant, kind, float(limit))
            for kind in KINDS for tenant, limit in limits.get(kind, {}).items()}
        self.start = period_start(period, time.time() if now is None else now)

    def tenants(self) -> set[str]:
        return {t for t, _ in self.states}

    def _roll(self, t: float) -> None:
        start = period_start(self.period, t)
        if start > self.start:
            self.start = start
            for s in self.states.values():
                s.used, s.crossed, s.alerts = 0.0, [], []

    def load(self, used: dict[str, dict[str, float]]) -> None:
        """The period's usage so far (tenant -> kind -> amount), read at start-up."""
        for (tenant, kind), s in self.states.items():
            s.used = used.get(tenant, {}).get(kind, 0.0)
            for th in THRESHOLDS:
                if s.ratio >= th:
                    s.crossed.append(th)
                    s.alerts.append({"threshold": th, "at": None, "used": s.used,
                                     "limit": s.limit, "note": "crossed before the restart"})

    def add(self, tenant: str, t: float, amounts: dict[str, float]) -> list[BudgetState]:
        """Add one request's usage; returns the states whose ratio changed."""
        self._roll(t)
        changed = []
        for kind, amount in amounts.items():
            s = self.states.get((tenant, kind))
            if s is None or not amount:
                continue
            s.used += amount
            changed.append(s)
            for th in THRESHOLDS:
                if s.ratio >= th and th not in s.crossed:
                    s.crossed.append(th)
                    s.alerts.append({"threshold": th, "at": t, "used": s.used, "limit": s.limit})
                    log.warning("budget alert: tenant %s used %.0f%% of its %s %s budget "
                                "(%.6g of %.6g)", tenant, th * 100, self.period, kind,
                                s.used, s.limit)
        return changed

    def report(self, tenant: str | None = None) -> list[dict]:
        self._roll(time.time())
        return [{"tenant": s.tenant, "budget": s.budget, "period": self.period,
                 "period_start": self.start, "limit": s.limit, "used": s.used,
                 "used_ratio": s.ratio, "alerts": list(s.alerts)}
                for s in sorted(self.states.values(), key=lambda s: (s.tenant, s.budget))
                if tenant is None or s.tenant == tenant]
