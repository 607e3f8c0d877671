"""Per-tenant admission policy: rate limits (token buckets), enforced budgets, and the
figures `/admin/v1/tenants` shows.

Why here and not in the router: every check is a dictionary look-up and a little
arithmetic, done on the event loop before a request costs anything (the request limit
before its body is read, the budget before either, the token limit once the prompt is
tokenized because it needs the count). No aiohttp here: a refusal is a `Refusal`, which
`openai_routes` turns into the 429 OpenAI's API sends (same headers, same codes).

Semantics, as OpenAI's and LiteLLM's: a bucket holds up to one minute's worth (the
limit) and refills continuously at limit/60 per second. A request takes one request
token; a generation reserves prompt + n × max_tokens tokens at admission (the prompt
alone when max_tokens is not set) and is settled at finish with the real count, so a
bucket may go below zero (the debt delays the tenant's next requests, not this one).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from appliance.accounting.budgets import period_start
from appliance.config import BudgetsConfig, TenantConfig

# A tenant whose deprioritizing budget is spent is served after every configured
# class: the request's `priority` (lower is served first, as vLLM's) becomes this.
LOWEST_PRIORITY = 2**31 - 1
RATE_WINDOW_S = 60.0
# The reasons a refusal is counted under (ledger `finish_reason` of the rejected row,
# and /metrics applianced_tenant_rejected_total{reason}).
ADVERB = {"day": "daily", "week": "weekly", "month": "monthly"}
REASONS = ("overloaded", "rate_limit_requests", "rate_limit_tokens", "budget_exceeded")


_REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests")
_TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                  "x-ratelimit-reset-tokens")


def duration(seconds: float) -> str:
    """OpenAI's reset format (Go's time.Duration): "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        s = math.ceil(seconds * 1000) / 1000
        return f"{s:.3f}".rstrip("0").rstrip(".") + "s"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + f"{m}m{s}s"


