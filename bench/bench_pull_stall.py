"""What a cross-box KV pull costs the streams already decoding on the decode worker: the
time between two tokens of each running stream (ITL) while long prompts are handed over
from another box, against the same streams' ITL with no pull in flight.

One process, two torch engines on the generated tiny model, each with its own NIXL
agent (the decode box's and the prefill box's workers; NIXL moves between two agents
the same way within a process as between two): the prefill engine prefills
`--handoffs` prompts of `--tokens` tokens up front; the decode engine decodes
`--running` greedy streams and is handed one of those prompts every `--every` steps
(2 output tokens each), its KV pulled with a NIXL READ. A token gap of a running stream
counts as "during a pull" when a handoff was between its Decode message and its
KvImported event at any time within the gap. `--tcp` runs UCX over loopback TCP (the
path of two boxes without RDMA; UCX's own choice on one host is shared memory).
Loopback, one host: no network is measured.

Before/after: the code under test is the checkout this script is in, or the one
APPLIANCE_SRC names (e.g. a `git worktree` of the commit before the asynchronous pull,
whose decode worker pulls inside its engine step). ~1 min each on this 2-core machine:

    .venv/bin/python bench/bench_pull_stall.py --tcp      # -> bench/results/pull_stall.json
    git worktree add /tmp/before 040e9de && APPLIANCE_SRC=/tmp/before \\
        .venv/bin/python bench/bench_pull_stall.py --tcp --out bench/results/pull_stall_before.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("APPLIANCE_SRC") or str(HERE.parent))


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(args) -> dict:
    if args.tcp:
        os.environ["UCX_TLS"] = "tcp"
    from appliance.engines.messages import (
        Decode, KvHandle, KvImported, Prefill, PrefillDone, RemoteKv, SamplingParams, Tokens)
    from appliance.engines.torch_engine import build_torch_engine
    from appliance.kv.nixl_transport import NixlKvHandle, to_json
    from appliance.models.tiny import init_tiny
    from appliance.worker.spec import WorkerSpec

    model = init_tiny(Path(tempfile.mkdtemp(prefix="pull-stall-")) / "tiny-llama", seed=0)
    pool = (args.handoffs + 2) * args.tokens * 4096 * 2 + (64 << 20)

    def engine(name, role):
        return build_torch_engine(WorkerSpec(name, role, "torch", ["cpu0"], "cpu", str(model),
                                             kv_cache_bytes=pool, nixl=True), model)

    pre, dec = engine("prefill0", "prefill"), engine("decode0", "decode")
    info_json = pre.hello_info()["nixl_pool"]
    info = json.loads(info_json)
    short = SamplingParams(max_tokens=2, temperature=0.0)

    def handed(rid: str, n: int) -> Decode:
        prompt = [(7 * i + sum(map(ord, rid))) % 900 + 5 for i in range(n)]
        out = pre.add(Prefill(rid, prompt, short, True))
        while pre.has_work():
            out += pre.step()
        done = next(e for e in out if isinstance(e, PrefillDone))
        h = done.handle
        nh = NixlKvHandle(info["agent"], info["pool_id"], rid, tuple(h.block_ids),
                          h.num_tokens, time.time() + 600)
        kv = KvHandle(f"peer:{info['agent']}", rid, h.block_ids, h.num_tokens, h.layout,
                      payload=RemoteKv(info_json, to_json(nh)),
                      expires_at=time.monotonic() + 600)
        return Decode(rid, prompt, done.first_token, short, kv)

    warm = handed("warm", 64)
    orders = [handed(f"h{i}", args.tokens) for i in range(args.handoffs)]

    # The running streams, then one small handoff (the first read from a peer connects).
    steps = args.every * (args.handoffs + 2)
    long = SamplingParams(max_tokens=steps + 50, temperature=0.0, ignore_eos=True)
    for r in range(args.running):
        dec.add(Prefill(f"run{r}", [100 + r + i for i in range(32)], long, False))
    out = dec.add(warm)
    while not any(isinstance(e, KvImported) for e in out):
        out += dec.step()

    last: dict[str, float] = {}
    gaps: list[tuple[float, float, float]] = []      # (start, end, seconds)
    windows: list[list[float]] = []                  # [Decode added, KvImported seen]
    open_: dict[str, list[float]] = {}
    pulls: list[float] = []
    for i in range(steps):
        if i % args.every == args.every - 1 and orders:
            msg = orders.pop(0)
            open_[msg.request_id] = [time.perf_counter(), float("inf")]
            windows.append(open_[msg.request_id])
            dec.add(msg)
        events = dec.step()
        now = time.perf_counter()
        for e in events:
            if isinstance(e, KvImported) and e.request_id in open_:
                open_.pop(e.request_id)[1] = now
                pulls.append(e.seconds)
            elif isinstance(e, Tokens) and e.request_id.startswith("run"):
                if e.request_id in last:
                    gaps.append((last[e.request_id], now, now - last[e.request_id]))
                last[e.request_id] = now
    for rid in list(last):
        dec.abort(rid)
    during = [g for s, e, g in gaps if any(a < e and s < b for a, b in windows)]
    quiet = [g for s, e, g in gaps if not any(a < e and s < b for a, b in windows)]

    def ms(xs, q):
        return round(quantile(xs, q) * 1000, 2)
    return {
        "code": os.environ.get("APPLIANCE_SRC") or "this checkout",
        "transport": "UCX tcp (loopback)" if args.tcp else "UCX auto (shared memory)",
        "prompt_tokens": args.tokens, "kv_mib_per_pull": round(args.tokens * 4096 / 2**20, 1),
        "running": args.running, "handoffs": args.handoffs - len(orders),
        "pulled": len(pulls), "pull_ms_median": ms(pulls, 0.5),
        "itl_quiet_ms": {"median": ms(quiet, 0.5), "p90": ms(quiet, 0.9), "n": len(quiet)},
        "itl_during_pull_ms": {"median": ms(during, 0.5), "p90": ms(during, 0.9),
                               "max": ms(during, 1.0), "n": len(during)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3072, help="prompt tokens per handoff (the tiny model: < 4096)")
    ap.add_argument("--handoffs", type=int, default=6)
    ap.add_argument("--running", type=int, default=4, help="streams decoding meanwhile")
    ap.add_argument("--every", type=int, default=10, help="steps between handoffs")
    ap.add_argument("--tcp", action="store_true", help="UCX over loopback TCP")
    ap.add_argument("--out", default=str(HERE / "results" / "pull_stall.json"))
    args = ap.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
