"""How fast this CPU streams a decode step's weights: the floor under a decode step's ITL.

A decode step of a small batch multiplies every layer weight by a few rows, so it reads
all the weights once per step and its time is bound by how fast they stream from DRAM,
not by FLOPs. This times, per torch thread count:

- a plain read of `--mb` MB of bf16 (`sum`): what the memory system gives one op;
- the engine's own packed `Linear` (oneDNN, `engines/layers/linear.py`) over the same
  bytes of bf16 weights shaped like the 82m model's (768 x 3,072), at B rows;

best of `--repeats` passes, each pass all the weights once (so the caches hold none of
them between passes: `--mb` is well above any L3). The gap between the two lines is the
headroom a better GEMV kernel would have; the `Linear` line at B = 8 is the fastest a
decode step of 8 sequences can be with the kernels torch ships (docs/benchmarks.md,
"Against vLLM's CPU build", for what it means for issue 26's goal).

    .venv/bin/python bench/bench_weight_stream.py                 # threads 1 and 2, ~20 s
    .venv/bin/python bench/bench_weight_stream.py --threads 1,2,4 --batches 1,8,32
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from appliance.engines.layers.linear import Linear  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()                                        # warm: page faults, oneDNN primitive cache
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=160, help="weights (and the plain read), MB of bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    out_f, in_f = 768, 3072                     # the 82m model's down projection's shape
    per = out_f * in_f * 2
    n = max(1, args.mb * 1_000_000 // per)
    g = torch.Generator().manual_seed(0)
    layers = [Linear(torch.randn(out_f, in_f, generator=g).to(torch.bfloat16)) for _ in range(n)]
    if layers[0].packed is None:
        sys.exit("bench_weight_stream: this torch build has no oneDNN bf16 linear; nothing to time")
    flat = torch.randn(n * per // 2, generator=g).to(torch.bfloat16)
    total = n * per
    print(f"{n} weights of {out_f} x {in_f} bf16 = {total / 1e6:.0f} MB")
    print("| threads | what | ms per pass | GB/s |")
    print("|---:|---|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        dt = best_of(lambda: flat.sum(), args.repeats)
        print(f"| {threads} | plain read (sum) | {dt * 1e3:.1f} | {total / dt / 1e9:.1f} |")
        for b in (int(x) for x in args.batches.split(",")):
            x = torch.randn(b, in_f, generator=g).to(torch.bfloat16)
            dt = best_of(lambda: [lin(x) for lin in layers], args.repeats)
            print(f"| {threads} | packed Linear, B = {b} | {dt * 1e3:.1f} | {total / dt / 1e9:.1f} |")


if __name__ == "__main__":
    main()
