"""Replay the Azure 2023 code trace against a real daemon, in `agg` and `disagg` modes.

    .venv/bin/python bench/bench_trace.py [--engine torch] [--requests 150] [--prompt-scale 0.125]

The trace (../shared/traces/azure_llm_2023_code.csv; Patel et al., "Splitwise", ISCA
2024, CC-BY 4.0) is one hour of a production code-completion service: ~2.45 req/s,
mean prompt ~2,048 tokens, mean output ~28. Two CPU cores cannot serve that with a real
model, so it is scaled down, and the scaling is printed with the results: a window of
--requests consecutive requests, prompts multiplied by --prompt-scale, inter-arrival
times multiplied by --time-scale. Prompts are random token ids of the scaled length;
outputs are forced to the trace's length (ignore_eos), so both modes do the same work.

TTFT is measured to the first streamed byte of text; ITL per request is
(last token time - first token time) / (tokens - 1), reported as p50/p99 over requests.
Bounded: at most --requests requests per mode, each with a timeout.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import signal
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import aiohttp

from daemon_process import ROOT, pct, start_daemon
TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_code.csv"


def load_trace(path: Path, start: int, count: int) -> list[tuple[float, int, int]]:
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            t = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    rows = rows[start:start + count]
    t0 = rows[0][0]
    return [(t - t0, p, o) for t, p, o in rows]


async def replay(url: str, model: str, trace, prompt_scale: float, time_scale: float,
                 max_context: int, vocab: int, timeout: float) -> dict:
    rng = random.Random(0)
    ttft, itl, e2e, errors = [], [], [], 0
    start = time.perf_counter()

    async def one(session, at: float, prompt_len: int, out_len: int) -> None:
        nonlocal errors
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        n = max(1, min(int(prompt_len * prompt_scale), max_context - out_len - 1))
        ids = [rng.randrange(256, vocab) for _ in range(n)]
        body = {"model": model, "prompt": ids, "max_tokens": out_len, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        try:
            async with session.post(url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    errors += 1
                    return
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    if b'"choices":[]' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                        continue
                    if first is None:
                        first = now
                    last = now
        except (aiohttp.ClientError, asyncio.TimeoutError):
            errors += 1
            return
        if first is None:
            errors += 1
            return
        ttft.append(first - t0)
        e2e.append(last - t0)
        if tokens > 1:
            itl.append((last - first) / (tokens - 1))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, at * time_scale, p, o) for at, p, o in trace))
    wall = time.perf_counter() - start
    ms = lambda v: round(1000 * v, 1)
    return {"requests": len(trace), "errors": errors, "wall_s": round(wall, 1),
            "ttft_p50_ms": ms(pct(ttft, .5)), "ttft_p99_ms": ms(pct(ttft, .99)),
            "itl_p50_ms": ms(pct(itl, .5)), "itl_p99_ms": ms(pct(itl, .99)),
            "e2e_p50_ms": ms(pct(e2e, .5)), "e2e_p99_ms": ms(pct(e2e, .99))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="torch", choices=["torch", "sim"])
    p.add_argument("--devices", default="cpu")
    p.add_argument("--model", help="checkpoint dir (default: the generated tiny model)")
    p.add_argument("--start", type=int, default=0, help="first trace row")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--prompt-scale", type=float, default=0.125)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--vocab", type=int, default=4096, help="prompt token ids are drawn below this")
    p.add_argument("--modes", default="agg,disagg")
    p.add_argument("--config", help="a config.toml for the daemons (e.g. prefill_chunk_tokens)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "trace.json"))
    args = p.parse_args()
    trace = load_trace(TRACE, args.start, args.requests)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            state = Path(tmp) / mode
            state.mkdir()
            extra = ["--model", args.model] if args.model else []
            if args.config:
                extra += ["--config", str(Path(args.config).resolve())]
            proc, url = start_daemon(state, ["--engine", args.engine, "--devices", args.devices,
                                             "--mode", mode, *extra])
            try:
                with urllib.request.urlopen(url + "/v1/models") as r:
                    info = json.load(r)["data"][0]
                results[mode] = asyncio.run(replay(
                    url, info["id"], trace, args.prompt_scale, args.time_scale,
                    info["max_model_len"], args.vocab, args.timeout))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    prompts = [int(p * args.prompt_scale) for _, p, _ in trace]
    outs = [o for _, _, o in trace]
    span = trace[-1][0] * args.time_scale
    summary = {"trace": str(TRACE.name), "rows": [args.start, args.start + len(trace)],
               "prompt_scale": args.prompt_scale, "time_scale": args.time_scale,
               "offered_req_per_s": round(len(trace) / span, 2) if span else None,
               "mean_prompt_tokens": round(sum(prompts) / len(prompts)),
               "mean_output_tokens": round(sum(outs) / len(outs), 1),
               "engine": args.engine, "results": results, "date": time.strftime("%Y-%m-%d"),
               "config": Path(args.config).read_text() if args.config else ""}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"trace rows {args.start}..{args.start + len(trace)}, offered "
          f"{summary['offered_req_per_s']} req/s, mean prompt {summary['mean_prompt_tokens']} "
          f"tokens (x{args.prompt_scale}), mean output {summary['mean_output_tokens']}, "
          f"engine {args.engine}\n")
    print("| mode | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['itl_p50_ms']} | "
              f"{r['itl_p99_ms']} | {r['errors']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
