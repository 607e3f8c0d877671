"""Fair queuing under a flood (issue 27 §1): a polite tenant's time to first token alone
and while another tenant floods the box, with fair queuing on and off.

The scenario of the issue: `sim:2xH100` (one prefill and one decode worker),
`llama-3.1-70b-fp8`. The polite tenant sends 4 short chat prompts at a time (streamed;
TTFT is the first content chunk); the flooding tenant keeps FLOOD long prompts (8,000
token ids, ~6,000 words) in flight. Reported per mode: the polite tenant's TTFT p50/p90
alone and under the flood (and their ratio: the goal is <= 3x), and the flood's
throughput (prompt tokens per second completed) alone and with the polite tenant
beside it, against the share the polite tenant's own work leaves it.

Times are simulated GPU time (the simulator's roofline), served by the real daemon
over HTTP; at --speed 1 the simulated box runs in real time. Two TTFTs are reported:
the client's, on the wall clock (`ttft_*`: what a client of this simulated box sees,
the daemon's own latency included, and stretched by whatever else loads the machine
running the simulation), and the simulated one (`sim_ttft_*`: each request's
`simulated_ttft_s`, from its `--log-requests` record: the simulated prefill device's
time from the request's arrival at the worker to its first token), which says what the
schedulers did whatever the machine's load.

    .venv/bin/python bench/bench_fairness.py        # real time; off ~5 min (a round waits ~100 s), on ~2 min
    .venv/bin/python bench/bench_fairness.py --speed 4 --rounds 6 --warmup 3 --flood-seconds 8
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_process import pct, start_daemon  # noqa: E402

POLITE_KEY, FLOOD_KEY = "sk-polite", "sk-flood"
MODEL = "llama-3.1-70b-fp8"


def config(fair: bool) -> str:
    digest = lambda k: hashlib.sha256(k.encode()).hexdigest()    # noqa: E731
    return (f'[engine]\nfair_queuing = {"true" if fair else "false"}\n'
            f'[auth.keys]\n"{digest(POLITE_KEY)}" = "polite"\n"{digest(FLOOD_KEY)}" = "flood"\n'
            '[tenants.polite]\nweight = 1\n[tenants.flood]\nweight = 1\n')


def simulated_ttfts(log: str, tenant: str, t0: float, t1: float) -> list[float]:
    """The simulated times to first token (`simulated_ttft_s`: on the simulated prefill
    device's clock, from the request's arrival at its worker) of `tenant`'s requests that
    arrived at the daemon in [t0, t1] (time.time()), from the `--log-requests` lines of
    the daemon's log. The machine's load and the daemon's own latency do not stretch them:
    they say what the scheduler did, where the wall-clock TTFT also says how busy the
    machine running the simulation was."""
    out = []
    for line in log.splitlines():
        if line.startswith("{") and '"simulated_ttft_s"' in line:
            rec = json.loads(line)
            if (rec["tenant"] == tenant and t0 <= rec["arrival"] <= t1
                    and rec["simulated_ttft_s"] is not None):
                out.append(rec["simulated_ttft_s"])
    return out


async def polite_round(client, n: int, max_tokens: int) -> list[float]:
    """n concurrent short prompts; each one's seconds to its first content chunk."""
    async def one(i: int) -> float:
        t0 = time.perf_counter()
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question {i}: what is the "
                                    "capital of France, in one word?"}],
            max_tokens=max_tokens, stream=True)
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
        return ttft if ttft is not None else time.perf_counter() - t0
    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def polite(client, rounds: int, n: int, max_tokens: int, pause: float,
                 seconds: float = 0.0, limit: float = float("inf"),
                 jitter: float = 0.0, seed: int = 0) -> list[float]:
    """`rounds` rounds and rounds for at least `seconds`, but no round started after
    `limit` seconds (without fair queuing one round waits for the whole flood). Between
    rounds `pause` seconds and up to `jitter` more (seeded): rounds paced by the answers
    alone can fall into step with the flood's prefill steps, and then always find the
    step under way at the same point."""
    out: list[float] = []
    rng = random.Random(seed)
    t0 = time.monotonic()
    done = 0
    while (done < rounds or time.monotonic() < t0 + seconds) and (
            done == 0 or time.monotonic() < t0 + limit):
        out += await polite_round(client, n, max_tokens)
        done += 1
        await asyncio.sleep(pause + rng.uniform(0, jitter))
    return out


class Flood:
    """FLOOD concurrent long prompts, each sent again as soon as it finishes, from a
    process of its own (building and parsing its requests must not delay the polite
    tenant's client, whose times are the measurement). Each prompt differs from the
    others in its first tokens, so the prefix cache saves the flood nothing."""

    def __init__(self, url: str, concurrency: int, tokens: int, max_tokens: int):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(target=_flood_process, daemon=True, args=(
            url, concurrency, tokens, max_tokens, self.results, self.stop_event))
        self.done: list[tuple[float, int]] = []          # (time.monotonic() at finish, tokens)
        self.errors = 0

    def start(self) -> None:
        self.proc.start()

    def _drain(self) -> None:
        import queue
        while True:
            try:
                item = self.results.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self.errors += 1
            else:
                self.done.append(item)

    def stop(self) -> None:
        self.stop_event.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self._drain()

    def rate(self, t0: float, t1: float) -> float:
        """Prompt tokens per second completed in [t0, t1] (time.monotonic())."""
        self._drain()
        return sum(n for t, n in self.done if t0 <= t <= t1) / max(1e-9, t1 - t0)


