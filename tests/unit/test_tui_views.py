"""The console's view models, no UI and no network: any JSON reads without raising,
ratios and busy fractions derived when the daemon has none, tenants folded and sorted,
carbon provenance, the fleet's ratio of sums, and where `applianced tui` finds its URLs.
(The app itself, on a loopback fixture server: tests/integration/test_tui.py.)"""
from __future__ import annotations

import pytest

from helpers.admin_fixture import contract_status, usage_rows

pytest.importorskip("textual")
from appliance.tui.views.carbon import carbon_from_json  # noqa: E402
from appliance.tui.views.fleet import fleet_ratio  # noqa: E402
from appliance.tui.views.overview import (History, overview_from_status,  # noqa: E402
                                          rates_line, render_overview_text)
from appliance.tui.views.tenants import (filter_tenants, merge_tenants,  # noqa: E402
                                         sort_tenants, tenants_from_usage)

# What main's daemon answers today: no live keys at all.
MAIN_STATUS = {
    "version": "0.1.0", "simulated": True, "engine": "sim", "model": "m", "mode": "disagg",
    "uptime_s": 5.0, "ready": True, "draining": False, "inflight": 0,
    "devices": [{"id": f"sim{i}", "name": "H100-SXM", "kind": "sim", "simulated": True,
                 "memory_bytes": 85899345920} for i in range(4)],
    "plan": {"mode": "disagg", "prefill": [{"worker": "prefill0", "devices": ["sim0"]},
                                           {"worker": "prefill1", "devices": ["sim1"]}],
             "decode": [{"worker": "decode0", "devices": ["sim2", "sim3"]}]},
    "workers": [{"worker": "prefill0", "role": "prefill", "state": "ready", "restarts": 0,
                 "devices": ["sim0"], "busy_s": 1.0, "waiting": 2, "running": 1},
                {"worker": "prefill1", "role": "prefill", "state": "restarting", "restarts": 3,
                 "devices": ["sim1"], "busy_s": 1.0, "waiting": 0, "running": 0},
                {"worker": "decode0", "role": "decode", "state": "ready", "restarts": 0,
                 "devices": ["sim2", "sim3"], "busy_s": 4.0, "waiting": 0, "running": 5}],
}


# ---------------------------------------------------------------- the model, no UI

def test_main_status_groups_devices_from_the_plan_and_leaves_live_figures_na():
    ov = overview_from_status(MAIN_STATUS)
    assert [(g.name, [d.id for d in g.devices]) for g in ov.groups] == \
        [("prefill", ["sim0", "sim1"]), ("decode", ["sim2", "sim3"])]
    assert ov.group("prefill").waiting == 2 and ov.group("decode").running == 5
    assert ov.ratio_gpu is None and ov.group("prefill").busy is None and ov.simulated
    assert [w.state for w in ov.workers] == ["up", "restarting", "up"]
    text = render_overview_text(ov)
    assert "GPU-s n/a" in text and "restarts 3" in text and "(prefill1 restarting)" in text


def test_requests_held_at_the_router_show_beside_those_in_flight():
    held = {**MAIN_STATUS, "inflight": 9, "decode_admission": {"waiting": 3, "counted": 6}}
    ov = overview_from_status(held)
    assert rates_line(ov).endswith("  3 held at the router")
    assert "3 held at the router" in render_overview_text(ov)
    for quiet in (MAIN_STATUS, {**held, "decode_admission": {"waiting": 0}},
                  {**held, "decode_admission": "x"}):
        assert "held at the router" not in render_overview_text(overview_from_status(quiet))


@pytest.mark.parametrize("junk", [
    {}, {"devices": "x", "plan": 5, "workers": [1, None, "w"], "ratio": "bad", "groups": []},
    {"devices": [{"id": 3, "util": "high", "busy_fraction": {"10s": None}, "power_w": float("nan")}],
     "ratio": {"gpu_seconds": True, "history": [[1, 2, 3], "x", [0, None]]}, "latency": 7,
     "groups": {"prefill": {"queue": "full", "tokens_per_s": {"10s": "many"}}}},
])
def test_any_json_reads_without_raising(junk):
    ov = overview_from_status(junk)
    render_overview_text(ov)
    assert ov.ratio_gpu is None and ov.ttft_p50 is None


def test_ratio_and_busy_derived_from_worker_busy_time_when_the_daemon_has_none():
    h = History()
    first = {**MAIN_STATUS}
    later = {**MAIN_STATUS, "workers": [
        {**MAIN_STATUS["workers"][0], "busy_s": 1.0 + 3.0},    # prefill0 busy 3 of 10 s
        {**MAIN_STATUS["workers"][1], "busy_s": 1.0 + 1.0},    # prefill1 busy 1 of 10 s
        {**MAIN_STATUS["workers"][2], "busy_s": 4.0 + 5.0}]}   # decode0 (2 devices) 5 of 10 s
    h.observe(first, 100.0)
    h.observe(later, 110.0)
    ov = overview_from_status(later, h)
    assert ov.ratio_gpu == pytest.approx((3 + 1) / (5 * 2))
    assert [d.busy for d in ov.devices] == pytest.approx([0.3, 0.1, 0.5, 0.5])
    assert ov.group("prefill").busy == pytest.approx(0.2)
    assert "derived" in ov.ratio_window
    # a daemon that reports the ratio is believed, not second-guessed
    assert overview_from_status({**later, "ratio": {"gpu_seconds": 7.0}}, h).ratio_gpu == 7.0


