"""The router admits a request to prefill only when the decode side can take its KV too
(`dispatch.decode_room`), end to end on `sim:2xH100` (one prefill, one decode worker)
serving `llama-3.1-70b-fp8` with little memory left for KV (`gpu_mem_fraction`: 611
blocks of 16 tokens per worker).

A flood of 12 requests of 1,000 prompt tokens and 1,024 answer tokens: without the gate
the prefill worker takes every prompt its own queue admits, the decode worker cannot
import their KV while its running requests hold it, and the handoffs that wait past
`handoff_timeout_s` are prefilled again on the decode worker (`kv_recomputes`: 8 of the
12 on the run this test was written on, the prefill work thrown away, and nothing waits
at the router). With it (`engine.decode_kv_gate = true`; off by default), the requests wait at
the router in fair order until the decode side has room, and every handoff is imported.
Both runs are here: the gate's worth is the difference."""
from __future__ import annotations

import asyncio
import random

import pytest
import sys
import time

from helpers.daemons import ROOT, http

sys.path.insert(0, str(ROOT / "bench"))
from bench_fairness import FLOOD_KEY, FLOOD_VOCAB, MODEL, config  # noqa: E402

FLOOD = 12
TOKENS = 1000       # 63 blocks of prompt
ANSWER = 1024       # and 64 of answer: four such requests fill the decode worker's KV
SPEED = "8"


def _depth(url: str) -> int:
    code, _, body = http("GET", url + "/admin/v1/tenants")
    assert code == 200, body
    return next((t["queue_depth"] for t in body["tenants"] if t["tenant"] == "flood"), 0)


@pytest.mark.parametrize("gate", [True, False], ids=["gate_on", "gate_off"])
def test_a_flood_waits_for_decode_kv_at_the_router_instead_of_recomputing(
        daemon_factory, tiny_model, gate):
    import openai
    cfg = config(fair=True).replace(
        "[engine]\n", "[engine]\ngpu_mem_fraction = 0.84\nhandoff_timeout_s = 1.0\n"
        f"decode_kv_gate = {str(gate).lower()}\n", 1)
    d = daemon_factory("--devices", "sim:2xH100", "--model-spec", MODEL, "--sim-speed", SPEED,
                       model=tiny_model, config=cfg)
    decode = d.worker("decode0")
    total = decode["kv_blocks_total"]
    rng = random.Random(1)
    base = [rng.randrange(10, FLOOD_VOCAB) for _ in range(TOKENS)]

    async def scenario() -> tuple[int, list]:
        client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key=FLOOD_KEY, max_retries=0,
                                    timeout=300)
        deepest = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal deepest
            while not stop.is_set():
                deepest = max(deepest, await asyncio.to_thread(_depth, d.url))
                await asyncio.sleep(0.05)

        async def one(i: int):
            return await client.completions.create(
                model=MODEL, prompt=[10 + i, 11 + i] + base[2:], max_tokens=ANSWER,
                extra_body={"ignore_eos": True})

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(one(i) for i in range(FLOOD)))
        finally:
            stop.set()
            await watcher
        return deepest, results

    deepest, results = asyncio.run(scenario())
    assert all(r.usage.completion_tokens == ANSWER for r in results)
    decode = d.worker("decode0")
    print(f"gate {'on' if gate else 'off'}: decode KV blocks {total}; deepest wait at the "
          f"router {deepest}; kv_recomputes {decode['kv_recomputes']} of {FLOOD}")
    if gate:
        assert decode["kv_recomputes"] == 0, decode       # every handoff was imported
        assert deepest >= 2, deepest                      # the flood waited at the router
    else:
        # what the gate saves: without it nothing waits at the router, and handoffs the
        # decode worker had no room for are prefilled again there
        assert deepest == 0 and decode["kv_recomputes"] >= 2, (deepest, decode)
