"""Where a client on the box runs, and what it costs applianced: aiperf against one daemon,
left where Linux puts it, pinned to the decode worker's core, and pinned to the prefill
worker's core, in turn (A B C A B C ...), so a slow stretch of the machine falls on all.

Why: on the 2-core layout both cores are nearly full at 8 clients, and they are not alike.
The prefill core is the bound (a prompt's FLOPs are what they are: ~0.19 s of the core for
256 tokens of the 82m model) and also runs the daemon; the decode core is elastic (a step
of more sequences costs little more than one of fewer, the weights stream once either
way). A client's CPU taken from the prefill core is prompts not computed; taken from the
decode core it is a few more sequences a step. This measures that, not applianced against
anything: docs/benchmarks.md ("Against vLLM's CPU build", session 28) for what it showed.

    .venv/bin/python bench/bench_client_placement.py --aiperf /path/to/aiperf          # ~6 min
    .venv/bin/python bench/bench_client_placement.py --aiperf PATH --shape qwen3 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_vllm as vs  # noqa: E402
from daemon_process import start_daemon  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", required=True, help="aiperf's script (in a venv of its own)")
    ap.add_argument("--shape", choices=("llama", "qwen3"), default="llama")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="per round: this many x C")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the rounds here")
    args = ap.parse_args()
    if not os.access(args.aiperf, os.X_OK):
        raise SystemExit(f"bench_client_placement: no aiperf at {args.aiperf}")
    model = vs.checkpoint(None, args.shape)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="client-placement-"))
    (tmp / "config.toml").write_text('[engine]\ndtype = "bfloat16"\n')
    proc, url = start_daemon(tmp, ["--model", str(model), "--engine", "torch",
                                   "--config", str(tmp / "config.toml")])
    try:
        workers = {w["worker"]: w for w in admin_status(url)["workers"]}
        prefill, decode = workers["prefill0"]["cpu_cores"], workers["decode0"]["cpu_cores"]
        if not prefill or not decode or set(prefill) & set(decode):
            raise SystemExit("bench_client_placement: the workers do not have cores of their "
                             f"own here (prefill {prefill}, decode {decode})")
        places = {"where Linux puts it": ("free", None), "on the decode core": ("decode", decode),
                  "on the prefill core": ("prefill", prefill)}
        C = args.concurrency
        asyncio.run(vs.cell(url, model.name, C, 2 * C, 256, 64, vocab, seed=3))   # warm-up
        rounds: dict[str, list[dict]] = {name: [] for name in places}
        for r in range(args.rounds):
            for name, (key, cores) in places.items():
                wrapper = tmp / f"aiperf-{key}"
                pin = f"taskset -c {','.join(map(str, cores))} " if cores else ""
                wrapper.write_text(f'#!/bin/sh\nexec {pin}{args.aiperf} "$@"\n')
                wrapper.chmod(0o755)
                a = vs.run_aiperf(str(wrapper), url, model, C, C * args.requests, 256, 64,
                                  tmp / f"run-{r}-{key}", ["--request-rate", "100"], proc)
                if a is None:
                    raise SystemExit("bench_client_placement: aiperf failed (see above)")
                rounds[name].append(a)
                print(f"round {r + 1}, aiperf {name}: {a['req_s']:.2f} req/s, TTFT p50 "
                      f"{a['ttft_p50_s']:.2f} s, ITL p50 {a['itl_p50_ms']:.1f} ms, "
                      f"{a['cpu_s_per_req']:.3f} CPU s/request, aiperf took "
                      f"{a['client_cores']:.2f} cores", flush=True)
        print(f"\n{model.name}, C = {C}, aiperf paced (--request-rate 100), medians of "
              f"{args.rounds} rounds")
        print("| aiperf runs | req/s | TTFT p50 | ITL p50 | CPU s/request |")
        print("|---|---:|---:|---:|---:|")
        for name, got in rounds.items():
            med = {k: statistics.median(a[k] for a in got)
                   for k in ("req_s", "ttft_p50_s", "itl_p50_ms", "cpu_s_per_req")}
            print(f"| {name} | {med['req_s']:.2f} | {med['ttft_p50_s']:.2f} s | "
                  f"{med['itl_p50_ms']:.1f} ms | {med['cpu_s_per_req']:.3f} |")
        if args.json:
            args.json.write_text(json.dumps({"model": model.name, "concurrency": C,
                                             "rounds": rounds}, indent=1))
    finally:
        vs.stop(proc)


def admin_status(url: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(url + "/admin/v1/status", timeout=30) as r:
        return json.loads(r.read())


if __name__ == "__main__":
    main()
