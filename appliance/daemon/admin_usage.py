"""`/admin/v1/usage`, `/admin/v1/carbon` and `/admin/v1/rates`: the ledger's reports
over HTTP, priced at query time with the configured rate cards.

A tenant's API key may read `/admin/v1/usage` for its own tenant only: its rows are
filtered to it whatever it asks, and the appliance-wide totals (which would show the
other tenants' load) come back null. Carbon is for operators. The SQL runs in a thread:
a report over months of rows must not stall the event loop that serves tokens.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web

from collections import Counter

from appliance.accounting import focus, reports
from appliance.accounting.ledger import ReportTimeout
from appliance.daemon.api_schema import Operation, Param, read_query, register
from appliance.daemon.auth import CALLER, Caller, require_admin
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import ACCOUNTING, OPERATIONS, json_response

if TYPE_CHECKING:
    from appliance.daemon.accounting_link import AccountingLink

DEFAULT_SPAN_S = 86400.0
_WHEN = ("an ISO 8601 time (UTC unless it says), a Unix time, or a duration before now "
         "such as 2h")
SINCE = Param("since", {"type": "string"}, f"Start of the window: {_WHEN} (default: a day "
                                           "before until).")
UNTIL = Param("until", {"type": "string"}, f"End of the window: {_WHEN} (default: now).")
FORMAT = Param("format", {"enum": ["json", "csv", "focus"], "default": "json"},
               "json, csv, or focus (the FOCUS 1.2 CSV export; admin key only).")


def _group(dims) -> Param:
    return Param("group_by", {"type": "string"}, "Comma-separated dimensions out of "
                                                 + ", ".join(dims) + ".")


def _accountant(request: web.Request) -> AccountingLink:
    acc = request.app[ACCOUNTING]
    if acc is None:
        raise ApiError(404, "accounting is off on this appliance ([accounting] enabled = false)",
                       code="accounting_disabled")
    return acc


def _span(request: web.Request) -> tuple[float, float]:
    now = time.time()
    q = request.query
    try:
        until = reports.parse_when(q.get("until"), now, now + 1.0)
        since = reports.parse_when(q.get("since"), now, until - DEFAULT_SPAN_S)
    except ValueError as exc:
        raise ApiError(400, f"bad since/until: {exc}", param="since", code="invalid_time") from None
    if since >= until:
        raise ApiError(400, f"since ({reports.iso(since)}) must be before until "
                            f"({reports.iso(until)})", param="since", code="invalid_time")
    return since, until


async def _report(fn, *args):
    """Run a report in a thread; one that outruns `[accounting] report_timeout_s` (its
    query is interrupted, so it holds no WAL snapshot longer) is a 503 the client may
    retry with a shorter window."""
    try:
        return await asyncio.to_thread(fn, *args)
    except ReportTimeout as exc:
        raise ApiError(503, str(exc), code="report_timeout") from None


def _group_by(request: web.Request, allowed, default) -> list[str]:
    try:
        return reports.parse_group_by(request.query.get("group_by"), allowed, default)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="group_by", code="invalid_group_by") from None


async def usage(request: web.Request):
    caller: Caller = request[CALLER]
    acc = _accountant(request)
    fmt = read_query(request.query, (FORMAT,)).get("format", "json")
    group_by = _group_by(request, reports.USAGE_GROUPS, reports.USAGE_DIMS)
    since, until = _span(request)
    tenant = None if caller.admin else caller.tenant
    if fmt == "focus":
        return await _focus(request, acc, caller, since, until)
    report = await _report(reports.usage, acc.ledger, group_by, since, until, tenant,
                           acc.prices.idle_policy, acc.method)
    if fmt == "csv":
        return web.Response(text=reports.usage_csv(report), content_type="text/csv")
    report["budgets"] = acc.budget_report(tenant)
    # refused requests (overload, rate limits, budgets) per tenant and reason: the
    # ledger's rejected rows (they cost nothing, so the usage rows do not show them)
    report["rejected"] = await asyncio.to_thread(rejected_counts, acc, since, until, tenant)
    if caller.admin:
        report["accounting"] = await acc.fresh_status()
        # the fitted step-time terms per served model × device kind (accounting/attribution.py)
        report["calibration"] = list(report["accounting"].get("calibration", {}).values())
        if hasattr(acc, "reconciliation"):
            rec = await asyncio.to_thread(acc.reconciliation, since, until)
            report["reconciliation"] = rec.as_json()
    return json_response(report)


def rejected_counts(acc: AccountingLink, since: float, until: float,
                    tenant: str | None) -> dict[str, dict[str, int]]:
    """tenant -> reason -> refused requests that finished in [since, until)."""
    sql = ("SELECT tenant, coalesce(finish_reason, 'overloaded'), count(*) FROM requests "
           "WHERE status = 'rejected' AND finish >= ? AND finish < ?")
    args: tuple = (since, until)
    if tenant is not None:
        sql += " AND tenant = ?"
        args += (tenant,)
    out: dict[str, dict[str, int]] = {}
    for t, reason, n in acc.ledger.query(sql + " GROUP BY 1, 2", args):
        out.setdefault(t, {})[reason] = n
    return out


def _source(acc: AccountingLink) -> focus.Source:
    """The FOCUS rows' resource: this appliance's device group, e.g. `8xH100-SXM`."""
    kinds = Counter(d.model for d in acc.spec.devices)
    devices = "+".join(f"{n}x{m}" for m, n in sorted(kinds.items())) or "none"
    site = acc.site
    return focus.Source(site.appliance, devices, site.name, site.region)


async def _focus(request: web.Request, acc: AccountingLink, caller: Caller, since: float,
                 until: float):
    """The FOCUS 1.2 export: appliance-wide (every tenant and the idle capacity), so
    for operators only; the rows per UTC hour of the window."""
    if not caller.admin:
        raise ApiError(403, "the FOCUS export covers every tenant: it needs an admin key",
                       code="forbidden")
    if until - since > focus.MAX_SPAN_S:
        raise ApiError(400, f"a FOCUS export covers at most {focus.MAX_SPAN_S / 86400:g} days "
                            "(one report per hour); ask for several windows",
                       param="since", code="invalid_time")
    method = acc.method or reports.default_method(acc.prices.idle_policy)
    rows = await _report(focus.rows, acc.ledger, since, until, method, _source(acc),
                         acc.prices.idle_policy)
    return web.Response(text=focus.to_csv(rows), content_type="text/csv",
                        headers={"X-FOCUS-Version": focus.FOCUS_VERSION})


async def carbon(request: web.Request):
    require_admin(request)
    acc = _accountant(request)
    group_by = _group_by(request, reports.CARBON_DIMS, ("site", "tenant"))
    since, until = _span(request)
    report = await _report(reports.carbon, acc.ledger, group_by, since, until, acc.method)
    site = acc.site
    m = acc.method
    report["site"] = {"name": site.name, "appliance": site.appliance, "region": site.region,
                      "pue": site.pue, "intensity_source": site.intensity.source,
                      "intensity_kind": site.intensity.kind,
                      "market_g_per_kwh": m.market_g_per_kwh if m else None,
                      "node_overhead_w": m.node_overhead_w if m else 0.0}
    return json_response(report)


async def rates(request: web.Request):
    """The rate cards, each resolved for the device models this appliance accounts."""
    require_admin(request)
    acc = _accountant(request)
    models = sorted({d.model for d in acc.spec.devices})
    return json_response(acc.prices.describe(models))


_CSV = ("text/csv", {"type": "string"})
OPERATIONS_HERE = (
    Operation("GET", "/admin/v1/usage", usage, "Usage and chargeback over a window",
              "Accounting", "tenant_or_admin",
              params=(SINCE, UNTIL, _group(reports.USAGE_GROUPS), FORMAT),
              ok={"200": ("application/json", {"type": "object"}), "200 csv": _CSV},
              errors=(400, 404, 503), description="A tenant key reads its own tenant's rows "
              "only. request_id: one row per request, from the request rows (kept for "
              "[accounting] retention_days). 503 report_timeout: the report ran past "
              "[accounting] report_timeout_s."),
    Operation("GET", "/admin/v1/carbon", carbon, "Energy and emissions over a window",
              "Accounting", "admin", params=(SINCE, UNTIL, _group(reports.CARBON_DIMS)),
              errors=(400, 404, 503)),
    Operation("GET", "/admin/v1/rates", rates, "The rate cards, resolved per device model",
              "Accounting", "admin", errors=(404,)),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
