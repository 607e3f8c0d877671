"""The router's fair queue end to end (issue 27 §1, "which worker gets which request
next"): on `sim:2xH100` (one prefill, one decode worker) with `engine.max_seqs = 2`, a
flooding tenant's long prompts saturate the prefill worker and the rest wait at the
router (`queue_depth` in /admin/v1/tenants). A polite tenant's prompt, sent after them,
is dispatched at the next free slot: ahead of every flood prompt still waiting there.

In arrival order (the router before its fair queue) the polite prompt would go after
all of them; the worker's own fair queue cannot help with what never reached it."""
from __future__ import annotations

import asyncio
import random
import sys
import time

from helpers.daemons import ROOT, http

sys.path.insert(0, str(ROOT / "bench"))
from bench_fairness import FLOOD_KEY, FLOOD_VOCAB, MODEL, POLITE_KEY, config  # noqa: E402

FLOOD = 10
FLOOD_TOKENS = 4000


def _depth(url: str, tenant: str) -> int:
    code, _, body = http("GET", url + "/admin/v1/tenants")
    assert code == 200, body
    return next((t["queue_depth"] for t in body["tenants"] if t["tenant"] == tenant), 0)


def test_a_polite_request_is_dispatched_ahead_of_the_flood_waiting_at_the_router(
        daemon_factory, tiny_model):
    import openai
    cfg = config(fair=True).replace("[engine]\n", "[engine]\nmax_seqs = 2\n", 1)
    d = daemon_factory("--devices", "sim:2xH100", "--model-spec", MODEL, "--sim-speed", "2",
                       model=tiny_model, config=cfg)
    rng = random.Random(0)
    base = [rng.randrange(10, FLOOD_VOCAB) for _ in range(FLOOD_TOKENS)]

    async def scenario():
        flood_client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key=FLOOD_KEY,
                                          max_retries=0, timeout=120)
        polite_client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key=POLITE_KEY,
                                           max_retries=0, timeout=120)
        await polite_client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=1)
        done: list[tuple[float, str]] = []

        async def one(tenant: str, client, prompt: list[int]) -> None:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            done.append((time.monotonic(), tenant))

        flood = [asyncio.create_task(one("flood", flood_client, [10 + i, 11 + i] + base[2:]))
                 for i in range(FLOOD)]
        deadline = time.monotonic() + 60
        while (depth := await asyncio.to_thread(_depth, d.url, "flood")) < FLOOD - 4:
            assert time.monotonic() < deadline, f"the flood never queued at the router ({depth})"
            await asyncio.sleep(0.02)
        polite = asyncio.create_task(one("polite", polite_client, [12, 13, 14, 15]))
        await polite
        depth_after = await asyncio.to_thread(_depth, d.url, "flood")
        await asyncio.gather(*flood)
        return depth, depth_after, [tenant for _, tenant in sorted(done)]

    depth, depth_after, order = asyncio.run(scenario())
    print(f"flood waiting at the router when the polite prompt came: {depth}; "
          f"after it was served: {depth_after}; completion order: {order}")
    # The flood prompts that were waiting at the router when the polite one arrived all
    # finish after it (at most one may have left the queue between the read and the send).
    after = len(order) - 1 - order.index("polite")
    assert depth >= FLOOD - 4 and after >= depth - 1, (depth, order)
    assert depth_after >= 1                   # the polite prompt went while they waited
    assert _depth(d.url, "flood") == 0        # and nothing is left behind
