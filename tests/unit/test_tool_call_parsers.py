"""Tool-call parsing without a daemon: the parser family detected from a chat template,
whole and streamed text parsed alike, text that is not a call kept as content, and
`parallel_tool_calls = false`. (Through real daemons: tests/integration/test_tool_calls.py.)"""
from __future__ import annotations

import json
import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from appliance.daemon.tool_calls import detect_parser, new_parser

pytest.importorskip("xgrammar")

MODEL = "tiny-llama"
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- parsers, without a daemon ---------------------------------------------------------

def test_parser_families_are_detected_from_templates(tiny_model):
    assert ServedTokenizer(tiny_model).tool_parser == "hermes"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_parser("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert detect_parser("{% if tools %}<|python_tag|>{% endif %}ipython") == "llama3_json"


@pytest.mark.parametrize("family, text", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'),
])
def test_each_family_parses_whole_and_streamed_the_same(family, text):
    names = ["get_time", "get_weather"]
    content, calls = new_parser(family, names).parse(text)
    assert [c.name for c in calls] == names
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "unit": "celsius"}
    assert content.strip() in ("", "Sure.")
    parser, streamed, got = new_parser(family, names), "", []
    for k in range(0, len(text), 5):
        piece, new = parser.feed(text[k:k + 5])
        streamed += piece
        got += new
    piece, new = parser.finish()
    streamed, got = streamed + piece, got + new
    assert streamed == content
    assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]


def test_text_that_is_not_a_call_stays_content():
    for family, text in (("hermes", "a <tool_call> that never closes"),
                         ("hermes", "a <tool_call>{\"name\": \"unknown\"}</tool_call>"),
                         ("llama3_json", "{not json at all"),
                         ("mistral", "plain [TOOL_ words")):
        parser = new_parser(family, ["get_time"])
        assert parser.parse(text) == (text, [])
        out = "".join(parser.feed(text[k:k + 4])[0] for k in range(0, len(text), 4))
        assert out + parser.finish()[0] == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    """The daemon's response shapes, on a model output with two calls."""
    from types import SimpleNamespace

    from appliance.daemon.completion import Completion
    from appliance.daemon.openai_protocol import parse_request

    text = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    for parallel, want in ((True, 2), (False, 1)):
        req = parse_request({"model": MODEL, "messages": ASK, "tools": [CLOCK],
                             "parallel_tool_calls": parallel}, "chat")
        svc = SimpleNamespace(tokenizer=SimpleNamespace(tool_parser="hermes", reasoning_parser=None),
                              model_name=MODEL, simulated=False, fingerprint="f",
                              next_request_id=lambda: "r1")
        comp = Completion(svc, req, "t")
        comp.choices[0].finish_reason = "stop"
        comp.choices[0].trace.cached_tokens = 0
        body = comp.full([text], [[]])
        assert len(body["choices"][0]["message"]["tool_calls"]) == want
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        # streamed: the same number of calls
        comp = Completion(svc, req, "t")
        comp.choices[0].finish_reason = "stop"
        out = comp.chunk(0, text, None) + comp.chunk(0, None, "stop")
        events = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line]
        ids = {d["id"] for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])
               if "id" in d}
        assert len(ids) == want
