"""The decode matmul C kernel alone (`cpu_kernels.LinearBf16`), streaming a model's weights.

Why alone: a change to how the kernel reads its weight stream (prefetching, tile order)
moves a decode step by a few percent, less than this host's noise between runs (its clock
swung 1.7-2.7 GHz within seconds on a busy day). Here every weight of the 82m model's
layers (12 x qkv, o, gate/up, down: 151 MB of bf16, so no cache holds them) is multiplied
by M rows once per pass, the way a decode step's layers do.

With `--against OLD.c`, the kernel is built from that source too and the two run
alternately, pass by pass in one process, so a slow stretch of the machine falls on both;
the output says whether both wrote the same bytes. `--helper-core N` lets each build's
helper thread (linear_bf16.c) take part from core N, only the measured build's awake.

    .venv/bin/python bench/bench_linear_kernel.py                   # M = 1, 8, 32
    git show REV:appliance/engines/cpu_kernels/linear_bf16.c > /tmp/old.c
    taskset -c 1 .venv/bin/python bench/bench_linear_kernel.py --against /tmp/old.c
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from appliance.engines import cpu_kernels  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from kernel_build import build_against  # noqa: E402

# (out, in) of one layer of the 82m model: fused qkv, o, fused gate/up, down
LAYER = ((1280, 768), (768, 768), (4096, 768), (768, 2048))
LAYERS = 12


def run(kernels: dict[str, cpu_kernels.LinearBf16], rows: int, rounds: int,
        helper: int) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = list(LAYER) * LAYERS
    first = next(iter(kernels.values()))
    weights = [first.pack(torch.randn(n, k, generator=g).to(torch.bfloat16)) for n, k in shapes]
    nbytes = sum(w.numel() * 2 for w in weights)
    xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for _, k in LAYER}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    outs: dict[str, list[torch.Tensor]] = {}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            if helper >= 0:
                for other in kernels.values():
                    other.helper_spin(other is kernel)
                time.sleep(0.002)
            t0 = time.perf_counter()
            ys = [kernel(w, n, xs[k], None) for (n, k), w in zip(shapes, weights)]
            times[name].append(time.perf_counter() - t0)
            outs[name] = ys
    base = next(iter(outs.values()))
    base_t = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        med = statistics.median(ts)
        same = "" if len(outs) == 1 else (
            f", x{base_t / med:.2f} of the first, output equal to the first: "
            f"{all(torch.equal(a, b) for a, b in zip(outs[name], base))}")
        print(f"M={rows:3d}: {name:8s} {med * 1e3:6.2f} ms per pass ({nbytes / 1e6:.0f} MB), "
              f"{nbytes / med / 1e9:5.1f} GB/s{same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--against", type=Path, help="another linear_bf16.c to compare with")
    ap.add_argument("--helper-core", type=int, default=-1,
                    help="start each build's helper thread on this core")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"here": cpu_kernels.load_linear_bf16(tmp)}
        if args.against:
            kernels["against"] = build_against(args.against, Path(tmp), cpu_kernels.LinearBf16)
        if args.helper_core >= 0:
            for kernel in kernels.values():
                if not kernel.start_helper(args.helper_core):
                    sys.exit(f"bench_linear_kernel: no helper thread on core {args.helper_core}")
                kernel.helper_spin(False)
        print(f"AMX path: {kernels['here'].amx}")
        for rows in args.rows.split(","):
            run(kernels, int(rows), args.rounds, args.helper_core)


if __name__ == "__main__":
    main()
