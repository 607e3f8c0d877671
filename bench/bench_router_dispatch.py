"""What the router costs the event loop per request (issue 27 §1: the router's fair
queue must keep the fast path cheap). In-process, no daemon and no worker processes:
the real `Router` and `WorkerLink`s, each worker answering a Prefill with one finishing
token on the next loop turn. The figure is the whole request through
`Router.generate` (gate, placement, channel, bookkeeping), the best of 5 passes.

- `fast, 1 tenant`: 64 requests in flight, workers never saturated (the fast path).
- `fast, 8 tenants`: the same, eight tenants.
- `saturated, 2 tenants`: `max_seqs = 4` per worker, 64 in flight: most requests wait
  in the router's fair queue (the slow path; absent before it existed).
- `placement`: the worker choice alone on the fast path (before the router's fair
  queue: the least-queued ready worker; with it: the same, checked for room, after a
  test that nobody waits), best of 15 passes of 200,000. The whole-request figures
  move by more than this on a shared machine; this one is the added cost itself.

    .venv/bin/python bench/bench_router_dispatch.py            # ~20 s
    PYTHONPATH=/path/to/an/older/checkout .venv/bin/python bench/bench_router_dispatch.py
"""
from __future__ import annotations

import asyncio
import json
import time

from appliance.daemon.router import Router, Trace
from appliance.daemon.workers import WorkerPool
from appliance.engines.messages import Prefill, SamplingParams, Tokens
from appliance.worker.spec import WorkerSpec

N = 20_000          # requests per pass
INFLIGHT = 64


def make_router(workers: int, max_seqs: int) -> Router:
    specs = [WorkerSpec(worker=f"agg{i}", role="agg", engine="sim", devices=[f"sim{i}"],
                        device_kind="sim", model_dir="/nonexistent", max_seqs=max_seqs)
             for i in range(workers)]
    pool = WorkerPool(specs)
    loop = asyncio.get_running_loop()
    for w in pool.workers.values():
        w.state = "ready"

        def send(msg, w=w):
            if isinstance(msg, Prefill):
                ch = w.channels.get(msg.request_id)
                if ch is not None:
                    loop.call_soon(ch.put, Tokens(msg.request_id, [7], "length"))
        w.send = send
    return Router(pool, "agg")


async def one_pass(router: Router, tenants: list[str], n: int) -> float:
    params = SamplingParams(max_tokens=1)
    prompt = [1] * 64
    counter = iter(range(n))

    async def client(k: int) -> None:
        tenant = tenants[k % len(tenants)]
        for i in counter:
            async for _ in router.generate(Trace(f"r{i}", 0.0), prompt, params, tenant):
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(INFLIGHT)))
    return (time.perf_counter() - t0) / n * 1e6


async def measure(workers: int, max_seqs: int, tenants: list[str], repeats: int = 5) -> float:
    router = make_router(workers, max_seqs)
    await one_pass(router, tenants, 2000)                 # warm-up
    return min([await one_pass(router, tenants, N) for _ in range(repeats)])


def placement(repeats: int = 15, n: int = 200_000) -> float:
    async def run() -> float:
        router = make_router(2, 256)
        if hasattr(router, "dispatch"):
            from appliance.daemon.dispatch import pick_with_room

            def choose():
                if not router.dispatch.queue:
                    return pick_with_room(router._first(), 64)
        else:
            from appliance.routing import least_queued

            def choose():
                return least_queued(router._ready(router.agg, "aggregated"))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                choose()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best
    return asyncio.run(run())


def main() -> None:
    rows = {
        "placement": placement(),
        "fast, 1 tenant": asyncio.run(measure(2, 256, ["a"])),
        "fast, 8 tenants": asyncio.run(measure(2, 256, [f"t{i}" for i in range(8)])),
        "saturated, 2 tenants": asyncio.run(measure(2, 4, ["flood", "polite"])),
    }
    for name, us in rows.items():
        print(f"{name:<24} {us:7.1f} us per request")
    print(json.dumps({k: round(v, 2) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
