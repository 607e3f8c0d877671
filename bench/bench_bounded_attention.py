"""The bounded-memory attention path (appliance/engines/layers/attention_backends.py) on the CPU:
what the planner gives a 32k-token prompt, the largest allocation one call makes
(measured with the CPU profiler's memory hooks), and its time next to SDPA's fused CPU
kernel on the same masked problem (a 1,536-token chunk after a 512-token prefix).

    .venv/bin/python bench/bench_bounded_attention.py

The bounded path is the GPU fallback when FlashInfer is not installed; the CPU engine
keeps SDPA. Its speed on a GPU is not measured here (no GPU).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from appliance.engines.layers.attention_backends import bounded_prefill, plan_chunks


def main() -> None:
    torch.set_num_threads(1)
    H, KVH, hd, n = 32, 8, 128, 32768
    plan = plan_chunks(n, n, H // KVH, hd, 2, 256 << 20)
    print(f"32k-token prompt, {H} query / {KVH} KV heads, head_dim {hd}, bf16, budget 256 MiB: "
          f"{plan.q_chunk} rows x {plan.head_chunk} heads x {plan.k_chunk} keys per chunk, "
          f"{plan.peak_bytes / 2**20:.1f} MiB held at once "
          f"(unchunked fp32 scores: {H * n * n * 4 / 2**30:.0f} GiB)")
    g = torch.Generator().manual_seed(0)
    H, KVH, hd, ctx, n = 8, 2, 32, 2048, 1536
    k = torch.randn(ctx + 64, KVH, hd, generator=g)
    v = torch.randn(ctx + 64, KVH, hd, generator=g)
    slots = torch.randperm(ctx + 64, generator=g)[:ctx]
    q = torch.randn(n, H, hd, generator=g)
    out = torch.empty_like(q)
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    for budget in (1 << 20, 16 << 20, 64 << 20):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            bounded_prefill(q, k, v, slots, budget, out)
        largest = max(e.cpu_memory_usage for e in prof.events())
        times = []
        for _ in range(5):
            t = time.perf_counter()
            bounded_prefill(q, k, v, slots, budget, out)
            times.append(time.perf_counter() - t)
        print(f"bounded, budget {budget >> 20:>2} MiB: largest allocation {largest / 2**20:.2f} MiB, "
              f"median {sorted(times)[2] * 1e3:.0f} ms")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[slots].transpose(0, 1)[None],
                                       v[slots].transpose(0, 1)[None], attn_mask=mask,
                                       enable_gqa=True)
        times.append(time.perf_counter() - t)
    print(f"SDPA (CPU fused kernel, masked): median {sorted(times)[2] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
