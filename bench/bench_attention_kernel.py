"""The decode-attention C kernel alone (`cpu_kernels.PagedDecode`), from memory.

Why alone: in a decode step the kernel's time mixes with the matmuls' and the glue's,
and a change to how it reads the pool (prefetching, layout) moves the step by less than
the machine's noise. Here B sequences of `--context` positions sit in scattered 16-token
blocks of 12 separate layer pools (the 82m shape: 12 query heads, 4 KV heads, head_dim
64), so every call reads K and V from memory as a step's would, not from cache.

With `--against OLD.c`, the kernel is built from that source too and the two run
alternately, 15 rounds each; the output says whether both wrote the same bytes.

    .venv/bin/python bench/bench_attention_kernel.py                 # B = 8, 32
    git show REV:appliance/engines/cpu_kernels/paged_decode.c > /tmp/old.c
    taskset -c 1 .venv/bin/python bench/bench_attention_kernel.py --against /tmp/old.c
    taskset -c 1 .venv/bin/python bench/bench_attention_kernel.py --layers 1 --batches 4   # in cache
    taskset -c 1 .venv/bin/python bench/bench_attention_kernel.py --contiguous    # blocks in order
    taskset -c 1 .venv/bin/python bench/bench_attention_kernel.py --small-pages   # 4 KB pages
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

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16


def pool(blocks: int, small_pages: bool) -> torch.Tensor:
    """One layer's K or V pool of random values: on memory advised for huge pages, as a
    decode worker's pool is (`cpu_kernels.huge_page_zeros`), or with `small_pages` where
    torch's allocator puts it (4 KB pages unless THP is `always`; /dev/shm's pages, where
    every worker's pool lay before session 38)."""
    values = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    if small_pages:
        return values
    out = cpu_kernels.huge_page_zeros(values.numel(), torch.bfloat16).view(values.shape)
    return out.copy_(values)


def run(kernels: dict[str, cpu_kernels.PagedDecode], batch: int, context: int,
        rounds: int, layers: int = 12, contiguous: bool = False,
        small_pages: bool = False) -> None:
    torch.manual_seed(0)
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq + 8
    pools = [(pool(blocks, small_pages), pool(blocks, small_pages)) for _ in range(layers)]
    ids = torch.arange(batch * per_seq) if contiguous else torch.randperm(blocks)[:batch * per_seq]
    tables = ids.view(batch, per_seq).contiguous()
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    ctx = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.zeros(batch, dtype=torch.int32)
    scratch = torch.empty(HEADS * context, dtype=torch.float32)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            out = torch.empty_like(q)
            t0 = time.perf_counter()
            for k, v in pools:
                kernel(q, k, v, tables, ctx, starts, HEAD_DIM ** -0.5, scratch, out)
            times[name].append(time.perf_counter() - t0)
            outs[name] = out
    nbytes = layers * 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    first = next(iter(outs.values()))
    for name, ts in times.items():
        med = statistics.median(ts)
        same = "" if len(outs) == 1 else f", output equal to the first: {torch.equal(outs[name], first)}"
        print(f"B={batch:3d} context {context}: {name:8s} {med * 1e3:6.2f} ms per step "
              f"({layers} layers), {nbytes / med / 1e9:5.1f} GB/s{same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--against", type=Path, help="another paged_decode.c to compare with")
    ap.add_argument("--layers", type=int, default=12,
                    help="layer pools (1 with a small batch: the pools stay in cache, so the "
                         "kernel's own rate without memory's)")
    ap.add_argument("--contiguous", action="store_true",
                    help="each sequence's blocks consecutive in the pool (default: scattered)")
    ap.add_argument("--small-pages", action="store_true",
                    help="pools where torch allocates them (default: on memory advised for "
                         "huge pages, as a decode worker's pool)")
    args = ap.parse_args()
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"here": cpu_kernels.load_paged_decode(tmp)}
        if args.against:
            kernels["against"] = build_against(args.against, Path(tmp), cpu_kernels.PagedDecode)
        for b in args.batches.split(","):
            run(kernels, int(b), args.context, args.rounds, args.layers, args.contiguous,
                args.small_pages)


if __name__ == "__main__":
    main()
