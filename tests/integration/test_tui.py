"""The console's own behaviour: the feed's fallback from the stream to polling, the
redraw limit, pause, junk JSON, screens, keys and the fleet. Daemon side: `FixtureAdmin`, a
real aiohttp server on loopback speaking the admin API contract. (The view models:
tests/unit/test_tui_views.py; each screen's layout: test_tui_snapshots.py.)"""
from __future__ import annotations

import asyncio
import urllib.parse

import pytest

from helpers.admin_fixture import (FixtureAdmin, contract_status, section, two_peers, usage_rows,
                                   wait_screen, wait_until)
from helpers.daemons import free_port
from helpers.screen import screen_text

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402
from appliance.tui.format import fmt_ratio  # noqa: E402


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
                assert "1.80:1" in screen_text(app)
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
                                         timeout=60, what="box 2 down")   # (its reconnects back off)
                assert "1/2 appliances reachable" in text and b.url in text
                await pilot.press("1", "a")                       # the second box's overview
                await wait_screen(app, pilot, lambda t: "paris/box2" in t.splitlines()[0],
                                  what="box 2 selected")
        run(scenario)


def test_peers_panel_shows_the_kv_rate_the_stream_grows():
    """A front box whose decode peer's kv_bytes_total grows between snapshots: the Peers
    panel's GB/s comes from those deltas (n/a before a second snapshot); a peer going
    down turns up on screen with its error. Nothing of it on a single box."""
    status = {**contract_status(0.9, 0.5), "cluster": two_peers(kv_bytes=0)}
    with FixtureAdmin(status, sse_interval=0.1) as srv:
        async def scenario():
            app = ApplianceConsole([srv.url])
            async with app.run_test(size=(100, 40)) as pilot:
                first = await wait_screen(app, pilot, lambda t: "PEERS" in t, what="the panel")
                grow = asyncio.create_task(_grow(srv, status))
                try:
                    # The window averages in the flat stretch before the feed began,
                    # so the first rate shown can be low on a loaded box; it climbs
                    # towards the ~10 GB/s fed as the window fills with growth.
                    moving = await wait_screen(app, pilot, lambda t: _rate(t) > 1,
                                               what="a rate above 1 GB/s")
                finally:
                    grow.cancel()
                peer = app.current.overview.cluster.peers[0]
                srv.set(status=contract_status(0.9, 0.5))
                gone = await wait_screen(app, pilot, lambda t: "PEERS" not in t,
                                         what="the panel hidden for a single box")
            return first, moving, peer, gone
        first, moving, peer, gone = run(scenario)
    assert "1 of 2 up" in first and "last error: connection refused" in first
    # ~10 GB/s fed; the clocks of a loaded machine stretch it, never to another order
    assert _rate(moving) < 100 and peer.kv_gb_per_s is not None, (moving, peer)
    assert "decode-1" not in gone


def _rate(screen: str) -> float:
    """decode-1's KV GB/s as the screen shows it (0 while n/a)."""
    import re
    for ln in screen.splitlines():
        m = re.search(r"decode-1.*KV\s+([0-9.]+) GB/s", ln)
        if m:
            return float(m.group(1))
    return 0.0


async def _grow(srv, status) -> None:
    """kv_bytes_total += 1 GB every 0.1 s (~10 GB/s), as a busy decode peer's would."""
    n = 0
    while True:
        n += 1
        srv.set(status={**status, "cluster": two_peers(kv_bytes=n * 10**9)})
        await asyncio.sleep(0.1)
