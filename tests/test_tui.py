"""The console's own behaviour: reading any JSON without crashing, the feed's fallback
from the stream to polling, the redraw limit, pause, screens, keys, the fleet, and the
layout pinned in text snapshots. Daemon side: `FixtureAdmin`, a real aiohttp server on
loopback speaking the admin API contract."""
from __future__ import annotations

import asyncio
import os
import urllib.parse
from pathlib import Path

import pytest

from admin_fixture import (FixtureAdmin, contract_status, section, usage_rows, wait_screen,
                           wait_until)
from conftest import free_port

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402
from appliance.tui.format import fmt_ratio  # noqa: E402
from appliance.tui.views.carbon import carbon_from_json  # noqa: E402
from appliance.tui.views.fleet import fleet_ratio  # noqa: E402
from appliance.tui.views.overview import (History, overview_from_status,  # noqa: E402
                                          render_overview_text)
from appliance.tui.views.tenants import (filter_tenants, merge_tenants,  # noqa: E402
                                         sort_tenants, tenants_from_usage)

SNAPSHOTS = Path(__file__).parent / "snapshots"

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


# ---------------------------------------------------------------- the app, on a fixture server

def run(scenario):
    return asyncio.run(scenario())


def test_streams_when_it_can_and_polls_when_there_is_no_stream():
    for stream, word, path in ((True, "streaming", "/admin/v1/stream"),
                               (False, "polling", "/admin/v1/status")):
        with FixtureAdmin(contract_status(0.9, 0.5), stream=stream) as srv:
            async def scenario():
                app = ApplianceConsole([srv.url], poll_interval=0.2)
                async with app.run_test(size=(80, 24)) as pilot:
                    await wait_screen(app, pilot, lambda t: f"· {word}" in t and "1.80:1" in t,
                                      what=word)
                    await pilot.pause(0.6)
            run(scenario)
            assert srv.requests[0] == "/admin/v1/stream"
            assert srv.requests.count(path) >= (1 if stream else 2), srv.requests


def test_redraws_at_most_four_times_a_second_however_fast_the_stream():
    with FixtureAdmin(contract_status(0.9, 0.5), sse_interval=0.01) as srv:
        async def scenario():
            app = ApplianceConsole([srv.url])
            flushes = []
            async with app.run_test(size=(80, 24)) as pilot:
                await wait_screen(app, pilot, lambda t: "streaming" in t, what="the stream")
                n_snapshots = [0]
                original = app._on_snapshot

                def counting(url, status):
                    n_snapshots[0] += 1
                    # a different snapshot each time, so every one is worth a redraw
                    status["uptime_s"] = n_snapshots[0]
                    original(url, status)
                app.feeds[srv.url].on_snapshot = counting
                app.watch(app, "appliances", lambda _: flushes.append(1), init=False)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await pilot.pause(2.0)
                elapsed = loop.time() - t0
            return n_snapshots[0], len(flushes), elapsed
        snapshots, flushes, elapsed = run(scenario)
    assert snapshots > 4 * elapsed + 4, (snapshots, elapsed)     # the stream outran the limit
    assert 1 <= flushes <= 4 * elapsed + 2, (flushes, elapsed)


def test_pause_freezes_the_figures_and_unpause_catches_up():
    with FixtureAdmin(contract_status(0.9, 0.5)) as srv:
        async def scenario():
            app = ApplianceConsole([srv.url])
            async with app.run_test(size=(80, 24)) as pilot:
                await wait_screen(app, pilot, lambda t: "1.80:1" in t, what="first ratio")
                await pilot.press("p")
                await wait_screen(app, pilot, lambda t: "PAUSED" in t, what="PAUSED")
                srv.set(status=contract_status(0.2, 0.8))
                await pilot.pause(1.5)
                assert "1.80:1" in app.screen_text()
                await pilot.press("p")
                text = await wait_screen(app, pilot, lambda t: "0.25:1" in t, what="new ratio")
                assert "PAUSED" not in text
        run(scenario)


