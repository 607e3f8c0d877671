"""The harmony parser (gpt-oss) on what a harmony template renders for known assistant
turns: `analysis` comes back as reasoning, `final` as content, `commentary` messages to
`functions.NAME` as calls; whole and streamed in any chunking, as text and as the
token ids a tokenizer with harmony's special tokens decodes one by one."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from appliance.daemon.tool_calls import (HarmonyParser, ToolRequest, detect_parser,
                                         forced_grammar, new_parser)
from helpers.harmony import TEMPLATE, add_harmony_tokens, assistant_output

USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
NAMES = ["get_weather", "get_time"]


def _call(name, args):
    return {"id": "c", "type": "function", "function": {"name": name,
                                                        "arguments": json.dumps(args)}}


ANSWERS = {
    "final": {"role": "assistant", "content": "It is sunny in Paris."},
    "reasoning+final": {"role": "assistant",
                        "reasoning_content": "The user asks about weather. I know: sunny.",
                        "content": "Sunny, 21 °C — and \"clear\" <b>skies</b>."},
    "reasoning+calls": {"role": "assistant", "reasoning_content": "Need two lookups.",
                        "tool_calls": [_call("get_weather", {"city": "Paris"}),
                                       _call("get_weather", {"city": "Rome", "unit": "C"})]},
    "call": {"role": "assistant", "tool_calls": [_call("get_time", {})]},
}


@pytest.fixture(scope="module")
def harmony_tok(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("harmony") / "ckpt"
    shutil.copytree(tiny_model, out)
    add_harmony_tokens(out / "tokenizer.json")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return ServedTokenizer(out)


def _render(tok):
    return lambda messages: tok.render_chat(messages)


def _expected(answer):
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in answer.get("tool_calls", [])]
    return answer.get("content") or "", calls, answer.get("reasoning_content") or ""


def _seen(content, calls, reasoning):
    return content, [(c.name, json.loads(c.arguments)) for c in calls], reasoning


def test_the_template_is_detected_as_harmony(harmony_tok):
    assert detect_parser(TEMPLATE) == "harmony"
    assert harmony_tok.tool_parser == "harmony"


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_whole_output_splits_into_reasoning_content_and_calls(harmony_tok, case):
    text = assistant_output(_render(harmony_tok), USER, ANSWERS[case])
    assert text.startswith("<|channel|>")          # what the model writes after the prompt
    assert _seen(*HarmonyParser(NAMES).split(text)) == _expected(ANSWERS[case])


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_streamed_in_any_chunks_equals_whole(harmony_tok, case):
    text = assistant_output(_render(harmony_tok), USER, ANSWERS[case])
    rng = random.Random(case)
    for _ in range(20):
        parser = new_parser("harmony", NAMES)
        content, calls, reasoning, i = "", [], "", 0
        while i < len(text):
            step = rng.randint(1, 9)
            c, k = parser.feed(text[i:i + step])
            content, calls, reasoning = content + c, calls + k, reasoning + parser.take_reasoning()
            assert "<|" not in c and "<|" not in reasoning
            i += step
        c, k = parser.finish()
        content, calls = content + c, calls + k
        reasoning += parser.take_reasoning()
        assert _seen(content, calls, reasoning) == _expected(ANSWERS[case])


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_token_by_token_through_the_detokenizer(harmony_tok, case):
    """As the daemon reads it: token ids decoded one at a time with special tokens kept;
    each harmony marker is one token."""
    text = assistant_output(_render(harmony_tok), USER, ANSWERS[case])
    ids = harmony_tok.tok.encode(text, add_special_tokens=False).ids
    markers = {harmony_tok.tok.token_to_id(m) for m in ("<|channel|>", "<|message|>")}
    assert markers <= set(ids) and None not in markers
    detok = harmony_tok.stream(skip_special_tokens=False)
    parser = new_parser("harmony", NAMES)
    content, calls, reasoning = "", [], ""
    for t in ids:
        c, k = parser.feed(detok.push([t]))
        content, calls, reasoning = content + c, calls + k, reasoning + parser.take_reasoning()
    c, k = parser.feed(detok.flush())
    c2, k2 = parser.finish()
    content, calls = content + c + c2, calls + k + k2
    reasoning += parser.take_reasoning()
    assert _seen(content, calls, reasoning) == _expected(ANSWERS[case])


def test_model_end_tokens_and_header_variants():
    """What the model itself ends with (`<|return|>`, `<|call|>`), the recipient before
    the channel, a preamble to the user on commentary, and a call to an unknown tool."""
    text = ("<|channel|>analysis<|message|>think<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
            '{"tz": "CET"}<|call|>')
    content, calls, reasoning = HarmonyParser(NAMES).split(text)
    assert (content, reasoning) == ("Let me check.", "think")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "CET"})]
    text = "<|channel|>final<|message|>done<|return|>"
    assert HarmonyParser(NAMES).split(text)[:1] == ("done",)
    unknown = '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>'
    assert HarmonyParser(NAMES).split(unknown) == ("", [], "")
    # no tools offered: a call's text is not reported as a call
    no_tools = '<|channel|>commentary to=functions.get_time<|message|>{}<|call|>' \
               '<|start|>assistant<|channel|>final<|message|>ok<|return|>'
    assert HarmonyParser([], tools=False).split(no_tools) == ("ok", [], "")


def test_text_that_is_not_harmony_is_content():
    """A model that ignores the format (a random one does): its words are the answer,
    and `<|` that starts no marker is text."""
    for text in ("just words", "a <| b |> c", "x <|notamarker and more text than a token"):
        assert HarmonyParser(NAMES).split(text) == (text, [], "")
    parser = HarmonyParser(NAMES)
    out = "".join(parser.feed(ch)[0] for ch in "plain answer") + parser.finish()[0]
    assert out == "plain answer"


WEATHER_SCHEMA = {"type": "object", "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 12},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}


def _forced(choice="required", name=None):
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": WEATHER_SCHEMA}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {}}}}]
    return forced_grammar("harmony", ToolRequest(tools, choice=choice, name=name,
                                                 names=NAMES))


def _walk(book, spec, ids):
    """Feed ids to a fresh guide; the index of the first one it refuses (None: all taken)."""
    guide = book.guide(spec)
    for i, t in enumerate(ids):
        if t not in book.allowed(guide, ids[:i]):
            return i
    return None


def test_a_forced_call_is_a_grammar_for_harmonys_call_message(harmony_tok):
    """`tool_choice` required or named on a harmony model: a grammar whose only outputs
    are one commentary message to `functions.NAME` (its header written with harmony's
    special tokens) with arguments valid for NAME's schema, then a stop token."""
    pytest.importorskip("xgrammar")
    from appliance.engines.grammar import GrammarBook, check_guided
    tok = harmony_tok.tok
    stops = [tok.token_to_id("<|call|>"), 4]
    book = GrammarBook(harmony_tok.model_dir, 0, stops)
    required, named = _forced(), _forced("named", "get_time")
    assert required.kind == named.kind == "harmony_call"
    check_guided(required)

    def ids(text):
        return tok.encode(text, add_special_tokens=False).ids

    call = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris", "days": 3}')
    enc = ids(call)
    assert {tok.token_to_id(m) for m in ("<|channel|>", "<|constrain|>", "<|message|>")} <= set(enc)
    assert _walk(book, required, enc) is None
    guide = book.guide(required)
    assert set(book.allowed(guide, enc)) <= set(stops)          # complete: only a stop
    # the header's special tokens are the ones allowed first; nothing else special
    first = book.allowed(book.guide(required), [])
    assert tok.token_to_id("<|channel|>") in first
    for m in ("<|start|>", "<|end|>", "<|call|>", "<|return|>", "<|message|>"):
        assert tok.token_to_id(m) not in first
    # refused: another channel, an unknown function, arguments against the schema, an
    # end token inside the arguments, and (named) the other function
    for bad_text in ("<|channel|>final<|message|>hi",
                     "<|channel|>commentary to=functions.rm <|constrain|>json<|message|>{}",
                     call.replace('"days": 3', '"days": 9'),
                     call.replace('"Paris"', '"Paris and Rome"'),
                     call[:-1] + "<|call|>"):
        assert _walk(book, required, ids(bad_text)) is not None, bad_text
    assert _walk(book, named, enc) is not None
    time_call = ids("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}")
    assert _walk(book, named, time_call) is None
    assert book.compilations == 2


