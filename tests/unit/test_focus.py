"""FOCUS export and key tags (issue 22 §5): the usage report as a FOCUS 1.2 file whose
EffectiveCost adds up to the allocation, checked by the FinOps Foundation's own
validator, and `group_by=tag:team` from the tags on the tenants' API keys.

The ledger is the real SQLite one written by the real accountant (test_allocation's
scene: 8 simulated H100s at $3.60/h); the daemon test drives a real daemon.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from datetime import datetime, timezone

import pytest

from appliance import config
from appliance.accounting import focus, reports
from helpers.ledger_scene import T0, capacity_of, ledger_with, method

SRC = focus.Source("app1", "8xH100-SXM", "s1", "DE")
TAGS = {"ta": {"team": "search", "cost_center": "CC-1"}, "tb": {"team": "search"},
        "tc": {"team": "ads", "project": "bids"}}
# requests in three UTC hours, hours with none between them (T0 is 22:13:20 UTC)
RUNS = [("R0", "ta", T0 + 1, 1.0, 2.0), ("R1", "tb", T0 + 30, 0.5, 3.0),
        ("R2", "tc", T0 + 500, 2.0, 1.0), ("R3", "ta", T0 + 2700, 1.0, 1.0),
        ("R4", "tc", T0 + 9000, 0.3, 0.7)]
END = T0 + 9100


def tagged(policy: str):
    m = method(policy, per_kwh=0.3, node_w=1000.0)
    m.tenant_tags = TAGS
    return m


def ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


@pytest.fixture(scope="module")
def led(tmp_path_factory):
    ledger = ledger_with(tmp_path_factory.mktemp("focus"), RUNS, end=END)
    yield ledger
    ledger.stop()


@pytest.mark.parametrize("policy", ["share", "idle"])
def test_effective_cost_adds_up_to_the_allocation(led, policy):
    since, until = T0 + 0.4, END - 50.7        # edges inside hours, fractions of seconds
    rows = focus.rows(led, since, until, tagged(policy), SRC)
    s, u = float(int(since)), float(int(until) + 1)     # the export's whole seconds
    rep = reports.usage(led, ["tenant", "model", "phase", "site"], s, u, method=tagged(policy))
    allocation = sum(r["cost_allocation"] for r in rep["rows"])
    capacity = capacity_of(led, s, u, per_kwh=0.3, node_w=1000.0)
    effective = sum(r["EffectiveCost"] for r in rows)
    assert effective == pytest.approx(allocation, rel=0.005)
    assert effective == pytest.approx(capacity, rel=0.005)
    for r in rows:
        assert r["BilledCost"] == r["EffectiveCost"] == r["ListCost"] == r["ContractedCost"]
        assert r["ListCost"] == pytest.approx(r["ListUnitPrice"] * r["PricingQuantity"], abs=1e-12)
        assert r["BillingCurrency"] == "USD" and r["ChargeCategory"] == "Usage"
        assert r["ServiceCategory"] == "AI and Machine Learning"
        a, b = ts(r["ChargePeriodStart"]), ts(r["ChargePeriodEnd"])
        # a charge period is (a piece of) one UTC hour inside the window
        assert s <= a < b <= u and b - a <= 3600 and a // 3600 == (b - 1) // 3600
        assert ts(r["BillingPeriodStart"]) <= a and b <= ts(r["BillingPeriodEnd"])
    # one row per tenant x model x phase x site x hour
    keys = [(r["SubAccountId"], r["ServiceName"], r["SkuId"], r["RegionId"], r["ChargePeriodStart"])
            for r in rows]
    assert len(keys) == len(set(keys))
    # GPU-hours: the tenants' rows consume what their requests ran
    used = [r for r in rows if r["CapacityReservationStatus"] == "used"]
    assert sum(r["ConsumedQuantity"] for r in used) == pytest.approx(
        sum(p + d for *_, p, d in RUNS) * 4 / 3600, rel=0.01)
    unused = [r for r in rows if r["CapacityReservationStatus"] == "unused"]
    assert unused and all(r["SubAccountId"] == reports.IDLE_TENANT for r in unused)
    hours_with_requests = {r["ChargePeriodStart"] for r in used}
    if policy == "share":      # idle rows only for the hours nobody ran in
        assert not {r["ChargePeriodStart"] for r in unused} & hours_with_requests
    else:                      # every hour that ran something has its idle capacity row
        assert hours_with_requests <= {r["ChargePeriodStart"] for r in unused}
    # tags: phase, model, site and the tenant's key tags
    (r0,) = [r for r in used if r["SubAccountId"] == "ta" and r["SkuId"] == "gpu-time:decode"
             and r["ChargePeriodStart"] == "2023-11-14T22:13:20Z"]
    assert json.loads(r0["Tags"]) == {"phase": "decode", "model": "m", "site": "s1",
                                      "team": "search", "cost_center": "CC-1"}


def test_csv_follows_the_spec_column_rules(led):
    """The FOCUS 1.2 rules the file can break, checked here whatever the validator's
    availability: columns present, mandatory values non-null, enums, decimals without
    exponents, UTC datetimes, ISO 4217 currency, Tags a JSON object, x_ custom columns."""
    text = focus.to_csv(focus.rows(led, T0, END, tagged("idle"), SRC))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows and list(rows[0]) == list(focus.COLUMNS)
    not_null = ["BilledCost", "BillingAccountId", "BillingCurrency", "BillingPeriodEnd",
                "BillingPeriodStart", "ChargeCategory", "ChargeDescription", "ChargeFrequency",
                "ChargePeriodEnd", "ChargePeriodStart", "ContractedCost", "EffectiveCost",
                "InvoiceIssuerName", "ListCost", "ProviderName", "PublisherName",
                "ServiceCategory", "ServiceName", "SubAccountId", "ConsumedQuantity",
                "PricingQuantity", "PricingUnit", "ResourceId", "RegionId"]
    decimal = re.compile(r"^-?\d+(\.\d+)?$")
    when = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
    for r in rows:
        assert all(r[c] != "" for c in not_null), r
        for c in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "ListUnitPrice",
                  "ContractedUnitPrice", "ConsumedQuantity", "PricingQuantity"):
            assert decimal.match(r[c]), (c, r[c])
        for c in ("BillingPeriodStart", "BillingPeriodEnd", "ChargePeriodStart", "ChargePeriodEnd"):
            assert when.match(r[c]), (c, r[c])
        assert r["ChargeCategory"] in ("Usage", "Purchase", "Tax", "Credit", "Adjustment")
        assert r["ChargeFrequency"] in ("One-Time", "Recurring", "Usage-Based")
        assert r["ChargeClass"] in ("", "Correction")
        assert r["PricingCategory"] in ("Standard", "Dynamic", "Committed", "Other")
        assert r["CapacityReservationStatus"] in ("used", "unused")
        assert re.fullmatch(r"[A-Z]{3}", r["BillingCurrency"])
        assert isinstance(json.loads(r["Tags"]), dict)
        assert r["ProviderName"] == r["InvoiceIssuerName"]     # no third party: BilledCost stands
        assert r["x_Simulated"] in ("true", "false")
    assert all(c[0].isupper() or c.startswith("x_") for c in focus.COLUMNS)


# ---- tags on API keys --------------------------------------------------------------

D1, D2, D3 = (hashlib.sha256(k.encode()).hexdigest() for k in ("k1", "k2", "k3"))


def test_keys_carry_tags_and_old_configs_stay_valid():
    old = config.parse(f'[auth.keys]\n"{D1}" = "search"\n')
    assert old.auth.keys == {D1: "search"} and old.auth.tenant_tags == {}
    cfg = config.parse(f'[auth.keys]\n"{D1}" = {{ tenant = "search", team = "core", '
                       f'cost_center = "CC-7" }}\n"{D2}" = "search"\n'
                       f'"{D3}" = {{ tenant = "ads", project = "bids" }}\n')
    assert cfg.auth.keys == {D1: "search", D2: "search", D3: "ads"}
    assert cfg.auth.tenant_tags == {"search": {"team": "core", "cost_center": "CC-7"},
                                    "ads": {"project": "bids"}}
    bad = [(f'"{D1}" = {{ tenant = "a", team = "x" }}\n"{D2}" = {{ tenant = "a", team = "y" }}',
            "tags belong to the tenant"),
           (f'"{D1}" = {{ tenant = "a", colour = "x" }}', "unknown key auth.keys"),
           (f'"{D1}" = {{ team = "x" }}', "must name a tenant"),
           (f'"{D1}" = {{ tenant = "a", team = 3 }}', "must be a non-empty string")]
    for body, why in bad:
        with pytest.raises(config.ConfigError) as e:
            config.parse(f"[auth.keys]\n{body}\n")
        assert why in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(config.ConfigError, match="unknown key auth.tenant_tags"):
        config.parse('[auth.tenant_tags]\na = { team = "x" }\n')


def test_group_by_tag_folds_tenants_and_keeps_the_allocation(led):
    m = tagged("share")
    by_tenant = reports.usage(led, ["tenant"], T0, END, method=m)
    by_team = reports.usage(led, ["tag:team"], T0, END, method=m)
    total = sum(r["cost_allocation"] for r in by_tenant["rows"])
    assert sum(r["cost_allocation"] for r in by_team["rows"]) == pytest.approx(total, rel=1e-9)
    cost = {r["tag:team"]: r["cost_allocation"] for r in by_team["rows"]}
    tenant = {r["tenant"]: r["cost_allocation"] for r in by_tenant["rows"]}
    assert cost["search"] == pytest.approx(tenant["ta"] + tenant["tb"], rel=1e-9)
    assert cost["ads"] == pytest.approx(tenant["tc"], rel=1e-9)
    # an untagged tenant falls in the null group; the CSV gains the tag column
    m.tenant_tags = {"ta": {"team": "search"}}
    rep = reports.usage(led, ["tag:team", "phase"], T0, END, method=m)
    assert {(r["tag:team"], r["phase"]) for r in rep["rows"]} == {
        ("search", "prefill"), ("search", "decode"), (None, "prefill"), (None, "decode")}
    head = reports.usage_csv(rep).splitlines()[0]
    assert head.startswith("tenant,model,phase,site,tag:team,requests")
    carbon = reports.carbon(led, ["tag:team"], T0, END, method=tagged("share"))
    assert {r["tag:team"] for r in carbon["rows"]} == {"search", "ads"}
    assert sum(r["co2e_grams"] for r in carbon["rows"]) == pytest.approx(
        carbon["totals"]["co2e_grams"], rel=0.005)
    with pytest.raises(ValueError, match="tag:team"):
        reports.parse_group_by("tag:colour", reports.USAGE_DIMS, ())
