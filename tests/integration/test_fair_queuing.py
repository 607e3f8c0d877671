"""Fair queuing end to end (issue 27 §1): on `sim:2xH100` (one prefill, one decode
worker) serving `llama-3.1-70b-fp8`, a polite tenant's time to first token while
another tenant floods the box with 96 concurrent 8,000-token prompts, and the flood's
throughput beside it.

The times are simulated: each polite request's `simulated_ttft_s` (its
`--log-requests` record), the simulated prefill device's time from the request's
arrival at the worker to its first token (the rest of the step under way, the steps
the scheduler ran before it, its own). They say who was served when, which is what
fair queuing decides; the wall-clock TTFT (printed beside them) also carries the
daemon's own latency, which a loaded machine stretches by several times (under the
flood that made the wall-clock ratio swing from 1.7x to 6.5x).

Alone, a polite prompt (one at a time, for its first token only) is one prefill step on
an idle worker (27 ms simulated): the strictest baseline, with no daemon latency in it.
Under the flood (four streams, their pauses jittered so that where in a step a prompt
arrives is uniform) a prompt waits for the rest of the ~50 ms step under way, then
shares the next with a chunk of the flood: 2.2-3.0x that baseline at p50, depending on
where the prompts happened to arrive; on a quiet machine's wall clock, with the
daemon's latency in both, the same run is ~1.7x (issue 27's goal: <= 3x). A bound on
a ratio that sits at 2.9x on average would fail one run in three, so what is asserted
is the mechanism, which does not depend on where the prompts arrive: every polite
prompt waits for at most the step under way and its own, each one fair chunk; it never
waits in the router's queue while the flood's surplus does. First come, first served,
a polite prompt waits behind the whole flood (~4.5 s simulated, 100x): the test fails.
The simulator runs 2x faster than real time so the test stays about a minute;
bench/bench_fairness.py runs the scenario in real time, with fair queuing off for
comparison."""
from __future__ import annotations

import asyncio
import statistics
import sys
import time

from appliance.engines.fair_queue import FAIR_STEP_S
from helpers.daemons import ROOT, http

sys.path.insert(0, str(ROOT / "bench"))
from bench_fairness import MODEL, POLITE_KEY, Flood, config, polite, simulated_ttfts  # noqa: E402

SPEED = "2"


def test_a_polite_tenant_keeps_its_ttft_under_a_flood(daemon_factory, tiny_model):
    import openai
    d = daemon_factory("--devices", "sim:2xH100", "--model-spec", MODEL, "--sim-speed", SPEED,
                       "--log-requests", model=tiny_model, config=config(fair=True))

    depths: dict[str, int] = {}

    async def scenario() -> dict:
        client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key=POLITE_KEY, max_retries=0,
                                    timeout=120)
        await polite(client, 2, 4, 8, 0.05)                        # warm-up
        a0 = time.time()
        alone = await polite(client, 8, 1, 1, 0.05)
        a1 = time.time()
        flood = Flood(d.url, 96, 8000, 16)
        sampling = None
        flood.start()
        try:
            deadline = time.monotonic() + 120
            while not flood.done and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                flood._drain()
            assert flood.done, "the flood never got a request through"
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await asyncio.sleep(4.0)
            t1 = time.monotonic()
            sampling = asyncio.create_task(router_queues(d.url, depths))
            b0 = time.time()
            # (limit: without fair queuing one round waits ~1 min behind the flood)
            streams = await asyncio.gather(*(
                polite(client, 1, 1, 1, 0.01, seconds=5.0, limit=8.0, jitter=0.06, seed=i)
                for i in range(4)))
            busy = [t for stream in streams for t in stream]
            b1 = time.time()
            t2 = time.monotonic()
        finally:
            if sampling is not None:
                sampling.cancel()
            flood.stop()
        return {"alone": alone, "busy": busy, "flood_alone": flood.rate(t0, t1),
                "flood_shared": flood.rate(t1, t2), "errors": flood.errors,
                "phases": ((a0, a1), (b0, b1))}

    r = asyncio.run(scenario())
    (a0, a1), (b0, b1) = r["phases"]
    log = d.log_text()
    sim_alone = simulated_ttfts(log, "polite", a0, a1)
    sim_busy = simulated_ttfts(log, "polite", b0, b1)
    # Every polite request of each phase has its record, with the simulated time.
    assert (len(sim_alone), len(sim_busy)) == (len(r["alone"]), len(r["busy"])), (
        len(sim_alone), len(r["alone"]), len(sim_busy), len(r["busy"]))
    alone, busy = statistics.median(sim_alone), statistics.median(sim_busy)
    wall_alone, wall_busy = statistics.median(r["alone"]), statistics.median(r["busy"])
    print(f"polite TTFT p50 (simulated) alone {1e3 * alone:.1f} ms, under the flood "
          f"{1e3 * busy:.1f} ms ({busy / alone:.2f}x); wall clock {1e3 * wall_alone:.1f} -> "
          f"{1e3 * wall_busy:.1f} ms ({wall_busy / wall_alone:.2f}x); flood "
          f"{r['flood_alone']:.0f} -> {r['flood_shared']:.0f} prompt tokens/s; deepest router "
          f"queue {depths}")
    assert r["errors"] == 0
    # Alone, a polite prompt is one prefill step of a 70B model on an idle worker (~27 ms
    # simulated: the weights' read), whatever the machine's load.
    assert 0.02 < alone < 0.04 and max(sim_alone) < 0.04, sim_alone
    # The simulated times start at the prefill worker; before it, the router held the
    # flood's surplus in its fair queue (the worker saturated), and no polite request ever
    # waited there: it went ahead of the flood to the worker at once (first come, first
    # served, it would wait there behind the whole flood).
    assert depths.get("flood", 0) > 0 and depths.get("polite", 0) == 0, depths
    # Each polite prompt waited for the rest of the step under way and then its own, each
    # one fair chunk (~50 ms; up to ~56 at the flood's 8k-token context), and for nothing
    # else: first in line at the router and at the worker. (The first ones, one per
    # stream, may find a whole 8k-token step under way: the box counts as one tenant's
    # once the polite one has been quiet for SHARED_WINDOW_S, 10 s.)
    assert len(sim_busy) >= 40, len(sim_busy)
    assert all(t <= 2 * 1.15 * FAIR_STEP_S for t in sorted(sim_busy)[:-4]), sorted(sim_busy)
    # And the goal's own figure, with the room that where in a step the prompts arrive
    # takes (2.2-3.0x measured against this strictest baseline; first come, first served:
    # ~100x).
    assert busy <= 3.5 * alone, (busy, alone)
    # Two tenants of weight 1: the flood's fair share is half the box; the polite tenant
    # uses far less, so the flood keeps most of its throughput, and never less than half.
    assert r["flood_shared"] >= 0.5 * r["flood_alone"] > 0
    # The weights and the polite tenant's requests reached the worker's fair queue.
    prefill = d.worker("prefill0")
    assert prefill["iterations"] > 0


async def router_queues(url: str, deepest: dict[str, int]) -> None:
    """Each tenant's deepest queue at the router (`/admin/v1/tenants`), sampled until
    cancelled."""
    while True:
        code, _, body = await asyncio.to_thread(http, "GET", url + "/admin/v1/tenants")
        assert code == 200, body
        for t in body["tenants"]:
            deepest[t["tenant"]] = max(deepest.get(t["tenant"], 0), t["queue_depth"] or 0)
        await asyncio.sleep(0.05)