def test_a_forced_calls_text_parses_back_with_marker_text_in_its_arguments():
    """The grammar reads a header marker inside a JSON string as text of the string; the
    parser keeps it there (only an end closes a call's arguments)."""
    text = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "a<|message|>b<|channel|>"}')
    _, calls, _ = HarmonyParser(NAMES).split(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "a<|message|>b<|channel|>"})]
    # the stop token that ends a forced call (any end of text) is not part of it
    _, calls, _ = HarmonyParser(NAMES).split(text[:-2] + '"}<|end_of_text|>')
    assert json.loads(calls[0].arguments) == {"city": "a<|message|>b<|channel|>"}


# ---- the daemon's response shapes on a harmony answer --------------------------------

MODEL = "tiny-gpt-oss"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _completion(tools):
    from types import SimpleNamespace

    from appliance.daemon.completion import Completion
    from appliance.daemon.openai_protocol import parse_request
    body = {"model": MODEL, "messages": USER} | ({"tools": tools} if tools else {})
    svc = SimpleNamespace(tokenizer=SimpleNamespace(tool_parser="harmony", reasoning_parser=None), model_name=MODEL,
                          simulated=False, fingerprint="f", next_request_id=lambda: "r1")
    comp = Completion(svc, parse_request(body, "chat"), "t")
    comp.choices[0].finish_reason = "stop"
    comp.choices[0].trace.cached_tokens = 0
    return comp


@pytest.mark.parametrize("case", ["reasoning+final", "reasoning+calls"])
def test_response_shapes_whole_and_streamed(harmony_tok, case):
    """`message.reasoning_content` / `delta.reasoning_content`, content, `tool_calls` and
    finish_reason "tool_calls", from the text a harmony model writes (its end token too)."""
    answer = ANSWERS[case]
    text = assistant_output(_render(harmony_tok), USER, answer) + "<|return|>"
    want_content, want_calls, want_reasoning = _expected(answer)
    tools = [WEATHER] if "calls" in case else None

    body = _completion(tools).full([text], [[]])
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg.get("reasoning_content") == want_reasoning
    assert (msg["content"] or "") == want_content
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in msg.get("tool_calls", [])]
    assert calls == want_calls
    assert choice["finish_reason"] == ("tool_calls" if want_calls else "stop")

    comp = _completion(tools)
    out = b"".join(comp.chunk(0, text[k:k + 5], None, first=k == 0)
                   for k in range(0, len(text), 5)) + comp.chunk(0, None, "stop")
    events = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want_reasoning
    assert "".join(d.get("content") or "" for d in deltas) == want_content
    streamed = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = streamed.setdefault(c["index"], ["", ""])
            entry[0] += c.get("function", {}).get("name", "")
            entry[1] += c.get("function", {}).get("arguments", "")
    assert [(n, json.loads(a)) for n, a in streamed.values()] == want_calls
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert all("<|" not in json.dumps(d) for d in deltas)
