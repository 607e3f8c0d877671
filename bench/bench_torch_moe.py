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


def _checkpoint(kind: str, layers: int, path: Path):
    common = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=1024,
                                          num_experts=32, num_experts_per_tok=4,
                                          moe_intermediate_size=256, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=1024, num_local_experts=8,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(path)
    return path, model


def _engine_decode(model, prompts: list[list[int]], steps: int) -> float:
    B = len(prompts)
    blocks_per = -(-(PROMPT + steps) // BLOCK)
    kv = allocate_kv_pool(model.shape, B * blocks_per, BLOCK)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
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
