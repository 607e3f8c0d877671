"""MoE in bf16 against `transformers` in bf16: given the same input, the router's choice
and weights and the whole MoE block's output are bit for bit transformers' (Qwen3-MoE with
and without `norm_topk_prob`, gpt-oss with its biased experts). What parts the two
models' greedy tokens after a few steps is upstream of the router: attention and the
norms round differently in bf16 (other kernels), and a near-tie in a router turns that
unit in the last place into another expert (docs/engines/torch.md, "bf16 and MoE")."""
from __future__ import annotations

import pytest
import torch

from appliance.engines.loader import load_model

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

VOCAB = 500


def _qwen3_moe(norm_topk_prob):
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=256)


def _gpt_oss(_):
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=12, max_position_embeddings=256,
        tie_word_embeddings=False)


CASES = {"qwen3_moe-norm": (_qwen3_moe, True), "qwen3_moe-raw": (_qwen3_moe, False),
         "gpt_oss": (_gpt_oss, None)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_block_is_bitwise_transformers_in_bf16(case, tmp_path):
    make, arg = CASES[case]
    cls, cfg = make(arg)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            norm = "norm" in name
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                    + (0.2 if norm else 0.15) * torch.randn(p.shape, generator=g))
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ref = cls.from_pretrained(tmp_path, dtype=torch.bfloat16,
                              attn_implementation="eager").eval()
    ours = load_model(tmp_path, dtype=torch.bfloat16)

    routed, blocks = [], []
    for layer in ref.model.layers:
        router = layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate
        router.register_forward_hook(
            lambda m, a, out: routed.append((a[0].reshape(-1, a[0].shape[-1]), out)))
        layer.mlp.register_forward_hook(
            lambda m, a, out: blocks.append((a[0].reshape(-1, a[0].shape[-1]),
                                             (out[0] if isinstance(out, tuple) else out))))
    ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref(ids)
    assert len(routed) == len(blocks) == cfg.num_hidden_layers
    for li, ((x, (_, weights, experts)), (xb, out)) in enumerate(zip(routed, blocks)):
        mlp = ours.layers[li].mlp
        w, e = mlp.router(x)
        # the same experts in the same slots, and the same weights, to the bit
        assert torch.equal(e, experts), (case, li)
        assert w.dtype == weights.dtype == torch.bfloat16
        assert torch.equal(w, weights), (case, li)
        mine = mlp(xb)
        assert mine.dtype == torch.bfloat16
        assert torch.equal(mine, out.reshape(mine.shape)), (case, li)
        assert len(set(e.flatten().tolist())) > mlp.num_experts // 2    # many experts ran
