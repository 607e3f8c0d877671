"""The fp32 decode kernels of a CPU without AVX-512 (`cpu_kernels.LinearF32`,
`PagedDecodeF32`) against the torch paths they replace, on the 82m model's shapes.

Matmuls: every weight of the 82m model's layers (12 x qkv, o, gate/up, down: 302 MB of
fp32, so no cache holds them) multiplied by M rows once per pass, as a decode step's layers
do, through the kernel and through oneDNN's packed fp32 linear (what a worker used before),
alternating pass by pass so a slow stretch of the machine falls on both.
Attention: one decode step's attention over 12 layers' pools (12 heads over 4 KV heads of
64, blocks of 16 scattered through a pool no cache holds), through the kernel and through
torch's path (`PagedAttention` without the kernel: gather the blocks, then SDPA).

    .venv/bin/python bench/bench_f32_kernels.py                     # M = 1, 4, 8, 16, 32, 64
    taskset -c 1 .venv/bin/python bench/bench_f32_kernels.py --rows 8 --contexts 320
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from appliance.engines import cpu_kernels  # noqa: E402
from appliance.engines.layers.attention import AttnBatch, PagedAttention  # noqa: E402
from appliance.models.shape import LlamaShape  # noqa: E402

LAYER = ((1280, 768), (768, 768), (4096, 768), (768, 2048))   # 82m: qkv, o, gate/up, down
LAYERS = 12


def best_of(fn, passes: int) -> float:
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmuls(kernel, rows: list[int], passes: int) -> None:
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=g) * 0.02 for _ in range(LAYERS) for n, k in LAYER]
    nbytes = sum(w.numel() for w in dense) * 4
    ours = [(kernel.pack(w), w.shape[0], w.shape[1]) for w in dense]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in dense]
    del dense
    print(f"matmuls: {LAYERS} layers of the 82m model, {nbytes / 1e6:.0f} MB fp32; "
          "best of each alternating pass, ms (GB/s of weights, GFLOPS)")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (768, 2048)}

        def run_kernel():
            for w, n, k in ours:
                kernel(w, n, xs[k], None)

        def run_onednn():
            for w in onednn:
                torch.ops.mkldnn._linear_pointwise(xs[w.size(1)], w, None, "none", [], "")
        a, b = [], []
        for _ in range(passes):
            a.append(best_of(run_kernel, 1))
            b.append(best_of(run_onednn, 1))
        ka, kb = min(a), min(b)
        flop = 2 * m * nbytes / 4
        print(f"  {m:3d} rows: kernel {ka * 1e3:6.1f} ms ({nbytes / ka / 1e9:4.1f} GB/s, "
              f"{flop / ka / 1e9:5.1f} GFLOPS)   oneDNN packed {kb * 1e3:6.1f} ms "
              f"({nbytes / kb / 1e9:4.1f} GB/s, {flop / kb / 1e9:5.1f} GFLOPS)   "
              f"x{kb / ka:.2f}   medians {statistics.median(a) * 1e3:.1f} / "
              f"{statistics.median(b) * 1e3:.1f}")


def attention(kernel, seqs: list[int], ctx: int, passes: int) -> None:
    heads, kv_heads, hd, bs = 12, 4, 64, 16
    shape = LlamaShape(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=768,
                       intermediate_size=64, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=hd, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                       tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       attention_sinks=False)
    print(f"attention: one decode step, {LAYERS} layers, 12 heads over 4 KV heads of 64, "
          f"contexts of {ctx}; best of each alternating pass, ms")
    for n in seqs:
        per = -(-ctx // bs)
        blocks = max(n * per, 2048)          # a pool bigger than the caches
        kvs = [torch.randn(2, 1, blocks, bs, kv_heads, hd) for _ in range(LAYERS)]
        free = list(range(blocks))
        random.Random(n).shuffle(free)
        tables = [[free.pop() for _ in range(per)] for _ in range(n)]
        batch = AttnBatch(False, [1] * n, [ctx] * n, tables, torch.zeros(n, dtype=torch.long))
        q = torch.randn(n, heads, hd)
        engines = {}
        for name, k in (("kernel", kernel), ("torch", None)):
            attn = PagedAttention(shape, torch.device("cpu"), torch.float32)
            attn.set_decode_kernel(k)
            engines[name] = attn

        def step(attn):
            plan = attn.begin(batch, n, kvs[0])
            for kv in kvs:
                attn(0, q, q[:0, :kv_heads], q[:0, :kv_heads], kv,
                     kv[0, 0].view(-1, kv_heads, hd), kv[1, 0].view(-1, kv_heads, hd),
                     batch, plan)
        times = {name: [] for name in engines}
        for _ in range(passes):
            for name, attn in engines.items():
                times[name].append(best_of(lambda: step(attn), 1))
        a, b = min(times["kernel"]), min(times["torch"])
        print(f"  {n:3d} sequences: kernel {a * 1e3:6.2f} ms   torch (gather + SDPA) "
              f"{b * 1e3:6.2f} ms   x{b / a:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64", help="matmul rows (0: skip)")
    ap.add_argument("--sequences", default="8,32", help="attention batch sizes (0: skip)")
    ap.add_argument("--contexts", type=int, default=320)
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    where = tempfile.mkdtemp(prefix="f32-kernels-")
    try:
        linear = cpu_kernels.load_linear_f32(where)
        paged = cpu_kernels.load_paged_decode_f32(where)
    except cpu_kernels.KernelUnavailable as exc:
        sys.exit(f"bench_f32_kernels: {exc}")
    rows = [int(r) for r in args.rows.split(",") if int(r) > 0]
    seqs = [int(s) for s in args.sequences.split(",") if int(s) > 0]
    if rows:
        matmuls(linear, rows, args.passes)
    if seqs:
        attention(paged, seqs, args.contexts, args.passes)


if __name__ == "__main__":
    main()
