"""The Capacity screen (4): `/admin/v1/plan` as a chart and a split table.

Against a real daemon (sim:8xH100, Llama-3.1-70B FP8, traffic from the openai client) the
screen must show the split and ρ the daemon's own plan answers; against the fixture
server its layout is pinned as text; any JSON reads without raising."""
from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import pytest

from helpers.admin_fixture import FixtureAdmin, contract_status, wait_screen
from helpers.daemons import http

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402
from appliance.tui.format import fmt_num  # noqa: E402

SIM = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "10")
SNAPSHOTS = Path(__file__).parent / "snapshots"


@pytest.fixture(scope="module")
def synthetic_plan(tmp_path_factory) -> dict:
    """What the real planner answers after three hours of traffic whose rate swells
    and whose mix drifts from long prompts to long answers (one request every 2-10 s),
    on a simulated 8xH100 at a fixed clock, with the built-in forecaster."""
    from appliance.config import PlannerConfig
    from appliance.models.specs import lookup_model_spec
    from appliance.partitions.catalogue import lookup_gpu
    from appliance.planner.planner import Planner
    from appliance.planner.planner import BoxShape
    from appliance.accounting.records import RequestRecord
    m, h100 = lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100")
    pl = Planner(PlannerConfig(horizon="3h"), BoxShape(m, h100, h100, 4, 4, 1, 8, True),
                 tmp_path_factory.mktemp("plan") / "ledger.db")
    t0 = 1_700_000_000 // 3600 * 3600
    t, i = float(t0), 0
    while t < t0 + 3 * 3600:
        x = (t - t0) / (3 * 3600)
        prompt, output = int(4000 - 3500 * x), int(20 + 600 * x)
        pl.observe(RequestRecord(f"r{i}", "t", pl.model_name, "completions", prompt, output, 0,
                                 t, t + 0.2, t + 0.2 + 0.03 * output, "prefill0", "decode0",
                                 "ok", "length", simulated=True))
        t += 10 - 8 * math.sin(math.pi * x) ** 2
        i += 1
    try:
        return json.loads(json.dumps(pl.plan(now=t0 + 3 * 3600, use_statsmodels=False)))
    finally:
        pl.close()


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


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_capacity_layout_snapshot(size, synthetic_plan):
    """The screen on the synthetic plan above. Stable: one status snapshot and one plan
    at a fixed clock, fixed size, no colour. UPDATE_TUI_SNAPSHOTS=1 rewrites the files."""
    plan = synthetic_plan
    with FixtureAdmin(contract_status(0.9, 0.5), sse_interval=3600) as srv:
        srv.set(plan=plan)

        async def scenario():
            app = ApplianceConsole([srv.url])
            async with app.run_test(size=size) as pilot:
                await wait_screen(app, pilot, lambda t: "sim7" in t, what="overview")
                await pilot.press("4")
                await wait_screen(app, pilot, lambda t: "BOTTLENECK" in t and "q Quit" in t,
                                  what="the capacity screen")
                await pilot.pause(0.3)
                return app.screen_text()
        text = asyncio.run(scenario())
    text = text.replace(srv.url, "http://127.0.0.1:PORT")
    path = SNAPSHOTS / f"capacity_{size[0]}x{size[1]}.txt"
    if os.environ.get("UPDATE_TUI_SNAPSHOTS"):
        path.write_text(text)
    assert text == path.read_text()
