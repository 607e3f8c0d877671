"""The mixture-of-experts families' decode step on the CPU: the paged forward pass
(`LlamaModel`, experts grouped by expert) vs `transformers`' `generate` on the same random
checkpoint, fp32, one thread by default. Not a test: prints a table.

    .venv/bin/python bench/bench_torch_moe.py            # ~1 min on 2 busy cores
    .venv/bin/python bench/bench_torch_moe.py --threads 2 --layers 12

Decode tok/s at batch B: B sequences of P = 64 prompt tokens, then N greedy steps.
  engine: B * N / the time of N decode forwards (one token per sequence, paged KV), the
  prompt's prefill not counted; the model alone, no scheduler or sampling.
  transformers: B * (N - 1) / (generate(N new) - generate(1 new)) on the same prompts
  (its default cache and attention; the MoE block loops over the experts hit).
The checkpoints: Qwen3-MoE-shaped (hidden 512, 32 experts of 256, top 4, renormalized)
and Mixtral-shaped (hidden 512, 8 experts of 1024, top 2), vocab 4,096, random weights.

`--kernels` instead times the model as a bf16 decode worker holds it (`build_torch_engine`
with the worker's spec), with the C kernels off (oneDNN's matmuls, Python's loop over the
experts), with the experts' matmuls on the C matmul kernel in that loop, and with each MoE
layer's experts in one C call (cpu_kernels/moe_experts.c), on `--shape a3b`: Qwen3-30B-A3B's
expert layout (128 experts, top 8, experts a third of the hidden size wide) at the 82m
benchmark's width (hidden 768, 12 layers, experts of 256: 0.93B parameters, 80M active),
and the rate at which each reads the experts its steps route to. `--dtype float32` times
the same in fp32, as a worker on a CPU without AVX-512 holds it (the fp32 kernels: AVX2
and FMA; on a host with AVX-512 the worker is told its CPU has only AVX2 and FMA, as the
tests do, since there it would hold bf16 and take the bf16 kernels).

    .venv/bin/python bench/bench_torch_moe.py --kernels --batches 1,8,32     # ~3 min
    .venv/bin/python bench/bench_torch_moe.py --kernels --batches 1,8,32 --dtype float32
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.loader import load_model
from appliance.models.specs import spec_from_hf_config

BLOCK, PROMPT = 16, 64


def _checkpoint(kind: str, layers: int, path: Path, dtype: torch.dtype = torch.float32):
    common = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    if kind == "a3b":
        common.update(hidden_size=768, num_attention_heads=12)
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=2048,
                                          num_experts=128, num_experts_per_tok=8,
                                          moe_intermediate_size=256, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=1024,
                                          num_experts=32, num_experts_per_tok=4,
                                          moe_intermediate_size=256, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=1024, num_local_experts=8,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg).eval()
        finally:
            torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)
    return path, model


def _engine_decode(model, prompts: list[list[int]], steps: int) -> float:
    B = len(prompts)
    blocks_per = -(-(PROMPT + steps) // BLOCK)
    kv = allocate_kv_pool(model.shape, B * blocks_per, BLOCK, dtype=model.dtype)
    tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(B)]

    def slots(t, a, b):
        return [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(a, b)]

    batch = AttnBatch(True, [PROMPT] * B, [PROMPT] * B, tables,
                      torch.tensor([s for t in tables for s in slots(t, 0, PROMPT)]))
    logits = model(torch.tensor(sum(prompts, [])), torch.arange(PROMPT).repeat(B), batch, kv)
    start = time.perf_counter()
    for step in range(steps):
        ctx = PROMPT + step
        batch = AttnBatch(False, [1] * B, [ctx + 1] * B, tables,
                          torch.tensor([slots(t, ctx, ctx + 1)[0] for t in tables]))
        logits = model(logits.argmax(-1), torch.full((B,), ctx), batch, kv)
    return B * steps / (time.perf_counter() - start)


def _hf_decode(ref, prompts: list[list[int]], steps: int) -> float:
    ids = torch.tensor(prompts)

    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
        return time.perf_counter() - t

    run(2)   # warm up
    return len(prompts) * (steps - 1) / max(1e-9, run(steps) - run(1))


def _worker_model(path: Path, kernels: str, kernel_dir: Path, dtype: str):
    """The model as a decode worker of the daemon holds it in `dtype`."""
    from appliance.engines.torch_engine import build_torch_engine
    from appliance.worker.spec import WorkerSpec
    spec = WorkerSpec(worker="decode0", role="decode", engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(path), block_size=BLOCK,
                      kv_cache_bytes=64 << 20, max_batch_tokens=4096, dtype=dtype,
                      cpu_kernels=kernels, kernel_dir=str(kernel_dir))
    return build_torch_engine(spec, path).model


class _Recording:
    """A router that keeps what it chose (to count the experts a step reads)."""

    def __init__(self, router, calls: list) -> None:
        self.router, self.calls = router, calls

    def __call__(self, x):
        out = self.router(x)
        self.calls.append(out[1])
        return out


def _expert_bytes(model, prompts: list[list[int]], steps: int) -> float:
    """Bytes of expert weights the decode steps read: each step's distinct experts per
    layer (from the routers, on the same inputs), times an expert's size."""
    from appliance.engines.layers.moe import SparseMoE
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    calls: list = []
    for moe in moes:
        moe.router = _Recording(moe.router, calls)
    try:
        _engine_decode(model, prompts, steps)
    finally:
        for moe in moes:
            moe.router = moe.router.router
    B = len(prompts)
    distinct = sum(len(set(e.flatten().tolist())) for e in calls if e.shape[0] == B)
    s = model.shape
    return distinct * 3 * s.hidden_size * s.moe_intermediate_size * model.dtype.itemsize