def test_garbage_from_the_daemon_shows_na_and_recovers():
    with FixtureAdmin(contract_status(0.9, 0.5)) as srv:
        async def scenario():
            app = ApplianceConsole([srv.url])
            async with app.run_test(size=(80, 24)) as pilot:
                await wait_screen(app, pilot, lambda t: "1.80:1" in t, what="first ratio")
                srv.set(status={"devices": [{"id": "sim0", "util": "x"}], "ratio": [],
                                "groups": {"decode": 3}, "workers": "none", "mode": "disagg"})
                text = await wait_screen(app, pilot, lambda t: "sim1" not in t and "sim0" in t,
                                         what="the junk snapshot")
                assert "n/a" in text and "Traceback" not in text and "error" not in text
                srv.set(status=contract_status(0.2, 0.8))
                await wait_screen(app, pilot, lambda t: "0.25:1" in t and "sim7" in t,
                                  what="recovery")
        run(scenario)


def test_unreachable_at_start_then_reachable_on_the_same_port():
    port = free_port()
    srv = FixtureAdmin(contract_status(0.9, 0.5))
    srv.port = port

    async def scenario():
        app = ApplianceConsole([f"http://127.0.0.1:{port}"], backoff=(0.1, 0.5))
        async with app.run_test(size=(80, 24)) as pilot:
            text = await wait_screen(app, pilot, lambda t: "unreachable" in t, what="banner")
            assert "Traceback" not in text
            await asyncio.to_thread(srv.start)
            await wait_screen(app, pilot, lambda t: "unreachable" not in t and "1.80:1" in t,
                              what="the banner to go")
            await asyncio.to_thread(srv.stop)
            await wait_screen(app, pilot, lambda t: "unreachable" in t, what="banner again")
            assert app.is_running
    try:
        run(scenario)
    finally:
        srv.stop()


def test_a_refused_key_is_a_banner_and_the_right_key_is_sent():
    with FixtureAdmin(contract_status(0.9, 0.5), admin_key="sk-admin") as srv:
        async def scenario(key):
            app = ApplianceConsole([srv.url], key, backoff=(0.1, 0.5))
            async with app.run_test(size=(80, 24)) as pilot:
                return await wait_screen(app, pilot, lambda t: "refused" in t or "sim7" in t,
                                         what="an answer")
        text = run(lambda: scenario("wrong"))
        assert "refused the console: HTTP 403: an admin key is required" in text
        text = run(lambda: scenario("sk-admin"))
        assert "refused" not in text and "1.80:1" in text


def test_screens_keys_and_not_available_yet():
    with FixtureAdmin(contract_status(0.9, 0.5)) as srv:
        srv.set(carbon={"rows": [{"site": "local", "tenant": "batch-etl",
                                  "intensity_g_per_kwh": 412.0, "co2e_grams": 3200.0,
                                  "provenance": {"source": "csv", "kind": "average",
                                                 "estimated": True},
                                  "sci_per_1k_tokens": 0.11}]},
                usage=usage_rows({"batch-etl": (50.0, 2.0)}, {}))

        async def scenario():
            app = ApplianceConsole([srv.url])
            async with app.run_test(size=(80, 24)) as pilot:
                await wait_screen(app, pilot, lambda t: "sim7" in t, what="overview")
                await pilot.press("3")
                text = await wait_screen(app, pilot, lambda t: "batch-etl" in t, what="carbon")
                row = next(ln for ln in text.splitlines() if "batch-etl" in ln)
                assert "412" in row and "3.200" in row and "0.11" in row and "csv" in row
                assert "ESTIMATED" in text.splitlines()[0]
                for key, path in (("4", "/admin/v1/plan"), ("5", "/admin/v1/workflows")):
                    await pilot.press(key)
                    await wait_screen(app, pilot, lambda t: f"not available yet (this daemon "
                                      f"has no {path})" in t, what=path)
                srv.set(plan={"recommended": {"split": "3+5", "prefill": {"gpus": 3}}})
                await pilot.press("4")
                await pilot.press("r")
                text = await wait_screen(app, pilot, lambda t: "3+5" in t, what="the plan")
                assert any(ln.split() == ["P+D", "n/a", "3+5", "n/a"] for ln in text.splitlines())
                assert any(ln.split()[:4] == ["prefill", "GPUs", "n/a", "3"]
                           for ln in text.splitlines())
                await pilot.press("2")
                await wait_screen(app, pilot, lambda t: "batch-etl" in t, what="tenants")
                await pilot.press("t")
                await wait_screen(app, pilot, lambda t: "period 7d" in t, what="period 7d")
                assert wait_until(lambda: any("since=7d" in r for r in srv.requests), 5)
                await pilot.press("g")          # by the tenants' key tag "team"
                await wait_screen(app, pilot, lambda t: "by tag:team" in t, what="by team")
                assert wait_until(lambda: any("group_by=tag:team,phase" in urllib.parse.unquote(r)
                                              for r in srv.requests), 5)
                await pilot.press("question_mark")
                text = await wait_screen(app, pilot, lambda t: "keys" in t and "q quit" in t,
                                         what="help")
                await pilot.press("escape")
                await wait_screen(app, pilot, lambda t: "q quit" not in t, what="help closed")
                await pilot.press("q")
                await pilot.pause()
                assert not app.is_running
            return app.return_code
        assert run(scenario) == 0


