"""The tenants screen's model: per-tenant usage, budgets and sorting, from
`/admin/v1/usage` (one appliance, or merged over a fleet).

Computed from the daemon's JSON and nothing else; no Textual, no HTTP."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from appliance.tui.format import as_dict, as_list, num, text, windowed


PERIODS = {"1h": 3600, "24h": 86400, "7d": 7 * 86400}
# What a line is: the tenant, or one of the tags on the tenants' API keys.
GROUPS = ("tenant", "tag:team", "tag:project", "tag:cost_center")
IDLE = "(idle)"
UNTAGGED = "(untagged)"


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: str
    gpu_seconds: float
    prefill_gpu_seconds: float
    decode_gpu_seconds: float
    cost_usage: float | None
    cost_allocation: float | None
    kwh: float | None
    kg_co2e: float | None
    share: float | None               # of all tenants' GPU-seconds
    budget_used: float | None         # the highest of the tenant's budgets, 0..1+
    requests: int | None
    simulated: bool
    measured: bool
    # requests refused (overloaded, rate limits, budgets) in the period: they cost nothing
    rejected: int | None = None


TENANT_SORTS = ("gpu_seconds", "cost_usage", "cost_allocation", "kwh", "kg_co2e",
                "budget_used", "rejected", "tenant")


def _rejected_map(usage: dict) -> dict[str, int]:
    """tenant -> refused requests, from the usage report's `rejected` (tenant -> reason
    -> count) when the daemon gives it."""
    return {str(t): sum(int(n) for n in as_dict(reasons).values() if num(n) is not None)
            for t, reasons in as_dict(usage.get("rejected")).items()}


def _add(a: float | None, b: Any) -> float | None:
    b = num(b)
    if b is None:
        return a
    return b if a is None else a + b


def _budget_map(usage: dict) -> dict[str, float]:
    """tenant -> highest budget used ratio, from `budgets` if the daemon gives them:
    `{"tenant": {"gpu_hours": 0.5, ...}}` or `[{"tenant", "budget", "used_ratio"}]`."""
    out: dict[str, float] = {}
    raw = usage.get("budgets")
    if isinstance(raw, dict):
        for tenant, budgets in raw.items():
            vals = [num(v) for v in as_dict(budgets).values()]
            vals = [v for v in vals if v is not None]
            if not vals and num(budgets) is not None:
                vals = [num(budgets)]
            if vals:
                out[str(tenant)] = max(vals)
    for b in as_list(raw):
        b = as_dict(b)
        used = num(b.get("used_ratio"))
        if used is not None and b.get("tenant") is not None:
            out[str(b["tenant"])] = max(out.get(str(b["tenant"]), 0.0), used)
    return out


def tenants_from_usage(usage: dict, group: str = "tenant") -> list[TenantView]:
    """Rows of `/admin/v1/usage?group_by=tenant,phase` folded into one line per tenant
    (or, `group` a tag such as `tag:team`, of `group_by=tag:team,phase`: one line per
    team, `(untagged)` for tenants without it, the `(idle)` row kept apart). Budgets are
    the tenants': they are shown on tenant lines only."""
    usage = as_dict(usage)
    acc: dict[str, dict] = {}
    for row in as_list(usage.get("rows")):
        row = as_dict(row)
        if group == "tenant":
            tenant = text(row.get("tenant"), "(none)")
        elif row.get("tenant") == IDLE:
            tenant = IDLE
        else:
            tenant = text(row.get(group), UNTAGGED)
        a = acc.setdefault(tenant, {"gpu": None, "prefill": 0.0, "decode": 0.0, "cu": None,
                                    "ca": None, "j": None, "g": None, "req": None,
                                    "sim": False, "measured": True, "budget": None})
        gpu = num(row.get("gpu_seconds"))
        a["gpu"] = _add(a["gpu"], gpu)
        if row.get("phase") in ("prefill", "decode") and gpu is not None:
            a[row["phase"]] += gpu
        a["cu"] = _add(a["cu"], row.get("cost_usage"))
        a["ca"] = _add(a["ca"], row.get("cost_allocation"))
        a["j"] = _add(a["j"], row.get("energy_joules"))
        a["g"] = _add(a["g"], row.get("co2e_grams"))
        a["req"] = _add(a["req"], row.get("requests"))
        a["sim"] = a["sim"] or bool(row.get("simulated"))
        a["measured"] = a["measured"] and row.get("measured") is not False
        bu = windowed(row.get("budget_used")) if not isinstance(row.get("budget_used"), dict) \
            else max([v for v in map(num, row["budget_used"].values()) if v is not None],
                     default=None)
        if bu is not None:
            a["budget"] = bu if a["budget"] is None else max(a["budget"], bu)
    budgets = _budget_map(usage) if group == "tenant" else {}
    refused = _rejected_map(usage) if group == "tenant" else {}
    if "rejected" in usage and group == "tenant":
        for tenant in refused:      # refused only: no usage row, still a line
            acc.setdefault(tenant, {"gpu": None, "prefill": 0.0, "decode": 0.0, "cu": None,
                                    "ca": None, "j": None, "g": None, "req": None,
                                    "sim": False, "measured": True, "budget": None})
    total = sum(a["gpu"] or 0.0 for a in acc.values())
    out = []
    for tenant, a in acc.items():
        gpu = a["gpu"] or 0.0
        budget = a["budget"] if a["budget"] is not None else budgets.get(tenant)
        out.append(TenantView(
            tenant=tenant, gpu_seconds=gpu, prefill_gpu_seconds=a["prefill"],
            decode_gpu_seconds=a["decode"], cost_usage=a["cu"], cost_allocation=a["ca"],
            kwh=None if a["j"] is None else a["j"] / 3.6e6,
            kg_co2e=None if a["g"] is None else a["g"] / 1000,
            share=gpu / total if total > 0 else None, budget_used=budget,
            requests=None if a["req"] is None else int(a["req"]),
            simulated=a["sim"], measured=a["measured"],
            rejected=refused.get(tenant, 0) if "rejected" in usage and group == "tenant"
            else None))
    return sort_tenants(out, "gpu_seconds", descending=True)