class TokenBucket:
    """Up to `capacity` tokens, refilled at `capacity / 60` per second."""

    __slots__ = ("capacity", "rate", "level", "t", "limit_text")

    def __init__(self, per_minute: float, now: float):
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute         # a new bucket starts full
        self.t = now
        self.limit_text = f"{per_minute:g}"     # x-ratelimit-limit-*, on every response

    def _refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
            self.t = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount` if the bucket holds it: 0.0; else nothing is taken and the
        answer is the seconds until it will."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def give(self, amount: float, now: float) -> None:
        """Settle: a refund (positive) or a further charge (negative, may go below 0)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(0, int(self.level))

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        self._refill(now)
        return (self.capacity - self.level) / self.rate

    def resize(self, per_minute: float, now: float) -> None:
        """A reload changed the limit: keep what was used, not the old ceiling."""
        self._refill(now)
        used = self.capacity - self.level
        self.capacity, self.rate = per_minute, per_minute / 60.0
        self.level = per_minute - used
        self.limit_text = f"{per_minute:g}"


@dataclass
class Refusal:
    """Why a request is refused (429), with what the client needs to back off."""

    reason: str                 # one of REASONS
    code: str                   # OpenAI error code: rate_limit_exceeded | budget_exceeded
    message: str
    retry_after_s: float | None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Reservation:
    tenant: str
    tokens: float


@dataclass
class TenantState:
    """One tenant's live figures: its buckets, what it has in flight, its last minute."""

    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    inflight: int = 0
    # [second, requests, tokens] finished per second over the last minute (61 at most)
    recent: deque = field(default_factory=deque)
    rejected: dict[str, int] = field(default_factory=dict)


class TenantPolicy:
    """The `[tenants]` and `[budgets] enforce` of the config, applied per request.

    `budget_report(tenant=None)` gives the accounting process's latest budget report
    (`AccountingLink.budget_report`): a list of {tenant, budget, period, period_start,
    limit, used}, the tenant's only when one is named (admission asks per request, so
    that is a look-up). `clock` is the time (a seam: tests move it across a period's end)."""

    def __init__(self, tenants: dict[str, TenantConfig], budgets: BudgetsConfig,
                 budget_report: Callable[..., list[dict]] | None = None,
                 clock: Callable[[], float] = time.time):
        self.clock = clock
        self.budget_report = budget_report
        self.tenants: dict[str, TenantConfig] = {}
        self.budgets = budgets
        self.states: dict[str, TenantState] = {}
        self._limited: dict[str, bool] = {}     # tenant -> `limited(tenant)`, until a reload
        self.reloads = 0
        self.reloaded_at: float | None = None
        self._period: tuple[str, float, float] = ("", 0.0, 0.0)    # (period, start, end)
        self.apply(tenants, budgets)

    # ---- configuration -----------------------------------------------------------------
    def config(self, tenant: str) -> TenantConfig:
        """The tenant's own table, else [tenants.default], else no limits."""
        return self.tenants.get(tenant) or self.tenants.get("default") or TenantConfig()

    def apply(self, tenants: dict[str, TenantConfig], budgets: BudgetsConfig) -> None:
        """New limits (start-up, reload). Buckets keep what was used: a reload neither
        forgives a burst nor refuses a tenant that has been quiet."""
        self.tenants = dict(tenants)
        self.budgets = budgets
        self._limited = {}
        now = self.clock()
        for name, st in self.states.items():
            self._fit(st, self.config(name), now)

    def reload(self, tenants: dict[str, TenantConfig], budgets: BudgetsConfig) -> None:
        self.apply(tenants, budgets)
        self.reloads += 1
        self.reloaded_at = self.clock()

    def _fit(self, st: TenantState, tc: TenantConfig, now: float) -> None:
        for attr, per_minute in (("requests", tc.requests_per_minute),
                                 ("tokens", tc.tokens_per_minute)):
            bucket = getattr(st, attr)
            if per_minute <= 0:
                setattr(st, attr, None)
            elif bucket is None:
                setattr(st, attr, TokenBucket(per_minute, now))
            elif bucket.capacity != per_minute:
                bucket.resize(per_minute, now)

    def state(self, tenant: str) -> TenantState:
        st = self.states.get(tenant)
        if st is None:
            st = self.states[tenant] = TenantState()
            self._fit(st, self.config(tenant), self.clock())
        return st

    # ---- budgets -----------------------------------------------------------------------
    def enforce_mode(self, tenant: str) -> str:
        return self.budgets.enforce.get(tenant, "alert")

    def spent(self, tenant: str, now: float | None = None) -> dict | None:
        """The tenant's first budget at or over 100% in the current period, or None. A
        report from before the period's start (the accounting process rolls over on its
        next record) no longer counts: the budget resumes at the boundary itself."""
        if self.budget_report is None:
            return None
        now = self.clock() if now is None else now
        for b in self.budget_report(tenant):
            if b.get("tenant") != tenant or not b.get("limit") or b["used"] < b["limit"]:
                continue
            if self._period_start(b.get("period", self.budgets.period), now) \
                    > b.get("period_start", 0.0):
                continue        # that period is over
            return b
        return None

    def _period_start(self, period: str, now: float) -> float:
        """`period_start`, computed once per period rather than per request."""
        name, start, end = self._period
        if name != period or not start <= now < end:
            start, end = period_start(period, now), next_period_start(period, now)
            self._period = (period, start, end)
        return start

    def priority(self, tenant: str) -> tuple[int, bool]:
        """(priority class, deprioritized by a spent budget) for a new request."""
        base = self.config(tenant).priority
        if self.enforce_mode(tenant) == "deprioritize" and self.spent(tenant) is not None:
            return LOWEST_PRIORITY, True
        return base, False

    def request_priority(self, tenant: str, asked: int | None) -> int | None:
        """The `priority` a request goes to the scheduler with: what it asked (None: its
        tenant's class), or the lowest class while its deprioritizing budget is spent."""
        if self.enforce_mode(tenant) == "deprioritize" and self.spent(tenant) is not None:
            return LOWEST_PRIORITY
        return asked

    # ---- admission ---------------------------------------------------------------------
    def limited(self, tenant: str) -> bool:
        """Whether anything here can refuse or reorder `tenant`'s requests: a request or
        token limit, or a budget that rejects or deprioritizes. Most tenants of most
        boxes have none; their requests skip `admit`, `request_priority`, `reserve` and
        `headers` (nothing to check, reserve or report), and cost a dictionary look-up."""
        limited = self._limited.get(tenant)
        if limited is None:
            tc = self.config(tenant)
            limited = (tc.requests_per_minute > 0 or tc.tokens_per_minute > 0
                       or self.enforce_mode(tenant) != "alert")
            if len(self._limited) > 10_000:      # (tenants are the keys': a few)
                self._limited.clear()
            self._limited[tenant] = limited
        return limited

    def admit(self, tenant: str) -> Refusal | None:
        """Before the body is read: a rejecting budget that is spent, then the request
        bucket. Takes the request's token when it admits."""
        now = self.clock()
        if self.enforce_mode(tenant) == "reject":
            b = self.spent(tenant, now)
            if b is not None:
                return self._refuse(tenant, self._budget_refusal(tenant, b, now))
        st = self.state(tenant)
        if st.requests is not None:
            wait = st.requests.take(1, now)
            if wait > 0:
                lim = st.requests.capacity
                return self._refuse(tenant, Refusal(
                    "rate_limit_requests", "rate_limit_exceeded",
                    f"Rate limit reached for tenant {tenant!r} on requests per minute: "
                    f"limit {lim:g}, used {lim:g} in the last minute. Please try again in "
                    f"{duration(wait)}.", wait, self.headers(tenant, now)))
        return None

    def reserve(self, tenant: str, tokens: int) -> tuple[Reservation | None, Refusal | None]:
        """Once tokenized: reserve prompt + maximal output on the token bucket."""
        now = self.clock()
        st = self.state(tenant)
        if st.tokens is None:
            return Reservation(tenant, 0.0), None
        lim = st.tokens.capacity
        if tokens > lim:
            return None, self._refuse(tenant, Refusal(
                "rate_limit_tokens", "rate_limit_exceeded",
                f"Request too large for tenant {tenant!r} on tokens per minute: limit "
                f"{lim:g}, requested {tokens} (prompt + max_tokens); send a shorter prompt "
                f"or a smaller max_tokens.", None, self.headers(tenant, now)))
        wait = st.tokens.take(tokens, now)
        if wait > 0:
            return None, self._refuse(tenant, Refusal(
                "rate_limit_tokens", "rate_limit_exceeded",
                f"Rate limit reached for tenant {tenant!r} on tokens per minute: limit "
                f"{lim:g}, used {lim - max(st.tokens.level, 0):.0f}, requested {tokens}. "
                f"Please try again in {duration(wait)}.", wait, self.headers(tenant, now)))
        return Reservation(tenant, float(tokens)), None

    def started(self, tenant: str) -> None:
        self.state(tenant).inflight += 1

    def finished(self, tenant: str, reservation: Reservation | None, used_tokens: int) -> None:
        """A request admitted with `started` ended: settle its reservation with what it
        really used, and count it in the tenant's last minute."""
        now = self.clock()
        st = self.state(tenant)
        st.inflight = max(0, st.inflight - 1)
        if reservation is not None and st.tokens is not None:
            st.tokens.give(reservation.tokens - used_tokens, now)
        second = int(now)
        recent = st.recent
        if recent and recent[-1][0] == second:
            last = recent[-1]
            last[1] += 1
            last[2] += used_tokens
        else:       # a new second: the oldest may have left the window
            recent.append([second, 1, used_tokens])
            self._trim(st, now)

    def finished_unstarted(self, tenant: str, reservation: Reservation | None) -> None:
        """Admitted by the limits, then refused for another reason: give the tokens back."""
        st = self.state(tenant)
        if reservation is not None and st.tokens is not None:
            st.tokens.give(reservation.tokens, self.clock())

    def _trim(self, st: TenantState, now: float) -> None:
        while st.recent and st.recent[0][0] <= now - RATE_WINDOW_S - 1:
            st.recent.popleft()

    def _refuse(self, tenant: str, refusal: Refusal) -> Refusal:
        st = self.state(tenant)
        st.rejected[refusal.reason] = st.rejected.get(refusal.reason, 0) + 1
        return refusal

    def count_rejected(self, tenant: str, reason: str) -> None:
        """A refusal decided elsewhere (overload) counted with the tenant's others."""
        st = self.state(tenant)
        st.rejected[reason] = st.rejected.get(reason, 0) + 1

    def _budget_refusal(self, tenant: str, b: dict, now: float) -> Refusal:
        period = b.get("period", self.budgets.period)
        resets = next_period_start(period, now)
        wait = max(1.0, resets - now)
        return Refusal(
            "budget_exceeded", "budget_exceeded",
            f"Budget exceeded for tenant {tenant!r}: its {ADVERB.get(period, period)} "
            f"{b['budget']} budget "
            f"is spent ({b['used']:.6g} of {b['limit']:.6g} used); it resets at "
            f"{_iso(resets)} (in {duration(wait)}).", wait, {})

    # ---- headers -------------------------------------------------------------------------
    def headers(self, tenant: str, now: float | None = None) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's configured limits."""
        now = self.clock() if now is None else now
        st = self.state(tenant)
        out = {}
        for names, bucket in ((_REQUEST_HEADERS, st.requests), (_TOKEN_HEADERS, st.tokens)):
            if bucket is None:
                continue
            bucket._refill(now)
            out[names[0]] = bucket.limit_text
            out[names[1]] = str(max(0, int(bucket.level)))
            out[names[2]] = duration((bucket.capacity - bucket.level) / bucket.rate)
        return out

    # ---- the tenants view --------------------------------------------------------------
    def view(self, queue_depth: Callable[[str], int | None] | None = None) -> list[dict]:
        """Every configured or seen tenant: its settings, its live rate and concurrency,
        its refusals, its budgets and what they enforce."""
        now = self.clock()
        report = self.budget_report() if self.budget_report is not None else None
        names = sorted(set(self.tenants) | set(self.states) | set(self.budgets.enforce)
                       | {b["tenant"] for b in report or []})
        out = []
        for name in names:
            tc = self.config(name)
            st = self.state(name)
            self._trim(st, now)
            prio, demoted = self.priority(name)
            budgets = [{"budget": b["budget"], "period": b.get("period"), "used": b["used"],
                        "limit": b["limit"], "used_ratio": b.get("used_ratio"),
                        "resets_at": _iso(next_period_start(b.get("period", self.budgets.period),
                                                            now))}
                       for b in report or [] if b["tenant"] == name]
            depth = queue_depth(name) if queue_depth is not None else None
            out.append({
                "tenant": name, "configured": name in self.tenants,
                "weight": tc.weight, "priority": tc.priority, "effective_priority": prio,
                "deprioritized": demoted, "max_concurrent": tc.max_concurrent,
                "limits": {"requests_per_minute": tc.requests_per_minute,
                           "tokens_per_minute": tc.tokens_per_minute},
                "remaining": {"requests": st.requests.remaining(now) if st.requests else None,
                              "tokens": st.tokens.remaining(now) if st.tokens else None},
                "rate": {"requests_per_minute": sum(r[1] for r in st.recent),
                         "tokens_per_minute": sum(r[2] for r in st.recent)},
                "inflight": st.inflight,
                "queue_depth": depth,
                "rejected": dict(st.rejected),
                "budget": {"enforce": self.enforce_mode(name),
                           "spent": self.spent(name, now) is not None,
                           "budgets": budgets,
                           "tracked": report is not None},
            })
        return out


def next_period_start(period: str, t: float) -> float:
    """When the period that holds `t` ends (UTC)."""
    from datetime import datetime, timedelta, timezone
    start = datetime.fromtimestamp(period_start(period, t), timezone.utc)
    if period == "day":
        return (start + timedelta(days=1)).timestamp()
    if period == "week":
        return (start + timedelta(days=7)).timestamp()
    month = start.month % 12 + 1
    return start.replace(year=start.year + (start.month == 12), month=month).timestamp()


def _iso(t: float) -> str:
    from datetime import datetime, timezone
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
