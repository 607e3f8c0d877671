"""The sequences-in-decode cap (`engine.decode_max_seqs`), end to end on `sim:2xH100`
(one prefill, one decode worker): a burst of requests larger than the cap is held at
the router before its prefill, never more than the cap in decode at once, and every
request is answered in full; `/admin/v1/status` says what the cap holds."""
from __future__ import annotations

import asyncio

from helpers.daemons import http

MODEL = "llama-3.1-8b"
CAP = 2
REQUESTS = 6
ANSWER = 200


def test_a_burst_past_the_cap_waits_at_the_router_and_is_answered_in_full(
        daemon_factory, tiny_model):
    import openai
    d = daemon_factory("--devices", "sim:2xH100", "--model-spec", MODEL, "--sim-speed", "2",
                       model=tiny_model, config=f"[engine]\ndecode_max_seqs = {CAP}\n")
    assert d.status()["decode_admission"] == {
        "max_seqs_per_decode_worker": CAP, "kv_gate": False, "counted": 0,
        "kv_blocks_counted": 0, "waiting": 0}
    model = d.status()["model"]

    def admission() -> tuple[dict, int]:
        code, _, body = http("GET", d.url + "/admin/v1/status")
        assert code == 200, body
        running = next(w["running"] for w in body["workers"] if w["worker"] == "decode0")
        return body["decode_admission"], running or 0

    def gauges() -> dict[str, float]:
        """The router's two gauges on /metrics (one sample each: site labels aside)."""
        code, _, body = http("GET", d.url + "/metrics")
        assert code == 200
        out = {}
        for line in body.decode().splitlines():
            name = line.split("{", 1)[0]
            if name in ("applianced_router_waiting_requests",
                        "applianced_decode_admission_counted_requests"):
                assert 'simulated="true"' in line, line
                out[name] = float(line.rsplit(" ", 1)[1])
        return out

    idle = ({"max_seqs_per_decode_worker": CAP, "kv_gate": False, "counted": 0,
             "kv_blocks_counted": 0, "waiting": 0},
            {"applianced_router_waiting_requests": 0.0,
             "applianced_decode_admission_counted_requests": 0.0})

    async def scenario():
        client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)
        seen: list[tuple[dict, int]] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen.append(await asyncio.to_thread(admission))
                await asyncio.sleep(0.02)

        async def one(i: int):
            return await client.completions.create(
                model=model, prompt=f"request {i}: " + "tokens " * 40, max_tokens=ANSWER,
                extra_body={"ignore_eos": True})

        watcher = asyncio.create_task(watch())
        burst = asyncio.gather(*(one(i) for i in range(REQUESTS)))
        try:
            # waited for: the burst held back, as the status and /metrics both say (the
            # requests beyond the cap wait a whole answer's time for a place)
            while True:
                assert not burst.done(), "the burst ended without being seen held back"
                status, _ = await asyncio.to_thread(admission)
                g = await asyncio.to_thread(gauges)
                if (status["waiting"] >= 1 and g["applianced_router_waiting_requests"] >= 1
                        and g["applianced_decode_admission_counted_requests"] == CAP):
                    break
                await asyncio.sleep(0.02)
            results = await burst
        finally:
            stop.set()
            await watcher
            await asyncio.gather(burst, return_exceptions=True)
            await client.close()
        # the last request's bookkeeping ends just after its answer: waited for too
        deadline = asyncio.get_running_loop().time() + 20
        while (await asyncio.to_thread(lambda: (admission()[0], gauges()))) != idle:
            assert asyncio.get_running_loop().time() < deadline, "the router kept a count"
            await asyncio.sleep(0.05)
        return results, seen

    results, seen = asyncio.run(scenario())
    assert [r.usage.completion_tokens for r in results] == [ANSWER] * REQUESTS
    # never more than the cap placed, nor running on the decode worker, while it lasted
    assert seen, "the watcher read no status"
    assert max(a["counted"] for a, _ in seen) <= CAP
    assert max(running for _, running in seen) <= CAP
