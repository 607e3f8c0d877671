"""The Capacity screen (4): `/admin/v1/plan` as a chart and a split table.

Against a real daemon (sim:8xH100, Llama-3.1-70B FP8, traffic from the openai client) the
screen must show the split and ρ the daemon's own plan answers; against the fixture
server its layout is an SVG snapshot (test_tui_snapshots.py); any JSON reads without raising."""
from __future__ import annotations

import asyncio

import pytest

from helpers.admin_fixture import wait_screen
from helpers.daemons import http

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402
from appliance.tui.format import fmt_num  # noqa: E402

SIM = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "10")


def screen_row(text: str, first: str) -> list[str]:
    return next(ln.split() for ln in text.splitlines() if ln.strip().startswith(first))


def test_capacity_screen_shows_what_the_daemon_plans(daemon_factory, tiny_model):
    d = daemon_factory(*SIM, model=tiny_model)
    client = d.client(timeout=120)
    for i in range(8):           # long prompts, short answers: prefill-heavy, rho > 1
        r = client.completions.create(model="llama-3.1-70b-fp8", prompt=f"def job_{i}(): " * 150,
                                      max_tokens=4)
        assert r.usage.completion_tokens == 4

    def plan() -> dict:
        code, _, body = http("GET", d.url + "/admin/v1/plan", timeout=60)
        assert code == 200, body
        return body

    before = plan()
    assert before["rho"]["now"] is not None and before["rho"]["now"] > 1

    async def scenario():
        app = ApplianceConsole([d.url])
        async with app.run_test(size=(100, 32)) as pilot:
            await wait_screen(app, pilot, lambda t: "sim7" in t, what="the overview")
            await pilot.press("4")
            return await wait_screen(app, pilot, lambda t: "BOTTLENECK" in t and "P+D" in t,
                                     timeout=60, what="the capacity screen")
    text = asyncio.run(scenario())
    after = plan()

    splits = screen_row(text, "P+D")
    shown = {"current": splits[1], "recommended": splits[2], "at_peak": splits[3]}
    want = [{"current": p["current"]["split"], "recommended": p["recommended"]["split"],
             "at_peak": p["recommended"]["at_peak"]["split"]} for p in (before, after)]
    assert shown in want, (shown, want, text)
    rho_line = screen_row(text, "RHO")
    rho = rho_line[rho_line.index("now") + 1]
    assert rho in {fmt_num(p["rho"]["now"], digits=2) for p in (before, after)}, text
    for phase in ("prefill", "decode"):
        row = screen_row(text, f"{phase} GPUs")
        assert row[3] in {str(p["recommended"][phase]["gpus"]) for p in (before, after)}, text
    assert "[SIMULATED profile]" in text and "prefill simulated (H100-SXM)" in text
    assert f"BOTTLENECK {after['bottleneck']['phase']}:" in text
    first = text.splitlines()[0]
    assert "SIMULATED" in first and "ESTIMATED" in first and "Capacity" in first
