"""A gpt-oss checkpoint whose harmony chat template is kept only in chat_template.jinja,
served by the daemon: a chat request renders through that template (harmony's markers as
single special tokens) and the answer is the harmony parser's split of exactly the tokens
`transformers`' greedy `generate` writes — `content`, `reasoning_content` — whole and
streamed, with no special token leaking to the client. (A tiny random model writes no
meaningful harmony; the parser itself is tested on rendered messages in
tests/unit/test_harmony_parser.py.)"""
from __future__ import annotations

import json
import shutil

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from appliance.daemon.tool_calls import HarmonyParser
from helpers.daemons import start_daemon
from helpers.harmony import TEMPLATE, add_harmony_tokens

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("gpt-oss") / "tiny-gpt-oss"
    ckpt.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        shutil.copy(tiny_model / name, ckpt / name)
    vocab = add_harmony_tokens(ckpt / "tokenizer.json")
    tcfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tcfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    cfg = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, max_position_embeddings=1024,
        tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(ckpt, safe_serialization=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    torch.set_num_threads(1)
    d = start_daemon(tmp_path_factory.mktemp("harmony-daemon"), ckpt, "--devices", "cpu",
                     "--engine", "torch")
    yield ckpt, d, ServedTokenizer(ckpt), ref
    d.stop()


def _greedy(ref, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                           pad_token_id=1)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_chat_renders_through_the_harmony_template_and_splits_channels(served, tools):
    ckpt, d, tok, ref = served
    assert tok.tool_parser == "harmony"
    prompt = tok.encode_chat(MESSAGES, tools=tools)
    start = tok.tok.token_to_id("<|start|>")
    gen = tok.tok.encode("<|start|>assistant", add_special_tokens=False).ids
    # system, developer, user, and the generation prompt: each marker one token
    assert prompt.count(start) == 4 and prompt[-len(gen):] == gen
    want = _greedy(ref, prompt)
    text = tok.tok.decode(want, skip_special_tokens=False)
    content, calls, reasoning = HarmonyParser([t["function"]["name"] for t in tools or []],
                                              tools=bool(tools)).split(text)
    extra = {"tools": tools} if tools else {}
    client = d.client()
    r = client.chat.completions.create(model=ckpt.name, messages=MESSAGES,
                                       max_tokens=MAX_TOKENS, temperature=0, **extra)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(want)
    msg = r.choices[0].message
    assert (msg.content or "") == content
    assert (msg.model_extra or {}).get("reasoning_content", "") == reasoning
    assert [c.function.name for c in msg.tool_calls or []] == [c.name for c in calls]
    assert "<|" not in (msg.content or "") or "<|" in tok.decode(want)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")

    stream = client.chat.completions.create(model=ckpt.name, messages=MESSAGES,
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, **extra)
    s_content, s_reasoning, finish = "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        s_content += delta.content or ""
        s_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (s_content, s_reasoning) == (content, reasoning)
    assert finish == r.choices[0].finish_reason


def test_forcing_a_call_on_a_harmony_model_is_a_clear_400(served):
    ckpt, d, _, _ = served
    (info,) = d.client().models.list().data
    caps = info.model_extra["capabilities"]
    assert caps["tool_parser"] == "harmony" and caps["tools"] is True
    assert caps["tool_choice_required"] is False
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        d.client().chat.completions.create(model=ckpt.name, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", max_tokens=4)
    assert "harmony" in str(err.value)
