"""Where a CPU prefill step's time goes, against its matmul floor. Not a test: prints a table.

    .venv/bin/python bench/profile_prefill_step.py                       # 82m, bf16, 1 thread
    .venv/bin/python bench/profile_prefill_step.py --prompts 1,8,32 --dtype float32

One torch engine in this process (`build_torch_engine`, the worker's own path: packed
weights, the KV pool in /dev/shm, one torch thread unless --threads), the checkpoint
`bench_vs_vllm.py` serves (the 82m Llama preset) unless --model. For each batch of P
prompts of --prompt-tokens random token ids (handoff prompts, as a disagg prefill worker
gets them) the engine runs whole steps (`engine.step()`, what the worker loop calls), and
torch.profiler sorts one step's CPU time by op into the groups below; the matmul floor is
the step's linear-layer FLOPs at the GFLOPS the same packed `Linear` reaches alone on
one [T, hidden] x [hidden, out] shape of the step (measured here first, in CPU time).
Times are CPU time (`time.process_time`), so other jobs on the machine change them little.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from appliance.engines.messages import Prefill, PrefillDone, SamplingParams  # noqa: E402
from appliance.engines.torch_engine import build_torch_engine  # noqa: E402
from appliance.worker.spec import WorkerSpec  # noqa: E402

# torch.profiler op names -> the group they are reported in
GROUPS = [
    ("matmul (packed linear)", ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm",
                                "aten::mm")),
    ("attention (SDPA)", ("aten::_scaled_dot_product", "aten::scaled_dot_product")),
    ("rms_norm", ("aten::rms_norm", "aten::_fused_rms_norm")),
    ("silu * up", ("aten::silu", "aten::mul")),
    ("rope", ("aten::flip", "aten::mul_", "aten::addcmul_")),
    ("kv write (index_copy_)", ("aten::index_copy_",)),
    ("copies (copy_/cat/contiguous)", ("aten::copy_", "aten::cat", "aten::contiguous",
                                       "aten::clone")),
    ("residual add", ("aten::add",)),
    ("gather/index", ("aten::index", "aten::index_select", "aten::embedding")),
    ("sampling/softmax", ("aten::softmax", "aten::_softmax", "aten::argmax", "aten::topk",
                          "aten::sort", "aten::log_softmax", "aten::max")),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if any(name == p or name.startswith(p) for p in prefixes):
            return group
    return "other ops"


def gflops(lin, rows: int, cols_in: int, dtype: torch.dtype) -> float:
    x = torch.randn(rows, cols_in).to(dtype)
    for _ in range(2):
        lin(x)
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < 0.5:
        y = lin(x)
        n += 1
    dt = (time.process_time() - t0) / n
    return 2 * rows * cols_in * y.shape[-1] / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path,
                    default=Path.home() / ".cache" / "applianced-bench" / "bench-82m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", default="1,8,32", help="prompts per step, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per size (median)")
    ap.add_argument("--prefault", action="store_true",
                    help="touch every page of the KV pool first (a fresh pool's first "
                         "writes page-fault: compare)")
    ap.add_argument("--cpu-kernels", default="off", choices=("off", "auto"),
                    help="the worker's engine.cpu_kernels (auto: the prompt attention kernel)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model}: no checkpoint (bench/bench_vs_vllm.py makes the 82m one)")
    spec = WorkerSpec(worker="prefill0", role="prefill", engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(args.model), cpu_threads=args.threads,
                      dtype=args.dtype, max_batch_tokens=1 << 20, kv_cache_bytes=1 << 30,
                      cpu_kernels=args.cpu_kernels)
    engine = build_torch_engine(spec, args.model)
    model = engine.model
    if args.prefault:
        engine.kv.view(torch.uint8).view(-1)[::4096].zero_()
    s = model.shape
    vocab = s.vocab_size
    rng = random.Random(1)
    # FLOPs of the linear layers per token (the LM head runs on one row per prompt)
    per_token = 2 * sum(
        w.dense().numel() for layer in model.layers
        for w in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down))
    head = 2 * s.hidden_size * vocab
    rid = 0
    rows = []
    print(f"{args.model.name} {model.dtype} threads={torch.get_num_threads()}: "
          f"{per_token / 1e6:.0f} MFLOP/token in the layers' matmuls")
    for P in [int(p) for p in args.prompts.split(",")]:
        T = P * args.prompt_tokens
        lin = model.layers[0].mlp.gate_up
        rate = gflops(lin, min(T, 2048), s.hidden_size, model.dtype)
        floor = (per_token * T + head * P) / rate / 1e9

        def one_step(profile: bool = False):
            nonlocal rid
            for _ in range(P):
                rid += 1
                prompt = [rng.randrange(16, vocab) for _ in range(args.prompt_tokens)]
                engine.add(Prefill(f"r{rid}", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                                  ignore_eos=True),
                                   handoff=True))
            t0, w0 = time.process_time(), time.perf_counter()
            events = engine.step()
            cpu, wall = time.process_time() - t0, time.perf_counter() - w0
            done = [e for e in events if isinstance(e, PrefillDone)]
            assert len(done) == P, (len(done), P)
            for e in done:
                engine.release(e.request_id)
            return cpu, wall

        one_step()      # warm-up: first use of every shape
        samples = sorted(one_step() for _ in range(args.steps))
        cpu, wall = samples[len(samples) // 2]
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_step()
        by = defaultdict(float)
        total_ops = 0.0
        for ev in prof.key_averages():
            # self CPU time: no op counted twice through its children
            by[group_of(ev.key)] += ev.self_cpu_time_total / 1e6
            total_ops += ev.self_cpu_time_total / 1e6
        row = {"prompts": P, "tokens": T, "cpu_s": cpu, "wall_s": wall,
               "floor_s": floor, "gflops_alone": rate,
               "profiled_ops_s": total_ops, "groups": dict(by)}
        rows.append(row)
        print(f"\nP={P} prompts x {args.prompt_tokens} = {T} tokens: step {cpu * 1e3:.0f} ms CPU "
              f"({wall * 1e3:.0f} ms wall), matmul floor {floor * 1e3:.0f} ms at "
              f"{rate:.0f} GFLOPS -> {floor / cpu:.0%} of the floor's speed; "
              f"{T / cpu:.0f} tokens/CPU s")
        print("| where (profiled step, self CPU time) | ms | share |\n|---|---:|---:|")
        for g, t in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"| {g} | {t * 1e3:.1f} | {t / total_ops:.0%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
