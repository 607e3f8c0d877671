"""The console's live figures: the ratio following the load mix, tenants ordered by GPU
budget, carbon, the fleet.

They run against a real daemon on a simulated 8xH100 with two tenant keys and a steady
load of each mix (`DaemonLive`). The tests only assert what they can also read from the
admin API over HTTP (`live.status()`, `live.usage()`), so the same tests also run against
`FixtureAdmin`, a loopback server answering the contract with snapshots a test sets
(APPLIANCED_TUI_LIVE=fixture), which pins the console's behaviour on figures a live
daemon would take long to reach.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import time
import urllib.request

import pytest

from helpers.admin_fixture import FixtureAdmin, contract_status, usage_rows, wait_screen

pytest.importorskip("textual")

from appliance.tui.app import ApplianceConsole  # noqa: E402
from appliance.tui.format import fmt_ratio  # noqa: E402


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


class FixtureLive:
    """The admin API, answered by `FixtureAdmin` with contract-shaped snapshots."""

    def __init__(self, server: FixtureAdmin):
        self.server = server
        self.url = server.url
        self.history: list[float] = []

    def load(self, mix: str) -> None:
        """prefill-heavy: long prompts, one-token answers; decode-heavy: the reverse."""
        pre, dec = {"prefill-heavy": (0.9, 0.3), "decode-heavy": (0.15, 0.95)}[mix]
        self.history += [pre / dec] * 5                # the daemon keeps the last 60 s
        self.server.set(status=contract_status(pre, dec, history=self.history[-60:]))

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


class DaemonLive:
    """The same four methods over a real daemon (sim:8xH100, two tenant keys)."""
    SIM = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "10")
    KEYS = {"batch-etl": "sk-tenant-batch-etl", "chat-bot": "sk-tenant-chat-bot"}
    LONG_PROMPT = ("word " * 3000, 1)          # prefill work, a one-token answer
    LONG_ANSWER = ("hi", 200)                  # decode work

    def __init__(self, daemon_factory, model):
        config = "[auth.keys]\n" + "".join(
            f'"{hashlib.sha256(k.encode()).hexdigest()}" = "{t}"\n' for t, k in self.KEYS.items())
        self.daemon = daemon_factory(*self.SIM, model=model, config=config)
        self.url = self.daemon.url
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _send(self, tenant: str, shape: tuple[str, int], until: threading.Event | None,
              count: int = 0) -> None:
        client = self.daemon.client(api_key=self.KEYS[tenant])
        n = 0
        while (until is not None and not until.is_set()) or n < count:
            client.completions.create(model="llama-3.1-70b-fp8", prompt=shape[0],
                                      max_tokens=shape[1], extra_body={"ignore_eos": True})
            n += 1

    def _stop_load(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        self._threads, self._stop = [], threading.Event()

    def load(self, mix: str) -> None:
        """Steady load of that mix (3 streams of the heavy shape, 1 of the other), held
        until the next call; returns once the 10 s windows hold only this mix."""
        self._stop_load()
        heavy, light = ((self.LONG_PROMPT, self.LONG_ANSWER) if mix == "prefill-heavy"
                        else (self.LONG_ANSWER, self.LONG_PROMPT))
        for shape in (heavy, heavy, heavy, light):
            t = threading.Thread(target=self._send, args=("batch-etl", shape, self._stop),
                                 daemon=True)
            t.start()
            self._threads.append(t)
        time.sleep(11)

    def charge_tenants(self) -> tuple[str, str]:
        """The same tokens (~30k each): batch-etl as long prompts, chat-bot as long answers."""
        threads = [threading.Thread(target=self._send, args=("batch-etl", self.LONG_PROMPT,
                                                             None, 5)) for _ in range(2)]
        threads += [threading.Thread(target=self._send, args=("chat-bot", self.LONG_ANSWER,
                                                            None, 25)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # A request's GPU-seconds are final once the windows it ran in have closed: wait
        # for every row, and nothing pending, else the TUI reads more than this test did.
        # Counted by tenant alone: by phase, a request counts in both its phases' rows.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            usage = get_json(self.url + "/admin/v1/usage?group_by=tenant&since=24h")
            done = sum(r.get("requests") or 0 for r in usage.get("rows", [])
                       if r.get("tenant") in ("batch-etl", "chat-bot"))
            if done >= 2 * 5 + 6 * 25 and usage.get("accounting", {}).get("pending") == 0:
                time.sleep(1.0)                 # the final rows' batch
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"usage never settled: {done} of 160 requests final")
        return "batch-etl", "chat-bot"

    def status(self) -> dict:
        return get_json(self.url + "/admin/v1/status")

    def usage(self) -> dict:
        return get_json(self.url + "/admin/v1/usage?group_by=tenant,phase&since=24h")

    def close(self) -> None:
        self._stop_load()


# Which server the live tests talk to: the real daemon, or APPLIANCED_TUI_LIVE=fixture.
LIVE_DEFAULT = "daemon"


@pytest.fixture
def live_admin(request):
    if os.environ.get("APPLIANCED_TUI_LIVE", LIVE_DEFAULT) == "daemon":
        live = DaemonLive(request.getfixturevalue("daemon_factory"),
                          request.getfixturevalue("tiny_model"))
        yield live
        live.close()
    else:
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

                def agrees(text: str) -> bool:   # shown = what the API says now (±10%)
                    api = live_admin.status()["ratio"]["gpu_seconds"]
                    m = re.search(r"PREFILL:DECODE (\d+(?:\.\d+)?):1 GPU-s ", text)
                    return api is not None and m is not None and \
                        abs(float(m.group(1)) - api) <= max(0.1 * api, 0.01)
                text = await wait_screen(app, pilot, agrees, what=f"the API's ratio ({mix})")
                seen[mix] = shown_ratio(text)
            assert seen["prefill-heavy"] > seen["decode-heavy"], seen
            spark = app.screen.query_one("#ratio-spark")
            assert len(spark.data) >= 2 and max(spark.data) > min(spark.data)   # it moved
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
