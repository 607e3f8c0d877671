"""A finished request leaves nothing behind in the daemon.

The daemon's memory grew by ~35-65 KB a request (bench/bench_soak.py: 72 -> 265 MB in
5,506 requests): each `Completion` and its `Choice`s referred to each other, so a finished
request (its prompt's token ids above all) was freed only by a cyclic collection of the
generation it had reached, and the daemon's tuned collector (`tune_gc`) runs those rarely.
"""
from __future__ import annotations

import asyncio
import random

import aiohttp
import psutil
from helpers.daemons import start_daemon

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


async def _load(url: str, requests: int, concurrency: int, rng: random.Random) -> int:
    sem = asyncio.Semaphore(concurrency)
    ok = 0
    async with aiohttp.ClientSession() as s:
        async def one() -> None:
            nonlocal ok
            async with sem:
                words = rng.randint(1000, 1500)
                body = {"model": "llama-3.1-70b-fp8", "max_tokens": 8, "stream": True,
                        "messages": [{"role": "user", "content": " ".join(
                            rng.choice(WORDS) for _ in range(words))}]}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    data = await r.read()
                    ok += r.status == 200 and data.endswith(b"[DONE]\n\n")
        await asyncio.gather(*(one() for _ in range(requests)))
    return ok


def test_daemon_memory_levels_off_under_long_prompts(tmp_path):
    """A real daemon on a simulated 8xH100: after a warm-up, hundreds more requests of
    1,000-1,500-word prompts add well under the ~40 KB a request the leak cost."""
    d = start_daemon(tmp_path, None, "--devices", "sim:8xH100", "--model-spec",
                     "llama-3.1-70b-fp8", "--sim-speed", "20", timeout=300)
    try:
        daemon = psutil.Process(d.proc.pid)
        rng = random.Random(1)
        warm = 300
        assert asyncio.run(_load(d.url, warm, 32, rng)) == warm
        before = daemon.memory_info().rss
        more = 600
        assert asyncio.run(_load(d.url, more, 32, rng)) == more
        after = daemon.memory_info().rss
        per_request = (after - before) / more
        assert per_request < 12_000, f"RSS {before / 1e6:.1f} -> {after / 1e6:.1f} MB: " \
                                     f"{per_request / 1e3:.1f} KB a request"
    finally:
        d.stop()
