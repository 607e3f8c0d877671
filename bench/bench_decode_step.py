"""One torch-engine decode step on the CPU, in CPU time, and where that time goes.

Drives a `TorchEngine` in-process (no daemon, no sockets): B requests of a P-token
prompt are prefilled, then `--steps` decode steps of the whole batch are timed with
`time.process_time()` (CPU time of the process, so other processes on a loaded machine
do not inflate it; with one torch thread it is the step's own cost). Then the same steps
run once more under `torch.profiler`, and the profiled CPU time is split into:

- matmuls (the packed `Linear`s: q/k/v, o, gate/up, down, LM head), next to their
  floor (FLOPs at the measured per-core GFLOPS of `--floor-gflops`);
- paged attention (gather of the blocks, scores, softmax, values), KV write;
- norms, RoPE, activation and residual adds (the small elementwise ops of a layer);
- the attention plan (index tensors made once per step), building the step's input
  tensors in Python, sampling, and the engine's bookkeeping (the rest of the step).

The profiler adds a few microseconds per op, so its total is above the unprofiled
CPU time; shares are of the profiled total, milliseconds scaled to the unprofiled one.

    .venv/bin/python bench/bench_decode_step.py                   # 82m bf16, B = 1, 8, 32
    .venv/bin/python bench/bench_decode_step.py --qwen3           # the Qwen3-shaped model
    .venv/bin/python bench/bench_decode_step.py --compile decode  # torch.compile of decode
    .venv/bin/python bench/bench_decode_step.py --compare-compile # eager vs compiled, A B A B
    .venv/bin/python bench/bench_decode_step.py --compare-kernels # torch vs the C kernels
    .venv/bin/python bench/bench_decode_step.py --json out.json   # rows for a comparison
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from appliance.engines import cpu_heap, torch_engine  # noqa: E402
from appliance.engines.models import llama  # noqa: E402
from appliance.engines.loader import load_model  # noqa: E402
from appliance.engines.messages import Prefill, SamplingParams  # noqa: E402
from appliance.engines.torch_engine import TorchEngine  # noqa: E402
import bench_vs_vllm  # noqa: E402

BS = 16

# Which profiler op names make up which part of a step (self CPU time). Ops inside the
# ranges wrapped below ("attention", "plan", "sample", "inputs") count for the range.
MATMUL_OPS = {"mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm"}
KV_WRITE_OPS = {"aten::index_copy_", "aten::index_put_"}
NORM_OPS = {"aten::rms_norm", "aten::_fused_rms_norm", "aten::rsqrt", "aten::pow",
            "aten::mean"}
ROPE_OPS = {"aten::flip", "aten::mul_", "aten::addcmul_"}
ACT_OPS = {"aten::silu", "aten::mul"}
RESIDUAL_OPS = {"aten::add"}


def model_dir(qwen3: bool) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "applianced-bench"
    base = bench_vs_vllm.make_model(cache)
    return bench_vs_vllm.make_qwen3_model(base) if qwen3 else base


def build(model, batch: int, prompt: int, steps: int, compile_mode: str) -> TorchEngine:
    need = batch * (-(-(prompt + steps + 8) // BS))
    eng = TorchEngine(model=model, worker="bench", devices=("cpu",), num_blocks=need + 8,
                      block_size=BS, max_batch_tokens=65536, max_seqs=256,
                      max_context=model.shape.max_position_embeddings, eos_token_ids=(),
                      share_pool=False)
    if compile_mode != "off":
        eng.set_compile(compile_mode)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = [0] + torch.randint(5, model.shape.vocab_size, (prompt - 1,), generator=g).tolist()
        eng.add(Prefill(f"r{i}", ids, SamplingParams(max_tokens=steps, temperature=0.0,
                                                     ignore_eos=True), handoff=False))
    while eng.scheduler.waiting:    # prefill every prompt (its first token comes with it)
        eng.step()
    return eng


class Ranges:
    """Wrap the engine's pieces in profiler ranges (for the breakdown only)."""

    def __init__(self):
        self.saved = []

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            with torch.profiler.record_function(label):
                return fn(*a, **k)
        self.saved.append((owner, name, fn))
        setattr(owner, name, wrapped)

    def undo(self):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)
        self.saved.clear()


