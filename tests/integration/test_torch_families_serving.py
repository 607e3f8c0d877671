"""Qwen3, Qwen3-MoE, Mixtral and gpt-oss checkpoints served by the real daemon in disaggregated mode
(the prefill worker computes the prompt, hands its KV blocks to the decode worker, which
decodes): greedy output through the OpenAI API is token for token `transformers`'
`generate` on the same files.

Each checkpoint is a tiny random config built with `transformers` and saved with
`save_pretrained`, with the generated tiny model's tokenizer (its vocabulary, chat
template and EOS ids) beside it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from appliance.models.tiny import VOCAB_SIZE
from helpers.daemons import ROOT, free_port, start_daemon

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    # Every other layer slides over 16 tokens: the prompts and outputs run past it.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=32, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=16)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
PROMPTS = [
    "Hello",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",   # > 1 block
    "import os, sys\nfrom pathlib import Path\n\ndef load_config(path):\n"
    "    with open(path) as f:\n        return f.read()\n",             # > 2 blocks
]


def _checkpoint(family: str, path: Path, tiny_model: Path) -> Path:
    cfg_cls, model_cls, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**(_COMMON | kw), attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():       # large enough that attention is sharp, routing decisive
        for name, p in model.named_parameters():
            scale = 0.2 if name.endswith("norm.weight") else 0.15
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                    + scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_model / name, path / name)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tiny_model, tmp_path_factory):
    """(family, checkpoint, disagg daemon, tokenizer, reference generate)."""
    family = request.param
    ckpt = _checkpoint(family, tmp_path_factory.mktemp(family) / f"tiny-{family}", tiny_model)
    torch.set_num_threads(1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def generate(ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                               pad_token_id=1)
        return out[0, len(ids):].tolist()

    d = start_daemon(tmp_path_factory.mktemp(f"{family}-disagg"), ckpt, "--devices", "cpu",
                     "--engine", "torch")
    yield family, ckpt, d, ServedTokenizer(ckpt), generate
    d.stop()


def test_served_greedy_equals_transformers_through_the_kv_handoff(served):
    family, ckpt, d, tok, generate = served
    status = d.status()
    assert status["engine"] == "torch" and status["simulated"] is False
    assert {w["role"] for w in status["workers"]} == {"prefill", "decode"}
    (info,) = d.client().models.list().data
    assert info.id == ckpt.name
    walked = set()
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        want = generate(ids, 20)
        r = d.client().completions.create(model=info.id, prompt=ids, max_tokens=20,
                                          temperature=0)
        assert r.usage.completion_tokens == len(want), prompt
        assert r.choices[0].text == tok.decode(want), (family, prompt)
        walked |= set(want)
    assert len(walked) > 5       # the model's output varies: a real comparison

    messages = [{"role": "user", "content": "Write a haiku about pipes."}]
    want = generate(tok.encode_chat(messages), 12)
    r = d.client().chat.completions.create(model=info.id, messages=messages, max_tokens=12,
                                           temperature=0)
    assert r.choices[0].message.content == tok.decode(want)
    # Both workers ran, and the decode worker decoded from imported KV, never recomputed.
    workers = {w["worker"]: w for w in d.status()["workers"]}
    assert workers["prefill0"]["iterations"] > 0 and workers["decode0"]["iterations"] > 0
    assert workers["decode0"]["kv_recomputes"] == 0


def test_unsupported_architecture_stops_serve_with_one_line(tiny_model, tmp_path):
    other = tmp_path / "deepseek"
    shutil.copytree(tiny_model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (other / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--model", str(other), "--engine", "torch",
         "--devices", "cpu", "--host", "127.0.0.1", "--port", str(free_port()),
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "unsupported architecture 'DeepseekV3ForCausalLM'" in lines[0]
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "MixtralForCausalLM"):
        assert arch in lines[0]


def test_simulator_sizes_gpus_from_a_checkpoint_directory(tmp_path):
    """`--model-spec DIR` on the simulator: a Qwen3-30B-A3B config.json is served under its
    directory's name, and each H100's KV pool is what its *total* weights (61 GB in bf16,
    every expert) leave, not its active ones (6.7 GB)."""
    import dataclasses

    from appliance.config import Config
    from appliance.engines.roofline import DeviceShape, StepTimeModel
    from appliance.models.specs import spec_from_hf_config
    from appliance.partitions.catalogue import lookup_gpu
    ckpt = tmp_path / "Qwen3-30B-A3B"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({     # Qwen/Qwen3-30B-A3B's, abridged
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    d = start_daemon(tmp_path / "d", None, "--engine", "sim", "--devices", "sim:2xH100",
                     "--model-spec", str(ckpt))
    try:
        (info,) = d.client().models.list().data
        assert info.id == "Qwen3-30B-A3B" and info.model_extra["max_model_len"] == 40960
        spec = spec_from_hf_config(ckpt)
        h100 = DeviceShape.from_gpu(lookup_gpu("H100"), spec.weight_bytes)
        tokens = StepTimeModel(h100, 1, spec).kv_capacity_tokens(0.9)
        total = h100.mem_bytes * 0.9 - spec.params * 2
        assert tokens == int(total // spec.kv_bytes_per_token())
        block = Config().engine.block_size
        for w in d.status()["workers"]:
            assert w["kv_blocks_total"] == tokens // block, w
        # Sized by the active weights instead, the pool would be over four times larger.
        by_active = StepTimeModel(h100, 1, dataclasses.replace(spec, params=spec.active_params))
        assert by_active.kv_capacity_tokens(0.9) > 4 * tokens
    finally:
        d.stop()
