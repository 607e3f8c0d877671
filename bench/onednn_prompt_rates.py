"""How fast oneDNN runs a prompt's bf16 matmuls on one core, and what the prefill step
could change around it: a probe of where the prefill core's time goes (session 58).

On an AMX host a prefill worker multiplies its prompts through oneDNN's packed linear
(`layers.linear.Linear`), two thirds of a 256-token prompt's CPU. This prints, on the 82m
model's shapes (hidden 768, intermediate 2,048, 4 KV heads of 64), bf16:

1. each weight of one layer at M rows through `F.linear`, the packed weight, and the
   weight packed with M as oneDNN's batch hint (`_reorder_linear_weight(w, M)`, what
   inductor's freezing pass passes) -- warm: the same weight call after call;
2. a prompt's 12 layers of matmuls, one copy of the layer's weights (they stay in the
   caches) against 12 copies (as a model: each weight read from beyond L2 once a pass);
3. the MLP (gate/up, `LayerGlue.silu_mul`, down) over 12 layers at T rows, whole and in
   slices of rows (`models.llama.MLP_ROWS` slices only past 1,024), so that gate/up's
   output would stay in L2.

    taskset -c 1 .venv/bin/python bench/onednn_prompt_rates.py
    taskset -c 1 .venv/bin/python bench/onednn_prompt_rates.py --rows 512 \
        --mlp-rows 512,1024 --slices 1024,256
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

LAYER = ((1280, 768), (768, 768), (4096, 768), (768, 2048))   # 82m: qkv, o, gate/up, down
NAMES = ("qkv", "o", "gate/up", "down")
LAYERS = 12
LINEAR = torch.ops.mkldnn._linear_pointwise


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def packed(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    return torch.ops.mkldnn._reorder_linear_weight(w)


def per_weight(m: int, g: torch.Generator, repeats: int, rounds: int) -> None:
    print(f"1. one layer's weights at {m} rows, warm (ms, TFLOP/s; the best of {rounds} "
          "alternating rounds)")
    print("| weight | F.linear | packed | packed, batch hint | hinted output equal |")
    print("|---|---:|---:|---:|---|")
    for name, (n, k) in zip(NAMES, LAYER):
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        plain = torch.ops.mkldnn._reorder_linear_weight(w)
        hinted = torch.ops.mkldnn._reorder_linear_weight(w, m)
        ways = (lambda: F.linear(x, w),
                lambda: LINEAR(x, plain, None, "none", [], ""),
                lambda: LINEAR(x, hinted, None, "none", [], ""))
        best = [median_ms(fn, repeats) for fn in ways]
        for _ in range(rounds - 1):
            best = [min(b, median_ms(fn, repeats)) for b, fn in zip(best, ways)]
        flop = 2 * m * n * k
        same = torch.equal(ways[1](), ways[2]())
        print(f"| {name} {n}x{k} | "
              + " | ".join(f"{ms:.3f}, {flop / ms / 1e9:.2f}" for ms in best) + f" | {same} |")


def layer_passes(m: int, copies_list: list[int], g: torch.Generator, repeats: int) -> None:
    print(f"\n2. a prompt's {LAYERS} layers of matmuls at {m} rows (ms a pass, TFLOP/s)")
    xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (768, 2048)}
    flop = LAYERS * sum(2 * m * n * k for n, k in LAYER)
    for copies in copies_list:
        weights = [[packed(n, k, g) for n, k in LAYER] for _ in range(copies)]

        def one_pass():
            for i in range(LAYERS):
                for (n, k), w in zip(LAYER, weights[i % copies]):
                    LINEAR(xs[k], w, None, "none", [], "")
        ms = median_ms(one_pass, repeats)
        mb = copies * sum(n * k for n, k in LAYER) * 2 / 1e6
        print(f"   {copies:2d} cop{'y' if copies == 1 else 'ies'} of a layer ({mb:.0f} MB): "
              f"{ms:.1f} ms, {flop / ms / 1e9:.2f} TFLOP/s")


def mlp_slices(rows: list[int], slices: list[int], g: torch.Generator, repeats: int,
               rounds: int) -> None:
    from appliance.engines import cpu_kernels
    try:
        glue = cpu_kernels.load_layer_glue()
    except cpu_kernels.KernelUnavailable as exc:
        print(f"\n3. skipped: {exc}")
        return
    print(f"\n3. the MLP over {LAYERS} layers, whole and in slices of rows "
          f"(ms a pass, the range over {rounds} alternating rounds)")
    weights = [(packed(4096, 768, g), packed(768, 2048, g)) for _ in range(LAYERS)]
    for t in rows:
        x = torch.randn(t, 768, generator=g).bfloat16()

        def mlp(rows_at_once: int) -> None:
            for gate_up, down in weights:
                def rows(xr: torch.Tensor) -> torch.Tensor:
                    gu = LINEAR(xr, gate_up, None, "none", [], "")
                    return LINEAR(glue.silu_mul(gu), down, None, "none", [], "")
                if rows_at_once >= t:       # as DenseMLP runs a step under MLP_ROWS
                    rows(x)
                    continue
                out = torch.empty_like(x)
                for a in range(0, t, rows_at_once):
                    out[a:a + rows_at_once] = rows(x[a:a + rows_at_once])
        seen: dict[int, list[float]] = {min(s, t): [] for s in slices}
        for _ in range(rounds):
            for s in seen:
                seen[s].append(median_ms(lambda: mlp(s), repeats))
        print(f"   {t} rows: " + "; ".join(
            f"{'whole' if s >= t else f'{s} at a time'} {min(v):.1f}-{max(v):.1f}"
            for s, v in seen.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="prompt rows (1. and 2.)")
    ap.add_argument("--copies", default="1,12", help="copies of a layer's weights (2.)")
    ap.add_argument("--mlp-rows", default="256,512,1024", help="rows through the MLP (3.)")
    ap.add_argument("--slices", default="1024,256,128", help="rows at a time (3.)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        sys.exit("onednn_prompt_rates: this torch build has no oneDNN packed linear")
    g = torch.Generator().manual_seed(0)
    ints = lambda s: [int(v) for v in s.split(",") if v]      # noqa: E731
    per_weight(args.rows, g, args.repeats, args.rounds)
    layer_passes(args.rows, ints(args.copies), g, args.repeats)
    mlp_slices(ints(args.mlp_rows), ints(args.slices), g, args.repeats, args.rounds)


if __name__ == "__main__":
    main()