def test_tenants_fold_phases_share_sort_and_filter():
    usage = usage_rows({"a": (50.0, 2.0), "b": (4.0, 18.0), "c": (0.0, 0.0)}, {})
    usage["budgets"] = {"b": {"gpu_hours": 0.85, "usd": 0.2}}
    rows = tenants_from_usage(usage)
    assert [r.tenant for r in rows] == ["a", "b", "c"]
    a, b = rows[0], rows[1]
    assert (a.gpu_seconds, a.prefill_gpu_seconds, a.decode_gpu_seconds) == (52.0, 50.0, 2.0)
    assert a.share == pytest.approx(52 / 74) and b.budget_used == 0.85 and a.budget_used is None
    assert a.kwh == pytest.approx(52 * 500 / 3.6e6) and a.simulated and not a.measured
    assert [r.tenant for r in sort_tenants(rows, "gpu_seconds", False)] == ["c", "b", "a"]
    assert [r.tenant for r in sort_tenants(rows, "budget_used")] == ["b", "a", "c"]  # n/a last
    assert [r.tenant for r in filter_tenants(rows, "B")] == ["b"]
    fleet = merge_tenants([rows, tenants_from_usage(usage_rows({"b": (40.0, 0.0)}, {}))])
    assert [(r.tenant, r.gpu_seconds) for r in fleet] == [("b", 62.0), ("a", 52.0), ("c", 0.0)]


def test_tenant_lines_by_a_key_tag():
    """`g` on the Tenants screen: lines by team (group_by=tag:team,phase), tenants without
    the tag as (untagged), the (idle) row apart, budgets (the tenants') not shown."""
    usage = usage_rows({"a": (50.0, 2.0), "b": (4.0, 18.0), "c": (1.0, 1.0)}, {})
    team = {"a": "search", "b": "search"}
    for r in usage["rows"]:
        r["tag:team"] = team.get(r["tenant"])
    usage["rows"].append({"tenant": "(idle)", "tag:team": None, "phase": None,
                          "gpu_seconds": 10.0, "cost_allocation": 0.01})
    usage["budgets"] = {"search": {"gpu_hours": 0.9}}
    rows = tenants_from_usage(usage, "tag:team")
    assert [(r.tenant, r.gpu_seconds) for r in rows] == [
        ("search", 74.0), ("(idle)", 10.0), ("(untagged)", 2.0)]
    assert rows[0].prefill_gpu_seconds == 54.0 and rows[0].budget_used is None


def test_carbon_rows_keep_provenance():
    rows = carbon_from_json({"rows": [
        {"site": "lyon", "tenant": "a", "intensity_g_per_kwh": 56.0, "co2e_grams": 2000.0,
         "provenance": {"source": "electricitymaps", "kind": "marginal", "estimated": True},
         "sci_per_1k_tokens": 0.4},
        {"site": "lyon", "tenant": "b", "intensity": 56.0, "provenance": "static, average"}]})
    assert [(r.tenant, r.provenance, r.estimated) for r in rows] == [
        ("a", "electricitymaps, marginal, estimated", True), ("b", "static, average", False)]
    assert rows[0].kg_co2e == 2.0 and rows[0].sci_per_1k_tokens == 0.4 and rows[1].intensity == 56


def test_fleet_ratio_is_a_ratio_of_sums_not_a_mean_of_ratios():
    big, small = contract_status(0.9, 0.3), contract_status(0.1, 0.9)
    small["groups"]["prefill"]["gpu_seconds"]["10s"] = 1.0
    small["groups"]["decode"]["gpu_seconds"]["10s"] = 100.0
    pairs = [(overview_from_status(s), s) for s in (big, small)]
    want = (36.0 + 1.0) / (12.0 + 100.0)
    assert fleet_ratio(pairs) == pytest.approx(want)
    assert fleet_ratio([(None, {})]) is None


# ---------------------------------------------------------------- command line

def test_urls_from_the_flag_then_the_config_then_the_local_daemon(tmp_path, capsys):
    from appliance.cli import main
    from appliance.commands.tui import resolve_urls
    from appliance.config import ConfigError
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tui]\nurls = ["http://gpu-a:8000/", "http://gpu-b:8000"]\n')
    assert resolve_urls(None, str(cfg)) == ["http://gpu-a:8000", "http://gpu-b:8000"]
    assert resolve_urls(["http://x:1", "http://x:1/"], str(cfg)) == ["http://x:1"]
    empty = tmp_path / "e.toml"
    empty.write_text("")
    assert resolve_urls(None, str(empty)) == ["http://127.0.0.1:8000"]
    cfg.write_text('[tui]\nurls = ["gpu-a:8000"]\n')
    with pytest.raises(ConfigError, match="tui.urls: 'gpu-a:8000' is not an http"):
        resolve_urls(None, str(cfg))
    assert main(["tui", "--url", "gpu-a"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected http://host:port" in err
