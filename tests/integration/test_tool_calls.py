"""Tool calling through the official `openai` client against real daemons (simulator and
the torch engine with random weights): tools rendered by the tiny model's template,
`tool_choice` required/named forced by the grammar (so a random model returns a valid
call), calls parsed back whole and streamed, the history's calls and results accepted."""
from __future__ import annotations

import json

import openai
import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import engine_daemon, start_daemon

pytest.importorskip("xgrammar")

MODEL = "tiny-llama"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["sim", "torch"])
def daemon(request, tiny_model, tmp_path_factory):
    d = engine_daemon(request.param, tiny_model, tmp_path_factory, "tools")
    yield d
    d.stop()


def check_call(call, allowed=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in allowed
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
    else:
        assert args["zone"] in ("UTC", "CET")
    return args


def test_required_tool_choice_returns_a_valid_call(daemon):
    r = daemon.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=80, n=2, seed=3)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        assert len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0])


def test_named_tool_choice_calls_that_function(daemon):
    r = daemon.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call(call)


def test_streamed_calls_come_as_openai_streams_them(daemon):
    chunks = list(daemon.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
        seed=8, stream=True))
    deltas = [d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2         # arguments come in fragments
    args = "".join(d.function.arguments for d in deltas)
    assert set(json.loads(args)) == {"city", "unit"}
    finals = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finals == ["tool_calls"]
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert "<tool_call>" not in content


def test_auto_with_a_model_that_answers_in_text_returns_text(daemon):
    r = daemon.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=12, seed=1)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content
    assert c.finish_reason in ("stop", "length")


def test_tool_choice_none_renders_no_tools(daemon, tiny_model):
    tok = ServedTokenizer(tiny_model)
    r = daemon.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == len(tok.encode_chat(ASK))
    r = daemon.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=2)
    assert r.usage.prompt_tokens == len(tok.encode_chat(ASK, tools=[WEATHER]))
    assert r.usage.prompt_tokens > len(tok.encode_chat(ASK)) + 20


def test_a_history_with_calls_and_results_is_rendered(daemon, tiny_model):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = daemon.client().chat.completions.create(model=MODEL, messages=history,
                                                tools=[WEATHER], max_tokens=3)
    text = ServedTokenizer(tiny_model).render_chat(history, [WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(ServedTokenizer(tiny_model).encode_chat(history, tools=[WEATHER]))


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {}}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_tool_requests_are_400(daemon, extra, param):
    code, _, err = daemon.post("/v1/chat/completions", {
        "model": MODEL, "messages": ASK, **extra})
    assert code == 400, err
    assert err["error"]["param"] == param, err


def test_bad_history_and_completions_tools_are_400(daemon):
    code, _, err = daemon.post("/v1/chat/completions", {
        "model": MODEL, "messages": ASK + [{"role": "tool", "content": "x"}]})
    assert code == 400 and err["error"]["param"] == "messages[1].tool_call_id", err
    with pytest.raises(openai.BadRequestError) as exc:
        daemon.client().completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_body={"tools": [WEATHER]})
    assert exc.value.body["param"] == "tools"


def test_configured_tool_parser_overrides_the_template(tiny_model, tmp_path):
    from appliance import config
    assert ServedTokenizer(tiny_model, "mistral").tool_parser == "mistral"
    assert ServedTokenizer(tiny_model, "none").tool_parser is None
    with pytest.raises(config.ConfigError, match="tool_parser"):
        config.parse('[engine]\ntool_parser = "qwen"\n', "test")
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "sim",
                     "--mode", "agg", config='[engine]\ntool_parser = "none"\n')
    try:
        (model,) = d.client().models.list().data
        assert model.model_extra["capabilities"]["tools"] is False
        code, _, err = d.post("/v1/chat/completions", {"model": MODEL, "messages": ASK,
                                                       "tools": [WEATHER]})
        assert code == 400 and err["error"]["param"] == "tools", err
    finally:
        d.stop()
