"""`applianced plan --url A --url B ...`: each appliance's plan, added up per site and
for the fleet, on two real simulated daemons at two sites on loopback (plus one URL
where nothing listens); and the sums themselves on plans relabelled to one site."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from appliance.planner.fleet import add_up, appliance_row, fleet_plan
from helpers.daemons import ROOT, free_port, http
from test_planner_autoapply import seed_trends

MODEL = "llama-3.1-8b"
SITE = "[site]\nname = \"{name}\"\nappliance = \"{appliance}\"\n"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "plan", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.fixture
def two_sites(daemon_factory, tiny_model, tmp_path):
    # berlin: 4 GPUs with a quarter hour of prefill-heavy history; paris: 2 GPUs, idle.
    seed_trends(tmp_path / "d0" / "state", model=MODEL, devices=4)
    berlin = daemon_factory("--devices", "sim:4xH100", "--model-spec", MODEL, "--sim-speed", "50",
                            model=tiny_model, config=SITE.format(name="berlin", appliance="ber-1"))
    paris = daemon_factory("--devices", "sim:2xH100", "--model-spec", MODEL, "--sim-speed", "50",
                           model=tiny_model, config=SITE.format(name="paris", appliance="par-1"))
    return berlin, paris


def test_fleet_plan_per_site_and_total(two_sites):
    berlin, paris = two_sites
    dead = f"http://127.0.0.1:{free_port()}"
    plans = {}
    for d in (berlin, paris):
        code, _, plans[d.url] = http("GET", d.url + "/admin/v1/plan")
        assert code == 200
    assert plans[berlin.url]["site"] == {"name": "berlin", "appliance": "ber-1"}
    assert plans[berlin.url]["rho"]["now"] > 1 and plans[paris.url]["rho"]["now"] is None

    done = _cli("--url", berlin.url, "--url", paris.url, "--url", dead, "--json")
    assert done.returncode == 0, done.stderr
    f = json.loads(done.stdout)
    assert f["simulated"] is True
    assert [r["appliance"] for r in f["appliances"]] == ["ber-1", "par-1"]
    assert set(f["sites"]) == {"berlin", "paris"}
    b, p, total = f["sites"]["berlin"], f["sites"]["paris"], f["fleet"]
    row = f["appliances"][0]          # berlin's plan as the CLI fetched it (the clock moved)
    assert b["current"] == {"prefill": 2, "decode": 2} and p["current"] == {"prefill": 1, "decode": 1}
    rec = plans[berlin.url]["recommended"]
    assert row["split"]["recommended"] == rec["split"]
    assert b["recommended"] == row["recommended"] == {"prefill": rec["prefill"]["gpus"],
                                                      "decode": rec["decode"]["gpus"]}
    assert b["recommended"]["prefill"] > b["current"]["prefill"]      # prefill-heavy: moves
    assert b["changes"] == 1 and p["changes"] == 0
    for key in ("current", "recommended", "at_peak"):
        assert total[key] == {ph: b[key][ph] + p[key][ph] for ph in ("prefill", "decode")}
    assert b["rho"]["now"] == pytest.approx(row["rho"]["now"])
    assert b["rho"]["now"] == pytest.approx(plans[berlin.url]["rho"]["now"], rel=0.05)
    assert p["rho"]["now"] is None and total["rho"]["now"] == pytest.approx(b["rho"]["now"])
    assert b["bottleneck"] == "prefill" and p["bottleneck"] == "none"
    assert total["appliances"] == 2 and b["members"] == ["ber-1"]
    assert [u["url"] for u in f["unreachable"]] == [dead]
    assert f["unreachable"][0]["error"].startswith(f"no daemon at {dead} (")

    text = _cli("--url", berlin.url, "--url", paris.url, "--url", dead)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "fleet capacity plan [SIMULATED]: 2 appliances at 2 sites" in out
    assert "site berlin (1)" in out and "site paris (1)" in out and "fleet (2)" in out
    assert f"note: {dead} left out: no daemon at {dead}" in out
    assert "Traceback" not in text.stderr

    nobody = _cli("--url", dead, "--url", f"http://127.0.0.1:{free_port()}")
    assert nobody.returncode == 1 and nobody.stderr.strip() == "applianced: no appliance answered"
    assert nobody.stdout.count("left out") == 2 and "Traceback" not in nobody.stderr
    bad = _cli("--url", berlin.url, "--url", "ftp://x")
    assert bad.returncode == 1 and "expected http://" in bad.stderr
    one = _cli("--url", berlin.url)                      # one appliance: its own plan
    assert one.returncode == 0 and "capacity plan for llama-3.1-8b [SIMULATED]" in one.stdout
    assert "burstiness: c_a²" in one.stdout

    # Two appliances of one site add up: relabel paris's plan as berlin's.
    same = {**plans[paris.url], "site": {"name": "berlin", "appliance": "ber-2"}}
    merged = fleet_plan([(berlin.url, plans[berlin.url], None), ("x", same, None)])
    assert list(merged["sites"]) == ["berlin"]
    site = merged["sites"]["berlin"]
    assert site["appliances"] == 2 and site["members"] == ["ber-1", "ber-2"]
    assert site["current"] == {"prefill": 3, "decode": 3}
    rows = [appliance_row(berlin.url, plans[berlin.url]), appliance_row("x", same)]
    want_rho = (sum(r["demand"]["now"]["prefill"] for r in rows)
                / sum(r["demand"]["now"]["decode"] for r in rows))
    assert site["rho"]["now"] == pytest.approx(want_rho)
    assert add_up(rows)["needed"]["prefill"] == pytest.approx(
        sum(r["needed"]["prefill"] for r in rows), abs=1e-3)