def _flood_process(url, concurrency, tokens, max_tokens, results, stop_event) -> None:
    import openai
    rng = random.Random(0)
    base = [rng.randrange(10, FLOOD_VOCAB) for _ in range(tokens)]
    counter = iter(range(10 ** 9))

    async def loop(client) -> None:
        while not stop_event.is_set():
            n = next(counter)
            prompt = [10 + n % 997, 10 + n // 997 % 997, 10 + n // 994009 % 997] + base[3:]
            try:
                r = await client.completions.create(model=MODEL, prompt=prompt,
                                                    max_tokens=max_tokens)
                results.put((time.monotonic(), r.usage.prompt_tokens))
            except Exception:        # counted, and the flood goes on
                results.put(None)
                await asyncio.sleep(0.5)

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=FLOOD_KEY, max_retries=0,
                                    timeout=600)
        tasks = [asyncio.create_task(loop(client)) for _ in range(concurrency)]
        while not stop_event.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


# Token ids the flood draws from: inside any served tokenizer's vocabulary.
FLOOD_VOCAB = 1000


async def run_mode(url: str, args, log: Path) -> dict:
    import openai
    mk = lambda key: openai.AsyncOpenAI(base_url=url + "/v1", api_key=key,   # noqa: E731
                                        max_retries=0, timeout=600)
    pc = mk(POLITE_KEY)
    await polite(pc, 2, args.polite, args.polite_tokens, 0.05)        # warm-up
    a0 = time.time()
    alone = await polite(pc, args.rounds, args.polite, args.polite_tokens, args.pause)
    a1 = time.time()
    flood = Flood(url, args.flood, args.flood_tokens, args.flood_max_tokens)
    flood.start()
    deadline = time.monotonic() + 300         # its process starts, then its prompts queue
    while not flood.done and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        flood._drain()
    await asyncio.sleep(args.warmup)
    t0 = time.monotonic()
    await asyncio.sleep(args.flood_seconds)
    t1 = time.monotonic()
    b0 = time.time()
    busy = await polite(pc, args.rounds, args.polite, args.polite_tokens, args.pause,
                        args.flood_seconds, args.limit)
    b1 = time.time()
    t2 = time.monotonic()
    flood.stop()
    text = log.read_text(errors="replace")
    sim_alone = simulated_ttfts(text, "polite", a0, a1)
    sim_busy = simulated_ttfts(text, "polite", b0, b1)
    return {"ttft_alone_p50_ms": 1e3 * pct(alone, 0.5), "ttft_alone_p90_ms": 1e3 * pct(alone, 0.9),
            "ttft_flood_p50_ms": 1e3 * pct(busy, 0.5), "ttft_flood_p90_ms": 1e3 * pct(busy, 0.9),
            "ttft_ratio_p50": pct(busy, 0.5) / pct(alone, 0.5),
            "sim_ttft_alone_p50_ms": 1e3 * pct(sim_alone, 0.5),
            "sim_ttft_flood_p50_ms": 1e3 * pct(sim_busy, 0.5),
            "sim_ttft_flood_p90_ms": 1e3 * pct(sim_busy, 0.9),
            "sim_ttft_ratio_p50": pct(sim_busy, 0.5) / pct(sim_alone, 0.5),
            "flood_tok_s_alone": flood.rate(t0, t1), "flood_tok_s_with_polite": flood.rate(t1, t2),
            "flood_errors": flood.errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", type=float, default=1.0, help="simulated time speed-up (1: real time)")
    ap.add_argument("--rounds", type=int, default=15, help="polite rounds per phase")
    ap.add_argument("--polite", type=int, default=4, help="polite prompts at a time")
    ap.add_argument("--polite-tokens", type=int, default=8)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between polite rounds")
    ap.add_argument("--flood", type=int, default=96, help="flood prompts in flight")
    ap.add_argument("--flood-tokens", type=int, default=8000, help="tokens per flood prompt")
    ap.add_argument("--flood-max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=5.0, help="flood seconds before measuring")
    ap.add_argument("--flood-seconds", type=float, default=20.0,
                    help="seconds of flood alone (its throughput), then at least as long "
                         "with the polite rounds beside it")
    ap.add_argument("--limit", type=float, default=120.0,
                    help="start no polite round under the flood after this many seconds")
    ap.add_argument("--modes", default="off,on", help="fair queuing off,on")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp)
            cfg = state / "config.toml"
            cfg.write_text(config(mode == "on"))
            proc, url = start_daemon(state, ["--devices", "sim:2xH100", "--model-spec", MODEL,
                                             "--sim-speed", str(args.speed), "--config", str(cfg),
                                             "--log-requests"])
            try:
                results[mode] = asyncio.run(run_mode(url, args, state / "daemon.log"))
            finally:
                proc.terminate()
                proc.wait(30)
        print(f"fair queuing {mode}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in results[mode].items()), flush=True)
    if args.json:
        print(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
