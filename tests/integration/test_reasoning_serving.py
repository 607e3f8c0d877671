"""A Qwen3 checkpoint with a Qwen3-style chat template (`<think>` blocks, Hermes tool
calls) served by the daemon in disaggregated mode, driven by the official `openai`
client: its thinking comes back as `reasoning_content` and its answer as `content`,
whole and streamed; a tool call after the thinking is a call; `chat_template_kwargs`
`{"enable_thinking": false}` reaches the template. A random-weights model never thinks
on its own, so a regex (`structured_outputs`) makes it write a thinking block: the split
is the daemon's, of what the model wrote."""
from __future__ import annotations

import json
import re

import pytest

from appliance.daemon.reasoning import ThinkParser
from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import start_daemon
from helpers.qwen3 import qwen3_checkpoint_files

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}]
THOUGHT = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n"
ANSWER = r"[A-Z][a-z]{2,10}\."


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("qwen3-think") / "tiny-qwen3-think"
    vocab = qwen3_checkpoint_files(tiny_model, ckpt)
    tok = ServedTokenizer(ckpt)
    im_end = tok.tok.token_to_id("<|im_end|>")
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=im_end,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(ckpt, safe_serialization=True)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [im_end]}))
    torch.set_num_threads(1)
    d = start_daemon(tmp_path_factory.mktemp("qwen3-think-daemon"), ckpt, "--devices", "cpu",
                     "--engine", "torch")
    yield ckpt, d, tok, model
    d.stop()


def _streamed(d, ckpt, **kw):
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in d.client().chat.completions.create(model=ckpt.name, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for c in delta.tool_calls or []:
            slot = calls.setdefault(c.index, ["", ""])
            slot[0] += (c.function.name or "") if c.function else ""
            slot[1] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, [tuple(v) for _, v in sorted(calls.items())], finish


def test_thinking_is_reasoning_content_and_the_answer_is_content(served):
    ckpt, d, _, _ = served
    (info,) = d.client().models.list().data
    caps = info.model_extra["capabilities"]
    assert (caps["reasoning_parser"], caps["tool_parser"]) == ("qwen3", "hermes")
    kw = dict(messages=USER, max_tokens=64, temperature=0,
              extra_body={"structured_outputs": {"regex": THOUGHT + ANSWER}})
    r = d.client().chat.completions.create(model=ckpt.name, **kw)
    msg = r.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and "<think>" not in reasoning and "\n" not in reasoning
    assert msg.content and "<think>" not in msg.content and "</think>" not in msg.content
    # What the model wrote is exactly the two put back in their block.
    assert re.fullmatch(THOUGHT + ANSWER, f"<think>\n{reasoning}\n</think>\n\n{msg.content}")
    assert r.choices[0].finish_reason == "stop"
    content, s_reasoning, calls, finish = _streamed(d, ckpt, **kw)
    assert (content, s_reasoning, calls, finish) == (msg.content, reasoning, [], "stop")


def test_a_tool_call_after_the_thinking_is_a_call(served):
    ckpt, d, _, _ = served
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
    kw = dict(messages=USER, max_tokens=96, temperature=0, tools=TOOLS,
              extra_body={"structured_outputs": {"regex": THOUGHT + call}})
    r = d.client().chat.completions.create(model=ckpt.name, **kw)
    msg = r.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and r.choices[0].finish_reason == "tool_calls"
    (tc,) = msg.tool_calls
    assert tc.function.name == "get_weather"
    assert re.fullmatch("[A-Z][a-z]{2,8}", json.loads(tc.function.arguments)["city"])
    assert not msg.content
    content, s_reasoning, calls, finish = _streamed(d, ckpt, **kw)
    assert (content, s_reasoning, finish) == ("", reasoning, "tool_calls")
    assert calls == [("get_weather", tc.function.arguments)]


def test_enable_thinking_false_reaches_the_template(served):
    ckpt, d, tok, model = served
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(ckpt)
    def ids(**kw):
        text = hf.apply_chat_template(USER, add_generation_prompt=True, tokenize=False, **kw)
        return hf(text, add_special_tokens=False)["input_ids"]
    off, on = ids(enable_thinking=False), ids()
    assert len(off) > len(on)       # the empty <think></think> block in the prompt
    with torch.inference_mode():
        want = model.generate(torch.tensor([off]), max_new_tokens=12, do_sample=False,
                              pad_token_id=1)[0, len(off):].tolist()
    content, _, reasoning = ThinkParser(None).split(tok.decode(want))
    r = d.client().chat.completions.create(
        model=ckpt.name, messages=USER, max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off)
    assert r.usage.completion_tokens == len(want)
    assert r.choices[0].message.content == content
    assert (r.choices[0].message.model_extra or {}).get("reasoning_content") in (None, reasoning or None)
    plain = d.client().chat.completions.create(model=ckpt.name, messages=USER, max_tokens=1)
    assert plain.usage.prompt_tokens == len(on)
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        d.client().chat.completions.create(
            model=ckpt.name, messages=USER, max_tokens=1,
            extra_body={"chat_template_kwargs": {"messages": []}})
    assert "chat_template_kwargs" in str(err.value)