def sort_tenants(rows: list[TenantView], key: str, descending: bool = True) -> list[TenantView]:
    if key == "tenant":
        return sorted(rows, key=lambda r: r.tenant, reverse=descending)
    present = [r for r in rows if getattr(r, key) is not None]
    missing = [r for r in rows if getattr(r, key) is None]
    present.sort(key=lambda r: (getattr(r, key), r.tenant), reverse=descending)
    return present + sorted(missing, key=lambda r: r.tenant)   # n/a always last


def filter_tenants(rows: list[TenantView], needle: str) -> list[TenantView]:
    needle = needle.strip().lower()
    return [r for r in rows if needle in r.tenant.lower()] if needle else rows


def merge_tenants(per_appliance: Iterable[list[TenantView]]) -> list[TenantView]:
    """Tenants across a fleet: sums by tenant name, shares of the fleet's total."""
    acc: dict[str, dict] = {}
    for rows in per_appliance:
        for r in rows:
            a = acc.setdefault(r.tenant, {"gpu": 0.0, "p": 0.0, "d": 0.0, "cu": None, "ca": None,
                                          "kwh": None, "co2": None, "req": None, "sim": False,
                                          "measured": True, "budget": None, "rej": None})
            a["rej"] = _add(a["rej"], r.rejected)
            a["gpu"] += r.gpu_seconds
            a["p"] += r.prefill_gpu_seconds
            a["d"] += r.decode_gpu_seconds
            for k, v in (("cu", r.cost_usage), ("ca", r.cost_allocation), ("kwh", r.kwh),
                         ("co2", r.kg_co2e), ("req", r.requests)):
                a[k] = _add(a[k], v)
            a["sim"] = a["sim"] or r.simulated
            a["measured"] = a["measured"] and r.measured
            if r.budget_used is not None:
                a["budget"] = max(a["budget"] or 0.0, r.budget_used)
    total = sum(a["gpu"] for a in acc.values())
    return sort_tenants([TenantView(
        tenant=t, gpu_seconds=a["gpu"], prefill_gpu_seconds=a["p"], decode_gpu_seconds=a["d"],
        cost_usage=a["cu"], cost_allocation=a["ca"], kwh=a["kwh"], kg_co2e=a["co2"],
        share=a["gpu"] / total if total > 0 else None, budget_used=a["budget"],
        requests=None if a["req"] is None else int(a["req"]), simulated=a["sim"],
        measured=a["measured"], rejected=None if a["rej"] is None else int(a["rej"]))
        for t, a in acc.items()], "gpu_seconds")
