"""`applianced tui` and `applianced status` against a real daemon on loopback
(sim:8xH100, Llama-3.1-70B FP8), driven by Textual's Pilot."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest

from helpers import daemons
from helpers.admin_fixture import section, wait_screen
from helpers.daemons import ROOT
from helpers.screen import screen_text

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402

SIM = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "10")


def devices_by_group(text: str) -> dict[str, list[str]]:
    """Which device ids the screen lists under PREFILL and under DECODE."""
    out = {}
    for group, stop in (("PREFILL", "DECODE"), ("DECODE", "workers")):
        lines = section(text, group, stop)
        out[group] = [m.group(1) for ln in lines[1:] for m in [re.match(r"\s+(sim\d+)\s", ln)] if m]
    return out


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_overview_lists_the_sim_box_and_quits_on_q(daemon_factory, tiny_model, size):
    d = daemon_factory(*SIM, model=tiny_model)
    plan = d.status()["plan"]
    want = {"PREFILL": [dev for w in plan["prefill"] for dev in w["devices"]],
            "DECODE": [dev for w in plan["decode"] for dev in w["devices"]]}
    assert len(want["PREFILL"] + want["DECODE"]) == 8

    async def scenario():
        app = ApplianceConsole([d.url])
        async with app.run_test(size=size) as pilot:
            text = await wait_screen(app, pilot, lambda t: "sim7" in t and "SIMULATED" in t,
                                     what="the eight devices")
            assert devices_by_group(text) == want, text
            assert "unreachable" not in text
            assert "Overview" in text.splitlines()[0]
            await pilot.press("q")
            await pilot.pause()
            assert not app.is_running
        return app.return_code

    assert asyncio.run(scenario()) == 0


def test_banner_while_the_daemon_is_down_and_gone_after_restart(daemon_factory, tiny_model,
                                                                  monkeypatch):
    d = daemon_factory(*SIM, model=tiny_model)

    async def scenario():
        app = ApplianceConsole([d.url], backoff=(0.2, 1.0))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_screen(app, pilot, lambda t: "sim7" in t, what="the devices")
            assert await asyncio.to_thread(d.stop) == 0
            text = await wait_screen(app, pilot, lambda t: "unreachable" in t,
                                     what="the unreachable banner")
            assert d.url in text and "sim7" in text        # last figures stay on screen
            for key in "2316":                             # every screen keeps running
                await pilot.press(key)
                await pilot.pause(0.2)
                assert "unreachable" in screen_text(app)
                assert "Traceback" not in screen_text(app)
            await pilot.press("1")
            # the same port again, as a supervisor would restart it
            monkeypatch.setattr(daemons, "free_port", lambda: d.port)
            await asyncio.to_thread(daemon_factory, *SIM, model=tiny_model)
            text = await wait_screen(app, pilot, lambda t: "unreachable" not in t
                                     and "sim7" in t, what="the banner to go")
            assert app.is_running and devices_by_group(text)["DECODE"], text
    asyncio.run(scenario())


def test_status_prints_the_overview_once(daemon_factory, tiny_model):
    d = daemon_factory(*SIM, model=tiny_model)
    out = subprocess.run([sys.executable, "-m", "appliance", "status", "--url", d.url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    want = {"PREFILL": [dev for w in d.status()["plan"]["prefill"] for dev in w["devices"]],
            "DECODE": [dev for w in d.status()["plan"]["decode"] for dev in w["devices"]]}
    groups = {}
    for group, stop in (("PREFILL", "DECODE"), ("DECODE", "workers")):
        lines = section(out.stdout, group, stop)
        groups[group] = [ln.split()[0] for ln in lines[1:]]
    assert groups == want, out.stdout
    assert "[SIMULATED]" in out.stdout.splitlines()[0]
    workers = [ln.split()[0] for ln in out.stdout.splitlines() if re.match(r"(prefill|decode)\d", ln)]
    assert workers == [w["worker"] for w in d.status()["workers"]]