def breakdown(eng: TorchEngine, steps: int) -> dict[str, float]:
    """Profiled CPU time (ms, summed over `steps`) of each part of a decode step."""
    from torch.profiler import ProfilerActivity, profile
    r = Ranges()
    attn = eng.model.attn
    r.wrap(attn, "begin", "#plan")
    # PagedAttention is called as an instance: wrap its class's __call__ per instance.
    cls_call = type(attn).__call__

    class _Traced(type(attn)):
        def __call__(self, *a, **k):
            with torch.profiler.record_function("#attention"):
                return cls_call(self, *a, **k)
    old_cls = attn.__class__
    attn.__class__ = _Traced
    r.wrap(torch_engine, "sample", "#sample")
    r.wrap(llama, "head_rms_norm_", "#qk norm")
    r.wrap(eng, "_postprocess", "#postprocess")
    r.wrap(eng.scheduler, "schedule", "#schedule")
    fwd = eng.model.forward

    def forward(*a, **k):
        with torch.profiler.record_function("#forward"):
            return fwd(*a, **k)
    eng.model.forward = forward
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with torch.profiler.record_function("#step"):
                    eng.step()
    finally:
        r.undo()
        attn.__class__ = old_cls
        del eng.model.forward
    events = prof.events()
    # Each op's self time goes to the innermost range it ran under, else to its category.
    parts: dict[str, float] = {}
    ranges = [e for e in events if e.name.startswith("#")]
    inner = ("#attention", "#plan", "#sample", "#postprocess", "#schedule", "#qk norm")

    step_total = sum(e.cpu_time_total for e in events if e.name == "#step") / 1e3
    fwd_total = sum(e.cpu_time_total for e in events if e.name == "#forward") / 1e3
    for rg in ranges:
        if rg.name in inner:
            parts[rg.name[1:]] = parts.get(rg.name[1:], 0.0) + rg.cpu_time_total / 1e3
    in_ranges = [(rg.time_range.start, rg.time_range.end) for rg in ranges if rg.name in inner]
    forwards = [(e.time_range.start, e.time_range.end) for e in events if e.name == "#forward"]
    kinds = (("matmuls", MATMUL_OPS), ("KV write", KV_WRITE_OPS), ("norms", NORM_OPS),
             ("RoPE", ROPE_OPS), ("activation", ACT_OPS), ("residual adds", RESIDUAL_OPS))
    glue_ops = 0.0
    for e in events:
        if e.name.startswith("#"):
            continue
        if any(a <= e.time_range.start and e.time_range.end <= b for a, b in in_ranges):
            continue
        if e.cpu_parent is not None and not e.cpu_parent.name.startswith("#"):
            continue        # a child op: its top-level op is counted with its total
        t = e.cpu_time_total / 1e3
        if not any(a <= e.time_range.start and e.time_range.end <= b for a, b in forwards):
            glue_ops += t   # run_batch's own ops: input tensors, logits rows
            continue
        key = next((kind for kind, ops in kinds if e.name in ops), "other ops")
        parts[key] = parts.get(key, 0.0) + t
    in_fwd = sum(v for k, v in parts.items() if k not in ("sample", "postprocess", "schedule"))
    parts["python in forward"] = max(0.0, fwd_total - in_fwd)
    parts["run_batch glue (inputs, logits rows)"] = glue_ops
    parts["python elsewhere in the step"] = max(0.0, step_total - fwd_total - glue_ops - sum(
        parts.get(k, 0.0) for k in ("sample", "postprocess", "schedule")))
    parts["_total"] = step_total
    return parts


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    cpu_heap.keep_freed_memory()      # as a worker does (freed tensors stay mapped)
    d = model_dir(args.qwen3)
    model = load_model(d, device=torch.device("cpu"), dtype=getattr(torch, args.dtype))
    layer_flops, head_flops = bench_vs_vllm.matmul_flops_per_row(model.shape)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        eng = build(model, B, args.prompt, args.steps * 3 + 4, args.compile)
        for _ in range(3):                      # warm-up (and compilation, if on)
            eng.step()
        cpu, wall = [], []
        for _ in range(args.steps):
            c0, w0 = time.process_time(), time.perf_counter()
            eng.step()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        step_ms = statistics.median(cpu) * 1e3
        floor_ms = B * (layer_flops + head_flops) / (args.floor_gflops(B) * 1e9) * 1e3
        row = dict(model=d.name, dtype=args.dtype, batch=B, context=args.prompt,
                   compile=args.compile, step_cpu_ms=step_ms,
                   step_wall_ms=statistics.median(wall) * 1e3, matmul_floor_ms=floor_ms)
        if args.breakdown:
            parts = breakdown(eng, args.steps)
            total = parts.pop("_total")
            row["parts_ms"] = {k: v / total * step_ms for k, v in parts.items()}
        rows.append(row)
        print(f"{d.name} {args.dtype} B={B:<3} ctx~{args.prompt}: step {step_ms:6.2f} ms CPU "
              f"({row['step_wall_ms']:.2f} ms wall), matmul floor {floor_ms:.2f} ms", flush=True)
        if args.breakdown:
            for k, v in sorted(row["parts_ms"].items(), key=lambda kv: -kv[1]):
                print(f"    {k:<36} {v:6.2f} ms  {100 * v / step_ms:5.1f}%")
        del eng
    return rows


