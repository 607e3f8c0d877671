"""The usage report as a FOCUS cost-and-usage file (FinOps Foundation, FOCUS 1.2), the
format finance teams ingest.

One row per tenant × model × phase × site × charge period (the UTC hour; the query
window's edges clip the first and last). Each hour is the allocation report over that
hour (`reports.usage`), so a row's EffectiveCost is its `cost_allocation` there and
Σ EffectiveCost = the devices' capacity cost of the window = Σ allocation of the whole
window: pots are sums over clipped device windows, so hours add up to the window.

The appliance charges inside one organisation, at the rate cards, with no discounts or
commitments: BilledCost = EffectiveCost = ListCost = ContractedCost, and the unit prices
are that cost per GPU-hour (device price + energy + the idle share under `share`). Idle
capacity (the `(idle)` row: `idle_policy = "idle"`, or an hour without a request) is a
row of its own with CapacityReservationStatus = unused: the appliance's devices are the
reservation every row draws on. The appliance is provider and invoice issuer (no third
party is paid); InvoiceId names the billing month's chargeback statement
(`<appliance>-YYYY-MM`).
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone

from appliance.accounting import reports
from appliance.accounting.allocation import Method
from appliance.accounting.ledger import Ledger

FOCUS_VERSION = "1.2"
HOUR = 3600.0
MAX_SPAN_S = 93 * 86400.0     # a quarter: ~2,200 hourly reports
DIMS = ["tenant", "model", "phase", "site"]
COLUMNS = (
    "AvailabilityZone", "BilledCost", "BillingAccountId", "BillingAccountName",
    "BillingAccountType", "BillingCurrency", "BillingPeriodEnd", "BillingPeriodStart",
    "CapacityReservationId", "CapacityReservationStatus", "ChargeCategory", "ChargeClass",
    "ChargeDescription", "ChargeFrequency", "ChargePeriodEnd", "ChargePeriodStart",
    "CommitmentDiscountCategory", "CommitmentDiscountId", "CommitmentDiscountName",
    "CommitmentDiscountQuantity", "CommitmentDiscountStatus", "CommitmentDiscountType",
    "CommitmentDiscountUnit", "ConsumedQuantity", "ConsumedUnit", "ContractedCost",
    "ContractedUnitPrice", "EffectiveCost", "InvoiceId", "InvoiceIssuerName", "ListCost",
    "ListUnitPrice", "PricingCategory", "PricingCurrency", "PricingCurrencyContractedUnitPrice",
    "PricingCurrencyEffectiveCost", "PricingCurrencyListUnitPrice", "PricingQuantity",
    "PricingUnit", "ProviderName", "PublisherName", "RegionId", "RegionName", "ResourceId",
    "ResourceName", "ResourceType", "ServiceCategory", "ServiceName", "ServiceSubcategory",
    "SkuId", "SkuMeter", "SkuPriceDetails", "SkuPriceId", "SubAccountId", "SubAccountName",
    "SubAccountType", "Tags",
    # applianced's own columns (FOCUS: custom columns carry the x_ prefix)
    "x_Requests", "x_PromptTokens", "x_OutputTokens", "x_EnergyJoules", "x_Co2eGrams",
    "x_Simulated", "x_FocusVersion")
UNIT = "GPU-Hours"


@dataclass(frozen=True)
class Source:
    """Who issues the charges: the appliance, its device group and site."""

    appliance: str
    devices: str            # the device group, e.g. "sim:8xH100"
    site: str
    region: str = ""


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _month(t: float) -> tuple[float, float]:
    d = datetime.fromtimestamp(t, timezone.utc)
    start = datetime(d.year, d.month, 1, tzinfo=timezone.utc)
    end = datetime(d.year + d.month // 12, d.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start.timestamp(), end.timestamp()


def hours(since: float, until: float) -> list[tuple[float, float]]:
    """The charge periods: UTC hours, the first and last clipped to the window."""
    out = []
    t = since
    while t < until:
        nxt = min((math.floor(t / HOUR) + 1) * HOUR, until)
        out.append((t, nxt))
        t = nxt
    return out


def rows(ledger: Ledger, since: float, until: float, method: Method, src: Source,
         idle_policy: str | None = None) -> list[dict]:
    """FOCUS rows for [since, until), whole seconds (FOCUS datetimes have no fractions)."""
    since, until = float(math.floor(since)), float(math.ceil(until))
    out = []
    resource = f"{src.appliance}/{src.devices}"
    for h0, h1 in hours(since, until):
        rep = reports.usage(ledger, DIMS, h0, h1, None, idle_policy, method)
        b0, b1 = _month(h0)
        for r in rep["rows"]:
            out.append(_row(r, h0, h1, b0, b1, rep["currency"], resource, src,
                            method.tenant_tags))
    return out


def _row(r: dict, h0: float, h1: float, b0: float, b1: float, currency: str, resource: str,
         src: Source, tenant_tags: dict) -> dict:
    idle = r["tenant"] == reports.IDLE_TENANT
    cost = float(r["cost_allocation"])
    qty = float(r["gpu_seconds"]) / HOUR
    price = cost / qty if qty > 0 else 0.0
    site = r["site"] or src.site
    model = r["model"]
    sim = " (simulated devices)" if r["simulated"] else ""
    if idle:
        tags = {"site": site, "capacity": "unused"}
        desc = f"unused capacity of {resource} (idle, static and unattributed device time){sim}"
        service, sku = "applianced", "gpu-time:idle"
    else:
        tags = {"phase": r["phase"], "model": model, "site": site,
                **tenant_tags.get(r["tenant"], {})}
        desc = f"{r['phase']} GPU time of {model} on {resource} for tenant {r['tenant']}{sim}"
        service, sku = model or "applianced", f"gpu-time:{r['phase']}"
    return {
        "AvailabilityZone": None, "BilledCost": cost, "BillingAccountId": src.appliance,
        "BillingAccountName": src.appliance, "BillingAccountType": "Appliance",
        "BillingCurrency": currency, "BillingPeriodEnd": _iso(b1), "BillingPeriodStart": _iso(b0),
        "CapacityReservationId": resource,
        "CapacityReservationStatus": "unused" if idle else "used",
        "ChargeCategory": "Usage", "ChargeClass": None, "ChargeDescription": desc,
        "ChargeFrequency": "Usage-Based", "ChargePeriodEnd": _iso(h1),
        "ChargePeriodStart": _iso(h0),
        "CommitmentDiscountCategory": None, "CommitmentDiscountId": None,
        "CommitmentDiscountName": None, "CommitmentDiscountQuantity": None,
        "CommitmentDiscountStatus": None, "CommitmentDiscountType": None,
        "CommitmentDiscountUnit": None,
        "ConsumedQuantity": qty, "ConsumedUnit": UNIT, "ContractedCost": cost,
        "ContractedUnitPrice": price, "EffectiveCost": cost, "InvoiceId": f"{src.appliance}-{_iso(b0)[:7]}", "InvoiceIssuerName": src.appliance, "ListCost": cost, "ListUnitPrice": price,
        "PricingCategory": "Standard", "PricingCurrency": currency,
        "PricingCurrencyContractedUnitPrice": price, "PricingCurrencyEffectiveCost": cost,
        "PricingCurrencyListUnitPrice": price, "PricingQuantity": qty, "PricingUnit": UNIT,
        "ProviderName": src.appliance, "PublisherName": "applianced",
        "RegionId": site, "RegionName": f"{site} ({src.region})" if src.region else site,
        "ResourceId": resource, "ResourceName": f"{src.appliance} ({src.devices})",
        "ResourceType": "LLM inference appliance", "ServiceCategory": "AI and Machine Learning",
        "ServiceName": service, "ServiceSubcategory": "Generative AI", "SkuId": sku,
        "SkuMeter": "GPU time", "SkuPriceDetails": None, "SkuPriceId": sku,
        "SubAccountId": r["tenant"], "SubAccountName": r["tenant"],
        "SubAccountType": "Tenant",
        "Tags": json.dumps({k: v for k, v in tags.items() if v is not None}, sort_keys=True),
        "x_Requests": r["requests"], "x_PromptTokens": r["prompt_tokens"],
        "x_OutputTokens": r["output_tokens"], "x_EnergyJoules": r["energy_joules"],
        "x_Co2eGrams": r["co2e_grams"], "x_Simulated": "true" if r["simulated"] else "false",
        "x_FocusVersion": FOCUS_VERSION,
    }


def _decimal(v: float) -> str:
    """Plain decimal notation (no exponent), 12 places: FOCUS decimals are numerals."""
    text = f"{v:.12f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def to_csv(focus_rows: list[dict]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in focus_rows:
        w.writerow(["" if r[c] is None else _decimal(r[c]) if isinstance(r[c], float) else r[c]
                    for c in COLUMNS])
    return out.getvalue()