def kernels_main(args) -> None:
    if args.dtype == "float32":
        from appliance.engines import dtypes
        flags = dtypes.cpu_flags()
        dtypes.cpu_flags = lambda *a: flags - {f for f in flags if f.startswith("avx512")}
    print(f"decode step, {args.dtype}, as a decode worker holds the model, 1 thread, "
          f"prompt {PROMPT}, {args.steps} steps")
    print(f"{'shape':<6} {'batch':>5} {'experts':<22} {'ms/step':>8} {'tok/s':>7} "
          f"{'expert GB/s':>11}")
    from appliance.engines.layers.moe import SparseMoE
    with tempfile.TemporaryDirectory() as d:
        path, _ = _checkpoint(args.shape, args.layers, Path(d) / "ckpt",
                              getattr(torch, args.dtype))
        variants = {}
        off = _worker_model(path, "off", Path(d) / "k", args.dtype)
        variants["oneDNN, Python loop"] = off
        on = _worker_model(path, "auto", Path(d) / "k", args.dtype)
        moes = [layer.mlp for layer in on.layers if isinstance(layer.mlp, SparseMoE)]
        if not moes or moes[0].kernel is None:
            raise SystemExit("bench_torch_moe: no MoE one call here (the kernels need a C "
                             "compiler, and AVX512-BF16 for bfloat16, AVX2 and FMA for "
                             "float32)")
        kernel = moes[0].kernel
        variants["C matmuls, Python loop"] = on
        variants["one C call"] = on
        for B in (int(b) for b in args.batches.split(",")):
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(5, 4096, (B, PROMPT), generator=g).tolist()
            nbytes = _expert_bytes(off, prompts, args.steps)
            for name, model in variants.items():
                for moe in moes:
                    moe.use_kernel(kernel if name == "one C call" else None)
                _engine_decode(model, prompts, 2)       # warm up
                rate = min((_engine_decode(model, prompts, args.steps) for _ in range(3)),
                           key=lambda r: -r)
                step_s = B / rate
                print(f"{args.shape:<6} {B:>5} {name:<22} {step_s * 1e3:>8.2f} {rate:>7.1f} "
                      f"{nbytes / args.steps / step_s / 1e9:>11.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None,
                    help="layers (default 6; 12 with --kernels)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--kernels", action="store_true",
                    help="bf16 as a decode worker holds it: kernels off, the experts' "
                         "matmuls on the C kernel, the experts in one C call")
    ap.add_argument("--shape", choices=("a3b", "qwen3_moe", "mixtral"), default="a3b",
                    help="the checkpoint --kernels times")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the weights' type --kernels times (float32: the AVX2 kernels)")
    args = ap.parse_args()
    if args.kernels:
        args.layers = args.layers or 12
        torch.set_num_threads(1)
        kernels_main(args)
        return
    args.layers = args.layers or 6
    torch.set_num_threads(args.threads)
    print(f"decode tok/s, fp32, {args.threads} thread(s), prompt {PROMPT}, {args.steps} steps")
    print(f"{'model':<12} {'params':>8} {'active':>8} {'batch':>5} {'engine':>8} "
          f"{'transformers':>12} {'ratio':>6}")
    for kind in ("qwen3_moe", "mixtral"):
        with tempfile.TemporaryDirectory() as d:
            path, ref = _checkpoint(kind, args.layers, Path(d))
            model = load_model(path)
            spec = spec_from_hf_config(path)
            for B in (int(b) for b in args.batches.split(",")):
                g = torch.Generator().manual_seed(B)
                prompts = torch.randint(5, 4096, (B, PROMPT), generator=g).tolist()
                _engine_decode(model, prompts, 2)       # warm up
                ours = _engine_decode(model, prompts, args.steps)
                theirs = _hf_decode(ref, prompts, args.steps)
                print(f"{kind:<12} {spec.params / 1e6:>7.1f}M {spec.active_params / 1e6:>7.1f}M "
                      f"{B:>5} {ours:>8.1f} {theirs:>12.1f} {ours / theirs:>5.2f}x")


if __name__ == "__main__":
    main()
