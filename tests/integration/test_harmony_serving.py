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
    # What ends a turn, as gpt-oss's generation_config.json says: <|return|>, <|call|>
    # and the end of text (save_pretrained writes it in place of the copied one).
    from tokenizers import Tokenizer
    ends = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    eos = [ends.token_to_id("<|return|>"), ends.token_to_id("<|call|>"), 1]
    cfg = transformers.GptOssConfig(eos_token_id=eos, 
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


# Bounded strings: a random model would otherwise write one until max_tokens.
FORCED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10}}}}},
                {"type": "function", "function": {
    "name": "book_table", "description": "Book a table.",
    "parameters": {"type": "object", "required": ["guests", "time"],
                   "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 12},
                                  "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                  "terrace": {"type": "boolean"}}}}}]


@pytest.mark.parametrize("choice", ["required", "get_weather", "book_table"])
def test_forcing_a_call_on_a_harmony_model_returns_a_valid_call(served, choice):
    """`tool_choice` "required" or a named function on gpt-oss: the grammar makes even
    random weights write one harmony call message, read back as a call whose arguments
    validate against the function's schema; whole and streamed."""
    import fastjsonschema
    ckpt, d, _, _ = served
    (info,) = d.client().models.list().data
    caps = info.model_extra["capabilities"]
    assert caps["tool_parser"] == "harmony" and caps["tool_choice_required"] is True
    assert caps["reasoning_parser"] == "harmony"
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    kw = dict(model=ckpt.name, messages=MESSAGES, tools=FORCED_TOOLS, tool_choice=tool_choice,
              max_tokens=64, temperature=0)
    r = d.client().chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    if choice != "required":
        assert call.function.name == choice
    args = json.loads(call.function.arguments)
    fastjsonschema.validate(schemas[call.function.name], args)
    assert not r.choices[0].message.content
    assert "<|" not in call.function.arguments

    name, arguments, finish = "", "", None
    for chunk in d.client().chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            name += tc.function.name or "" if tc.function else ""
            arguments += tc.function.arguments or "" if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(arguments), finish) == (call.function.name, args, "tool_calls")
