"""Every console screen as an SVG snapshot (pytest-textual-snapshot's SVG format, compared
by syrupy), drawn from fixed answers: the admin API fixture server (a real aiohttp server on
loopback) sends one status and then waits an hour, and answers fixed usage, carbon, plan
and workflows; the status carries its own uptime and ratio history, the plan was made at a
fixed clock, and the terminal has a fixed size. So a snapshot changes only when what is
drawn changes.

The screenshot is Textual's public `App.export_screenshot()`, taken once the app has the
data (read from the app's own state, not from the screen). The fleet screen lists each
appliance's URL, whose port the kernel picks: it is replaced by a fixed port of the same
width before the comparison.

After a deliberate change of a screen, rewrite the snapshots and look at them in the diff:
`.venv/bin/python -m pytest tests/integration/test_tui_snapshots.py --snapshot-update`.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from helpers.admin_fixture import FixtureAdmin, contract_status, two_peers, usage_rows
from helpers.plans import synthetic_plan  # noqa: F401 (a fixture)

pytest.importorskip("textual")
pytest_textual_snapshot = pytest.importorskip("pytest_textual_snapshot")

from appliance.tui.app import ApplianceConsole  # noqa: E402

USAGE = usage_rows({"batch-etl": (50.0, 2.0), "chat-bot": (4.0, 18.0), "search": (1.0, 1.0)},
                   {"batch-etl": (400_000, 1_000), "chat-bot": (20_000, 90_000)})
USAGE["budgets"] = {"chat-bot": {"gpu_hours": 0.85, "usd": 0.2}}
CARBON = {"rows": [
    {"site": "local", "tenant": "batch-etl", "intensity_g_per_kwh": 412.0, "co2e_grams": 3200.0,
     "provenance": {"source": "csv", "kind": "average", "estimated": True},
     "sci_per_1k_tokens": 0.11},
    {"site": "local", "tenant": "chat-bot", "intensity_g_per_kwh": 412.0, "co2e_grams": 900.0,
     "provenance": {"source": "csv", "kind": "average", "estimated": True},
     "sci_per_1k_tokens": 0.04}]}
T = 1732365000.0        # the fixture status's clock
WORKFLOWS = {"object": "list", "data": [
    {"id": "wf-0002", "kind": "swap-model", "params": {"model": "llama-3.1-8b"},
     "status": "running", "phase": "forward", "cancel_requested": False, "owner": "fixture",
     "error": None, "recoveries": 0, "created_at": T - 60, "started_at": T - 60,
     "updated_at": T - 5, "finished_at": None, "steps": []},
    {"id": "wf-0001", "kind": "repartition", "params": {"split": "6+2"},
     "status": "succeeded", "phase": "forward", "cancel_requested": False, "owner": None,
     "error": None, "recoveries": 0, "created_at": T - 3600, "started_at": T - 3600,
     "updated_at": T - 3540, "finished_at": T - 3540, "steps": []}]}


def fixture_server(**answers) -> FixtureAdmin:
    srv = FixtureAdmin(answers.pop("status", None) or
                       contract_status(0.9, 0.5, history=[1.2, 1.5, 1.8, 2.1, 1.8]),
                       sse_interval=3600)
    srv.set(**answers)
    return srv


async def until(pilot, ready, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def streaming(app) -> bool:
    """Every appliance's first status is in the app's state (the redraws it causes follow)."""
    return all(s.status is not None and s.link.up for s in app.appliances.values())


def screenshot(app: ApplianceConsole, size: tuple[int, int], keys: str = "",
               fetching: bool = False) -> str:
    """The app's SVG screenshot once every status has arrived, `keys` are pressed and (a
    screen with requests of its own) its answers are in."""
    async def scenario() -> str:
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: streaming(app), "the status")
            for key in keys:
                await pilot.press(key)
            if fetching:
                await until(pilot, lambda: getattr(app.screen, "fetched", False),
                            "the screen's own request")
            await pilot.pause(0.3)                    # the last coalesced redraw
            await pilot.wait_for_scheduled_animations()
            return app.export_screenshot()
    return asyncio.run(scenario())


@pytest.fixture
def svg_snapshot(snapshot):
    return snapshot.use_extension(pytest_textual_snapshot.SVGImageExtension)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_overview(svg_snapshot, size):
    with fixture_server() as srv:
        svg = screenshot(ApplianceConsole([srv.url]), size)
    assert "decode3" in svg and "SIMULATED" in svg
    assert svg_snapshot == svg


def test_overview_with_peers(svg_snapshot):
    """A front box with two decode peers, one down: the Peers panel under the rates."""
    status = {**contract_status(0.9, 0.5), "cluster": two_peers(kv_bytes=5 * 10**9)}
    with fixture_server(status=status) as srv:
        svg = screenshot(ApplianceConsole([srv.url]), (100, 30))
    assert "PEERS" in svg and "decode-2" in svg and "DOWN" in svg
    assert svg_snapshot == svg


def test_tenants(svg_snapshot):
    with fixture_server(usage=USAGE) as srv:
        svg = screenshot(ApplianceConsole([srv.url]), (80, 24), "2", fetching=True)
    assert "chat-bot" in svg
    assert svg_snapshot == svg


def test_carbon(svg_snapshot):
    with fixture_server(carbon=CARBON) as srv:
        svg = screenshot(ApplianceConsole([srv.url]), (80, 24), "3", fetching=True)
    assert "batch-etl" in svg and "ESTIMATED" in svg
    assert svg_snapshot == svg


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_capacity(svg_snapshot, size, synthetic_plan):  # noqa: F811 (the fixture)
    with fixture_server(plan=synthetic_plan) as srv:
        svg = screenshot(ApplianceConsole([srv.url]), size, "4", fetching=True)
    assert "BOTTLENECK" in svg
    assert svg_snapshot == svg


def test_workflows(svg_snapshot):
    with fixture_server(workflows=WORKFLOWS) as srv:
        svg = screenshot(ApplianceConsole([srv.url]), (80, 24), "5", fetching=True)
    assert "swap-mo" in svg
    assert svg_snapshot == svg


def test_fleet(svg_snapshot):
    paris = contract_status(0.2, 0.8, site="paris", appliance="box2")
    with fixture_server(usage=USAGE) as a, fixture_server(status=paris, usage=USAGE) as b:
        svg = screenshot(ApplianceConsole([a.url, b.url]), (100, 30), "6", fetching=True)
        ports = (a.port, b.port)
    # The kernel's ephemeral ports have five digits: fixed ones of the same width keep
    # the layout.
    for port, fixed in zip(ports, ("50001", "50002")):
        assert len(str(port)) == 5, port
        assert f"127.0.0.1:{port}" in svg
        svg = svg.replace(f"127.0.0.1:{port}", f"127.0.0.1:{fixed}")
    assert "paris" in svg
    assert svg_snapshot == svg


def test_help(svg_snapshot):
    with fixture_server() as srv:
        svg = screenshot(ApplianceConsole([srv.url]), (80, 24), "?")
    assert "quit" in svg
    assert svg_snapshot == svg
