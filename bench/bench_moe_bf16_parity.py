"""How often the MoE families' greedy tokens in bf16 part from `transformers`-in-bf16, and
whether every prompt that parts had a near-tie in `transformers`' run. Not a test: prints
one line per prompt and a summary; tests/unit/test_moe_bf16.py asserts the thresholds
this measures (docs/engines/torch.md, "bf16 and MoE").

    .venv/bin/python bench/bench_moe_bf16_parity.py                 # both families, ~1 min
    .venv/bin/python bench/bench_moe_bf16_parity.py --family mixtral --prompts 96

Per prompt: how many of the greedy tokens agree before the first that differs; the
smallest top-2 logit margin over transformers' steps (a fraction of the largest |logit|);
the smallest gap between the k-th and (k+1)-th router logits over every layer and
position (a fraction of the largest). A prompt is "clear" when both exceed the
thresholds; the summary says whether any clear prompt parted.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from appliance.engines import dtypes
from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.loader import load_model

VOCAB, BLOCK = 500, 8


def config(family: str, experts: int):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            num_local_experts=experts, **common)
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        head_dim=16, num_experts=experts, moe_intermediate_size=48, norm_topk_prob=True,
        **common)


def run(family: str, args) -> None:
    cls, cfg = config(family, args.experts)
    path = Path(tempfile.mkdtemp(prefix=f"moe-bf16-{family}-"))
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():       # the weights tests/unit/test_moe_bf16.py draws
        for name, p in ref.named_parameters():
            norm = "norm" in name
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                    + (0.2 if norm else 0.15) * torch.randn(p.shape, generator=g))
    ref.save_pretrained(path, safe_serialization=True)
    ref = cls.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ours = load_model(path, dtype=torch.bfloat16)
    k = cfg.num_experts_per_tok
    router: list[torch.Tensor] = []
    for layer in ref.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: router.append(out[0]))
    parted = clear = clear_parted = 0
    for i in range(args.prompts):
        prompt = torch.randint(0, VOCAB, (args.prompt_len,),
                               generator=torch.Generator().manual_seed(100 + i)).tolist()
        router.clear()
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=args.new, do_sample=False,
                               pad_token_id=0, eos_token_id=None,
                               return_dict_in_generate=True, output_logits=True)
        theirs = out.sequences[0, len(prompt):].tolist()
        logits = torch.stack([s[0].float() for s in out.logits])
        top2 = logits.topk(2, dim=-1).values
        margin = float(((top2[:, 0] - top2[:, 1]) / logits.abs().amax(-1)).min())
        gap = min(float(((r[:, k - 1] - r[:, k]) / r.abs().amax(-1)).min())
                  for r in (x.float().reshape(-1, x.shape[-1]).sort(-1, descending=True).values
                            for x in router))
        kv = allocate_kv_pool(ours.shape, 16, BLOCK, dtype=torch.bfloat16)
        table = list(range(16))[::-1]
        seq, cached = list(prompt), 0
        while len(seq) < len(prompt) + args.new:
            slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, len(seq))]
            batch = AttnBatch(cached == 0, [len(seq) - cached], [len(seq)], [table],
                              torch.tensor(slots))
            with torch.no_grad():
                step = ours(torch.tensor(seq[cached:]), torch.tensor(range(cached, len(seq))),
                            batch, kv)
            cached = len(seq)
            seq.append(int(step[0].argmax()))
        mine = seq[len(prompt):]
        agree = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), args.new)
        is_clear = margin > args.margin and gap > args.router_gap
        parted += agree < args.new
        clear += is_clear
        clear_parted += is_clear and agree < args.new
        print(f"{family:9s} prompt {i:3d}: agree {agree:2d}/{args.new}  margin {margin:.4f}  "
              f"router gap {gap:.4f}{'  clear' if is_clear else ''}")
    print(f"{family}: {parted} of {args.prompts} prompts part; {clear} clear "
          f"(margin > {args.margin}, router gap > {args.router_gap}), of which "
          f"{clear_parted} part")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["mixtral", "qwen3_moe", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new", type=int, default=8, help="greedy tokens per prompt")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--margin", type=float, default=0.012)
    ap.add_argument("--router-gap", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not dtypes.cpu_supports(torch.bfloat16, dtypes.cpu_flags()):
        print("note: this CPU lacks AVX512-BF16/AMX-BF16; bf16 runs emulated (slow), "
              "and the engine itself would serve fp32 here")
    torch.set_num_threads(args.threads)
    for family in (["mixtral", "qwen3_moe"] if args.family == "both" else [args.family]):
        run(family, args)


if __name__ == "__main__":
    main()
