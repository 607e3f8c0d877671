"""The console's live figures: the ratio following the load mix, tenants ordered by GPU
budget, carbon, the fleet.

These figures come from parts of the daemon built in parallel (telemetry, ledger), so
for now the `live_admin` fixture is `FixtureAdmin`: a real aiohttp server on loopback
answering the admin API contract with snapshots the fixture sets. The tests only assert
what they can also read from that API over HTTP (`live.status()`, `live.usage()`), never
a figure of the fixture's, so pointing them at the real daemon is one change:
`live_admin` returns a `DaemonAdmin` (below) instead.
"""
from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest

from admin_fixture import FixtureAdmin, contract_status, usage_rows, wait_screen

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402
from appliance.tui.model import fmt_ratio  # noqa: E402


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


class FixtureLive:
    """The admin API, answered by `FixtureAdmin` with contract-shaped snapshots."""

    def __init__(self, server: FixtureAdmin):
        self.server = server
        self.url = server.url

    def load(self, mix: str) -> None:
        """prefill-heavy: long prompts, one-token answers; decode-heavy: the reverse."""
        busy = {"prefill-heavy": (0.9, 0.3), "decode-heavy": (0.15, 0.95)}[mix]
        self.server.set(status=contract_status(*busy))

    def charge_tenants(self) -> tuple[str, str]:
        """Two tenants with the same tokens: one sends long prompts (prefill GPU-time),
        the other long answers (decode). Returns their names."""
        self.server.set(usage=usage_rows({"batch-etl": (50.0, 2.0), "chat-bot": (4.0, 18.0)},
                                         {"batch-etl": (30000, 100), "chat-bot": (1000, 29100)}))
        return "batch-etl", "chat-bot"

    def status(self) -> dict:
        return get_json(self.url + "/admin/v1/status")

    def usage(self) -> dict:
        return get_json(self.url + "/admin/v1/usage?group_by=tenant,phase&since=24h")


# When the telemetry and ledger streams are merged, replace FixtureLive with a class of
# the same four methods over a real daemon: `daemon_factory(*SIM, config=<two tenant
# keys>)`; `load(mix)` runs 4 streams of 3,000-token prompts with max_tokens 1
# (prefill-heavy) or 2-token prompts with max_tokens 200 and ignore_eos (decode-heavy)
# in a thread for ~5 s and waits for one new snapshot; `charge_tenants()` sends the same
# two shapes with the two tenants' keys and waits until /admin/v1/usage lists both.
@pytest.fixture
def live_admin():
    with FixtureAdmin(contract_status(0.5, 0.5)) as server:
        yield FixtureLive(server)


def shown_ratio(text: str) -> float:
    m = re.search(r"PREFILL:DECODE (\d+(?:\.\d+)?):1", text)
    assert m, text
    return float(m.group(1))


def test_ratio_follows_the_load_mix(live_admin):
    async def scenario():
        app = ApplianceConsole([live_admin.url])
        async with app.run_test(size=(80, 24)) as pilot:
            seen = {}
            for mix in ("prefill-heavy", "decode-heavy"):
                await asyncio.to_thread(live_admin.load, mix)
                want = fmt_ratio(live_admin.status()["ratio"]["gpu_seconds"])
                text = await wait_screen(app, pilot, lambda t: f"PREFILL:DECODE {want}" in t,
                                         what=f"ratio {want} after {mix}")
                seen[mix] = shown_ratio(text)
            assert seen["prefill-heavy"] > seen["decode-heavy"], seen
            history = [v for _, v in live_admin.status()["ratio"]["history"] if v is not None]
            spark = app.screen.query_one("#ratio-spark")
            assert list(spark.data) == history[-60:] and history
    asyncio.run(scenario())


def tenant_order(text: str, names) -> list[str]:
    lines = text.splitlines()
    return [n for ln in lines for n in names if ln.strip().startswith(n)]


def test_tenants_ordered_by_gpu_budget(live_admin):
    names = live_admin.charge_tenants()
    usage = live_admin.usage()
    gpu = {n: sum(r["gpu_seconds"] for r in usage["rows"] if r["tenant"] == n) for n in names}
    by_gpu = sorted(names, key=lambda n: -gpu[n])

    async def scenario():
        app = ApplianceConsole([live_admin.url])
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("2")
            text = await wait_screen(app, pilot, lambda t: all(n in t for n in names),
                                     what="both tenants")
            assert tenant_order(text, names) == by_gpu, text
            share = {n: round(gpu[n] / sum(gpu.values()) * 100) for n in names}
            for n in names:
                row = next(ln for ln in text.splitlines() if ln.strip().startswith(n))
                assert f"{share[n]}%" in row, row
            await pilot.press("S")                                   # ascending
            text = await wait_screen(app, pilot, lambda t: "GPU-s↑" in t, what="reverse")
            assert tenant_order(text, names) == by_gpu[::-1], text
            await pilot.press("slash")
            await pilot.press(*by_gpu[1][:4], "enter")
            text = await wait_screen(app, pilot, lambda t: by_gpu[0] not in t, what="filter")
            assert by_gpu[1] in text
            await pilot.press("escape")
            await wait_screen(app, pilot, lambda t: all(n in t for n in names), what="unfilter")

    asyncio.run(scenario())