def test_fleet_sums_the_ratio_lists_sites_and_merges_tenants():
    a_status, b_status = contract_status(0.9, 0.5), contract_status(0.2, 0.8, site="paris",
                                                                   appliance="box2")
    with FixtureAdmin(a_status) as a, FixtureAdmin(b_status) as b:
        a.set(usage=usage_rows({"batch-etl": (50.0, 2.0), "chat-bot": (4.0, 18.0)}, {}))
        b.set(usage=usage_rows({"chat-bot": (10.0, 30.0), "search": (1.0, 1.0)}, {}))
        pre = sum(s["groups"]["prefill"]["gpu_seconds"]["10s"] for s in (a_status, b_status))
        dec = sum(s["groups"]["decode"]["gpu_seconds"]["10s"] for s in (a_status, b_status))

        async def scenario():
            app = ApplianceConsole([a.url, b.url], backoff=(0.1, 0.5))
            async with app.run_test(size=(100, 30)) as pilot:
                await pilot.press("6")
                # both boxes' usage in: each box's tenants answer on their own schedule
                text = await wait_screen(
                    app, pilot, lambda t: all(w in t for w in ("search", "batch-etl", "paris")),
                    what="the fleet")
                assert f"FLEET PREFILL:DECODE {fmt_ratio(pre / dec)}" in text
                assert "2/2 appliances reachable" in text
                tenants = section(text, "tenant", "q Quit")
                assert [ln.split()[0] for ln in tenants[1:] if ln.strip()] == \
                    ["chat-bot", "batch-etl", "search"]
                sites = [ln.split()[0] for ln in section(text, "site", "top tenants")[1:]
                         if ln.strip()]
                assert sites == ["local", "paris"]
                await asyncio.to_thread(b.stop)
                text = await wait_screen(app, pilot, lambda t: "unreachable" in t,
                                         what="box 2 down")
                assert "1/2 appliances reachable" in text and b.url in text
                await pilot.press("1", "a")                       # the second box's overview
                await wait_screen(app, pilot, lambda t: "paris/box2" in t.splitlines()[0],
                                  what="box 2 selected")
        run(scenario)


# ---------------------------------------------------------------- layout snapshots

@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_overview_layout_snapshot(size):
    """The overview of a fixed snapshot, as text. Stable because: one snapshot only (the
    stream sends one and then waits), fixed uptime and ratio history, no colour, fixed
    size. UPDATE_TUI_SNAPSHOTS=1 rewrites the files after a deliberate layout change."""
    status = contract_status(0.9, 0.5, history=[1.2, 1.5, 1.8, 2.1, 1.8])
    with FixtureAdmin(status, sse_interval=3600) as srv:
        async def scenario():
            app = ApplianceConsole([srv.url])
            async with app.run_test(size=size) as pilot:
                await wait_screen(app, pilot, lambda t: "decode3 up" in t and "q Quit" in t,
                                  what="the whole overview")
                await pilot.pause(0.3)             # settled: nothing more is coming
                return app.screen_text()
        text = run(scenario)
    text = text.replace(srv.url, "http://127.0.0.1:PORT")
    path = SNAPSHOTS / f"overview_{size[0]}x{size[1]}.txt"
    if os.environ.get("UPDATE_TUI_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


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
