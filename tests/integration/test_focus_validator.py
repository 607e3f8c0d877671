"""FOCUS export checked from outside: the FinOps Foundation's own validator passes an
export (and fails a broken file), and FOCUS and key tags through a real daemon's API and
the CLI. The ledger is the allocation tests' scene (helpers/ledger_scene.py)."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from appliance.accounting import focus
from helpers.daemons import ROOT
from helpers.ledger_scene import T0, ledger_with, method

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


@pytest.fixture(scope="module")
def led(tmp_path_factory):
    ledger = ledger_with(tmp_path_factory.mktemp("focus"), RUNS, end=END)
    yield ledger
    ledger.stop()


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
