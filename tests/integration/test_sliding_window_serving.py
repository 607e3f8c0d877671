"""Sliding-window models served by the real daemon in disagg mode (KV handed from the
prefill worker to the decode worker): a Mistral-style checkpoint and a Gemma 3 text
checkpoint, both with windows far shorter than their prompts, answer token for token what
`transformers` generates from the same files; Gemma's chat template renders as
transformers renders it."""
from __future__ import annotations

import json
import shutil

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import start_daemon

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

W = 16
# Gemma 3's chat template as google/gemma-3-1b-it's tokenizer_config.json has it.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
LONG = ("import os, sys\nfrom pathlib import Path\n\n\ndef load_config(path):\n"
        "    with open(path) as f:\n        return f.read()\n\n\nclass Parser:\n"
        "    def __init__(self, text):\n        self.text = text\n")


def _randomize(model, seed: int, norm_mean: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_mean + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _gemma_dir(tiny_model, path):
    """The generated tiny model's tokenizer beside a random Gemma 3 text model (two local
    layers with a 16-token window, one global) and Gemma's chat template."""
    shutil.copytree(tiny_model, path)
    tiny = json.loads((path / "config.json").read_text())
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    cfg = transformers.Gemma3TextConfig(
        vocab_size=tiny["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, sliding_window=W, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=tiny["bos_token_id"], eos_token_id=tiny["eos_token_id"], pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    _randomize(model, 5, 0.0)
    model.save_pretrained(path, safe_serialization=True)
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["chat_template"] = GEMMA_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return path


def _mistral_dir(tiny_model, path):
    """The tiny Llama weights as a Mistral v0.1-style checkpoint with a 16-token window."""
    shutil.copytree(tiny_model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=W)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _reference(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()

    def generate(ids, n):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=1)
        return out[0, len(ids):].tolist()
    return generate


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_windowed_model_served_past_its_window(family, tiny_model, tmp_path):
    """Disagg, prefill in chunks of 8 (each crossing the window's edge at some point):
    prompts several windows long give transformers' greedy tokens, the whole context is
    served (no cap at the window), and every block comes back."""
    make = _mistral_dir if family == "mistral" else _gemma_dir
    path = make(tiny_model, tmp_path / f"tiny-{family}")
    torch.set_num_threads(1)
    reference = _reference(path)
    tok = ServedTokenizer(path)
    d = start_daemon(tmp_path / "d", path, "--devices", "cpu", "--engine", "torch",
                     config="[engine]\nprefill_chunk_tokens = 8\n")
    try:
        status = d.status()
        assert {w["role"] for w in status["workers"]} == {"prefill", "decode"}
        (info,) = d.client().models.list().data
        cfg = json.loads((path / "config.json").read_text())
        assert info.model_extra["max_model_len"] == cfg["max_position_embeddings"] > W
        ids = tok.encode(LONG)
        assert len(ids) > 3 * W
        r = d.client().completions.create(model=info.id, prompt=ids, max_tokens=24,
                                          temperature=0)
        want = reference(ids, 24)
        assert len(want) > 8 and r.usage.completion_tokens == len(want)
        assert r.choices[0].text == tok.decode(want)
        if family == "gemma3":
            messages = [{"role": "system", "content": "Answer in code."},
                        {"role": "user", "content": LONG}]
            hf = transformers.AutoTokenizer.from_pretrained(path)
            rendered = hf.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
            assert rendered == (f"{hf.bos_token}<start_of_turn>user\nAnswer in code.\n\n"
                                f"{LONG.strip()}<end_of_turn>\n<start_of_turn>model\n")
            chat_ids = tok.encode_chat(messages)
            assert chat_ids == hf(rendered, add_special_tokens=False)["input_ids"]
            c = d.client().chat.completions.create(model=info.id, messages=messages,
                                                   max_tokens=16, temperature=0)
            assert c.choices[0].message.content == tok.decode(reference(chat_ids, 16))
    finally:
        d.stop()