def compare_compile(args) -> list[dict]:
    """Eager against ``engine.compile = "decode"`` on one engine, alternating (eager two
    steps, compiled two steps, 8 times): the load of other jobs falls on both alike."""
    from appliance.engines.layers.glue import compile_glue, eager_glue
    torch.set_num_threads(args.threads)
    cpu_heap.keep_freed_memory()
    d = model_dir(args.qwen3)
    model = load_model(d, device=torch.device("cpu"), dtype=getattr(torch, args.dtype))
    t0 = time.perf_counter()
    compiled = compile_glue(model.device, model.dtype, model.shape.hidden_size,
                            model.shape.rms_norm_eps, "bench")
    print(f"compiled in {time.perf_counter() - t0:.1f} s wall (compiled: {compiled.compiled})")
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        eng = build(model, B, args.prompt, 60, "off")
        res: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(3):
            eng.step()
        for _ in range(8):
            for name, glue in (("eager", eager_glue()), ("compiled", compiled)):
                model.decode_glue = glue
                eng.step()
                c0 = time.process_time()
                eng.step()
                eng.step()
                res[name].append((time.process_time() - c0) / 2 * 1e3)
        row = dict(model=d.name, batch=B, **{f"{k}_cpu_ms": statistics.median(v)
                                             for k, v in res.items()})
        rows.append(row)
        print(f"{d.name} B={B}: eager {row['eager_cpu_ms']:.2f} ms, compiled "
              f"{row['compiled_cpu_ms']:.2f} ms CPU per step (medians of 8 pairs)", flush=True)
    return rows


