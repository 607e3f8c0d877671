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
import os
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from appliance import config
from appliance.accounting import focus, reports
from conftest import ROOT
from test_allocation import T0, capacity_of, ledger_with, method

SRC = focus.Source("app1", "8xH100-SXM", "s1", "DE")
TAGS = {"ta": {"team": "search", "cost_center": "CC-1"}, "tb": {"team": "search"},
        "tc": {"team": "ads", "project": "bids"}}
# requests in three UTC hours, hours with none between them (T0 is 22:13:20 UTC)
RUNS = [("R0", "ta", T0 + 1, 1.0, 2.0), ("R1", "tb", T0 + 30, 0.5, 3.0),
        ("R2", "tc", T0 + 500, 2.0, 1.0), ("R3", "ta", T0 + 2700, 1.0, 1.0),
        ("R4", "tc", T0 + 9000, 0.3, 0.7)]
END = T0 + 9100
VALIDATOR = Path(os.environ.get("FOCUS_VALIDATOR", ROOT / ".venv-focus" / "bin" / "focus-validator"))


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


@pytest.mark.skipif(not VALIDATOR.exists(), reason="the FinOps Foundation's focus-validator is "
                    "not installed (make .venv-focus: it needs Python >= 3.12)")
@pytest.mark.parametrize("policy", ["share", "idle"])
def test_the_finops_foundations_validator_passes_an_export(led, tmp_path, policy):
    path = tmp_path / "focus.csv"
    path.write_text(focus.to_csv(focus.rows(led, T0, END, tagged(policy), SRC)))
    out = run_validator(path)
    assert_valid(out)


def run_validator(path: Path) -> str:
    """The validator reads its rule data relative to its package (run it from there),
    offline (`--block-download`: the 1.2 model ships with it)."""
    site = next((VALIDATOR.parent.parent / "lib").glob("python3*/site-packages"))
    res = subprocess.run([str(VALIDATOR), "--data-file", str(path), "--validate-version",
                          focus.FOCUS_VERSION, "--block-download", "--show-violations"],
                         cwd=site, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def assert_valid(out: str) -> None:
    """Both dataset rules pass, and every rule marked failed is the untaken branch of an
    OR that passed (1.2's InvoiceId must be null *or* not null; the validator evaluates
    both branches and reports the one not taken)."""
    for rule in ("CostAndUsage-D-001-M", "CostAndUsage-D-002-M"):
        assert re.search(rf"{rule}: .*AND passed - all child rules succeeded", out), out[-4000:]
    model = json.loads(next((VALIDATOR.parent.parent / "lib").glob(
        "python3*/site-packages/focus_validator/rules/model-1.2*.json")).read_text())["ModelRules"]
    failed = set(re.findall(r"❌ (\S+): FAIL", out))
    passed = set(re.findall(r"✅ (\S+): PASS", out))
    assert re.search(r"Pass: [1-9]\d+", out)
    for rule in failed:
        ors = [k for k, v in model.items() if k in passed
               and v["ValidationCriteria"]["Requirement"].get("CheckFunction") == "OR"
               and any(i.get("ModelRuleId") == rule
                       for i in v["ValidationCriteria"]["Requirement"].get("Items", []))]
        assert ors, f"{rule} failed outside a passing OR:\n{out[-4000:]}"


def test_the_validator_check_catches_a_broken_file(led, tmp_path):
    """The check above can fail: a file whose BilledCost is empty is refused."""
    if not VALIDATOR.exists():
        pytest.skip("focus-validator not installed")
    rows = focus.rows(led, T0, END, tagged("idle"), SRC)
    for r in rows:
        r["BilledCost"] = None
    path = tmp_path / "broken.csv"
    path.write_text(focus.to_csv(rows))
    with pytest.raises(AssertionError):
        assert_valid(run_validator(path))


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


# ---- through the daemon ------------------------------------------------------------

def test_focus_and_tags_through_the_api_and_the_cli(daemon_factory, tmp_path):
    from test_chargeback import cli, get, run_two_tenants, settled_usage
    from test_chargeback import KEY_A, KEY_B, _digest
    cfg = f"""
[accounting]
window_s = 1.0
flush_interval_s = 0.2
idle_policy = "idle"

[auth.keys]
"{_digest(KEY_A)}" = {{ tenant = "a", team = "search", cost_center = "CC-1" }}
"{_digest(KEY_B)}" = {{ tenant = "b", team = "search", project = "p2" }}
"""
    d = daemon_factory("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8",
                       "--sim-speed", "10", model=None, config=cfg)
    run_two_tenants(d, "llama-3.1-70b-fp8", prompt_len=200, n=2)
    body = settled_usage(d, 4, group_by="tag:team,tenant")
    assert {(r["tag:team"], r["tenant"]) for r in body["rows"]} >= {("search", "a"), ("search", "b")}
    code, _, team = get(d, "/admin/v1/usage", group_by="tag:team", since="1h")
    assert code == 200 and {r["tag:team"] for r in team["rows"]} == {"search", None}  # None: (idle)
    # one fixed, closed window for both (a window closing between two requests would
    # add its capacity to the second one only)
    until = int(time.time()) - 2
    span = {"since": str(until - 3600), "until": str(until)}
    code, _, raw = get(d, "/admin/v1/usage", format="focus", **span)
    assert code == 200, raw
    rows = list(csv.DictReader(io.StringIO(raw.decode() if isinstance(raw, bytes) else raw)))
    code, _, whole = get(d, "/admin/v1/usage", group_by="tenant,model,phase,site", **span)
    assert sum(float(r["EffectiveCost"]) for r in rows) == pytest.approx(
        sum(r["cost_allocation"] for r in whole["rows"]), rel=0.005)
    assert sum(float(r["EffectiveCost"]) for r in rows) == pytest.approx(
        whole["totals"]["capacity_cost"], rel=0.005)
    tags = {r["SubAccountId"]: json.loads(r["Tags"]) for r in rows}
    assert tags["a"]["team"] == "search" and tags["a"]["cost_center"] == "CC-1"
    assert tags["b"]["project"] == "p2" and "team" in tags["b"]
    assert {r["CapacityReservationStatus"] for r in rows} == {"used", "unused"}
    assert all(r["ResourceId"].endswith("/8xH100-SXM") and r["x_Simulated"] == "true"
               for r in rows)
    # a tenant key may not export everybody; a bad group is a 400
    code, _, err = get(d, "/admin/v1/usage", KEY_A, format="focus")
    assert code == 403 and err["error"]["code"] == "forbidden"
    code, _, err = get(d, "/admin/v1/usage", group_by="tag:colour")
    assert code == 400 and err["error"]["param"] == "group_by"
    code, _, carbon = get(d, "/admin/v1/carbon", group_by="tag:team", since="1h")
    assert code == 200 and "search" in {r["tag:team"] for r in carbon["rows"]}
    out = cli("usage", "--url", d.url, "--focus", "--since", "1h")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split(",") == list(focus.COLUMNS)
    out = cli("usage", "--url", d.url, "--by", "tag:team", "--since", "1h")
    assert out.returncode == 0 and "search" in out.stdout, out.stderr
    if VALIDATOR.exists():
        path = tmp_path / "export.csv"
        path.write_text(raw.decode() if isinstance(raw, bytes) else raw)
        assert_valid(run_validator(path))