def compare_kernels(args) -> list[dict]:
    """torch's decode step against the C kernels (`engines.cpu_kernels`, built here on first
    use), alternating two steps each, 8 times, as --compare-compile does: torch's attention
    and oneDNN's matmuls; the attention kernel; the attention and matmul kernels (a second
    copy of the model, its dense layers in the matmul kernel's layout); and those with the
    glue kernel (norms, RoPE with the KV write, activation); those in one C call a step
    (`decode_layers`, as a worker runs them). With --helper-core N, a sixth: the one call
    with the matmul kernel's helper thread on core N sharing the matmuls and the attention,
    gated as a decode worker gates it (`cpu_kernels.helper_gate`), timed in wall time (the
    process's CPU time would count the helper's polling too)."""
    from appliance.engines import cpu_kernels
    from appliance.engines.cpu_kernels.helper_gate import HelperGate
    from appliance.engines.torch_engine import dense_linears
    torch.set_num_threads(args.threads)
    cpu_heap.keep_freed_memory()
    d = model_dir(args.qwen3)
    dtype = getattr(torch, args.dtype)
    plain = load_model(d, device=torch.device("cpu"), dtype=dtype)
    fast = load_model(d, device=torch.device("cpu"), dtype=dtype)
    try:
        attention = cpu_kernels.load_paged_decode()
        linear = cpu_kernels.load_linear_bf16()
        glue = cpu_kernels.load_layer_glue()
        layers = cpu_kernels.load_decode_layers()
    except cpu_kernels.KernelUnavailable:
        # (the compiler's own message is many lines of intrinsics that do not build here)
        raise SystemExit("--compare-kernels times the bf16 kernels, which need AVX512-BF16; "
                         "on this CPU the fp32 ones run: bench/bench_f32_kernels.py") from None
    layers.bind(linear, attention, glue)
    if not fast.attn.set_decode_kernel(attention) or \
            not all(layer.use_kernel(linear) for layer in dense_linears(fast)):
        raise SystemExit(f"the kernels do not take {d.name}")
    one_call = ("one call", "+helper core")
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        engines = {"torch": build(plain, B, args.prompt, 60, "off"),
                   "attention": build(plain, B, args.prompt, 60, "off"),
                   "attention+matmuls": build(fast, B, args.prompt, 60, "off"),
                   "attention+matmuls+glue": build(fast, B, args.prompt, 60, "off"),
                   "one call": build(fast, B, args.prompt, 60, "off")}
        if args.helper_core >= 0:   # the matmuls' helper thread on an idle core
            if not linear.start_helper(args.helper_core):
                raise SystemExit(f"no helper thread on core {args.helper_core}")
            eng = engines["+helper core"] = build(fast, B, args.prompt, 60, "off")
            eng.helper_gate = HelperGate(linear, args.helper_core)
        res: dict[str, list[float]] = {name: [] for name in engines}
        for eng in engines.values():
            for _ in range(3):
                eng.step()
        for _ in range(8):
            for name, eng in engines.items():
                plain.attn.set_decode_kernel(attention if name == "attention" else None)
                fast.set_glue_kernel(glue if name in ("attention+matmuls+glue", *one_call)
                                     else None)
                if name in one_call:
                    if not fast.set_decode_layers(layers):
                        raise SystemExit(f"decode_layers does not take {d.name}")
                else:
                    fast.set_decode_layers(None)
                eng.step()
                c0, w0 = time.process_time(), time.perf_counter()
                eng.step()
                eng.step()
                # CPU time of the process would count the helper's too: wall time for it
                res[name].append(((time.perf_counter() - w0) if name == "+helper core"
                                  else (time.process_time() - c0)) / 2 * 1e3)
                linear.helper_spin(False)
        row = dict(model=d.name, batch=B, context=args.prompt,
                   **{f"{k}_cpu_ms": statistics.median(v) for k, v in res.items()})
        rows.append(row)
        print(f"{d.name} B={B} ctx~{args.prompt}: CPU ms per step (medians of 8 rounds): "
              + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in res.items()), flush=True)
        del engines
    return rows


def floor_gflops(batch: int) -> float:
    """bf16 GFLOPS per core of the packed Linear measured on this machine's AVX512-BF16
    core (the session's peak.py): ~45 at M = 1, 160-180 at M = 8-32."""
    return 45.0 if batch == 1 else 170.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen3", action="store_true", help="the Qwen3-shaped 82m checkpoint")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens (the context)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", default="off", help="engine compile mode (off | decode)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    ap.add_argument("--compare-compile", action="store_true",
                    help="eager vs engine.compile=decode, alternating on one engine")
    ap.add_argument("--compare-kernels", action="store_true",
                    help="torch's decode step vs the C kernels (attention; attention and matmuls)")
    ap.add_argument("--helper-core", type=int, default=-1,
                    help="with --compare-kernels: a fifth engine whose matmuls borrow this "
                         "core (pin the process elsewhere: taskset -c 1 ... --helper-core 0)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    args.floor_gflops = floor_gflops
    rows = (compare_compile(args) if args.compare_compile else
            compare_kernels(args) if args.compare_kernels else run(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
