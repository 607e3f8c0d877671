"""Qwen3's thinking split from its answer (`reasoning.ThinkParser`): on what a Qwen3-style
template renders for known assistant turns, `<think>…</think>` comes back as
`reasoning_content`, the rest as content, a `<tool_call>` after the thinking as a call;
whole and streamed in any chunking, as text and token by token through the
detokenizer. `chat_template_kwargs` reaches the template (`enable_thinking: false`)
and renders what `transformers`' `apply_chat_template` renders."""
from __future__ import annotations

import json
import random

import pytest

from appliance.config import ConfigError, parse
from appliance.daemon.api_error import ApiError
from appliance.daemon.openai_protocol import parse_request
from appliance.daemon.reasoning import ThinkParser, detect_reasoning, opens_thinking
from appliance.daemon.tokenizer import ServedTokenizer
from appliance.daemon.tool_calls import HermesParser
from appliance.models.tiny import CHAT_TEMPLATE
from helpers.harmony import TEMPLATE as HARMONY
from helpers.qwen3 import OPEN_THINK_TEMPLATE, TEMPLATE, assistant_output, qwen3_checkpoint_files

USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMES = ["get_weather", "get_time"]


def _call(name, args):
    return {"id": "c", "type": "function", "function": {"name": name,
                                                        "arguments": json.dumps(args)}}


ANSWERS = {
    "reasoning+content": {"role": "assistant",
                          "reasoning_content": "The user asks about Paris.\n\nSo: sunny. <b>x</b>",
                          "content": "It is sunny in Paris, 21 °C."},
    "reasoning+calls": {"role": "assistant", "reasoning_content": "Two lookups needed.",
                        "tool_calls": [_call("get_weather", {"city": "Paris"}),
                                       _call("get_time", {"tz": "CET"})]},
    "content only": {"role": "assistant", "content": "Sunny."},
    "call only": {"role": "assistant", "tool_calls": [_call("get_time", {})]},
}


@pytest.fixture(scope="module")
def qwen_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "ckpt"
    qwen3_checkpoint_files(tiny_model, out)
    return out


@pytest.fixture(scope="module")
def qwen_tok(qwen_dir):
    return ServedTokenizer(qwen_dir)


def _render(tok, **kw):
    return lambda messages: tok.render_chat(messages, tools=[
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in NAMES], **kw)


def _expected(answer):
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in answer.get("tool_calls", [])]
    return answer.get("content") or "", calls, answer.get("reasoning_content") or ""


def _seen(content, calls, reasoning):
    return content, [(c.name, json.loads(c.arguments)) for c in calls], reasoning


def _stream(parser: ThinkParser, pieces) -> tuple[str, list, str]:
    content, calls, reasoning = "", [], ""
    for piece in pieces:
        c, k = parser.feed(piece)
        content, calls, reasoning = content + c, calls + k, reasoning + parser.take_reasoning()
    c, k = parser.finish()
    return content + c, calls + k, reasoning + parser.take_reasoning()


def test_detected_from_the_template_and_configurable(qwen_tok, qwen_dir, tiny_model):
    assert detect_reasoning(TEMPLATE, "hermes") == "qwen3"
    assert qwen_tok.reasoning_parser == "qwen3" and qwen_tok.tool_parser == "hermes"
    assert detect_reasoning(CHAT_TEMPLATE, "hermes") is None       # no <think> taught
    assert detect_reasoning(HARMONY, "harmony") is None            # its own channel
    assert ServedTokenizer(tiny_model).reasoning_parser is None
    assert ServedTokenizer(qwen_dir, reasoning_parser="none").reasoning_parser is None
    assert ServedTokenizer(tiny_model, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    assert parse('[engine]\nreasoning_parser = "none"\n').engine.reasoning_parser == "none"
    with pytest.raises(ConfigError, match="engine.reasoning_parser must be qwen3, none"):
        parse('[engine]\nreasoning_parser = "deepseek"\n')


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_whole_output_splits_into_reasoning_content_and_calls(qwen_tok, case):
    text = assistant_output(_render(qwen_tok), USER, ANSWERS[case])
    assert text.startswith("<think>") == ("reasoning_content" in ANSWERS[case])
    parser = ThinkParser(HermesParser(NAMES))
    assert _seen(*parser.split(text)) == _expected(ANSWERS[case])
    if "tool_calls" not in ANSWERS[case]:       # no tools offered: all of the answer is content
        content, calls, reasoning = ThinkParser(None).split(text)
        assert (content, calls, reasoning) == _expected(ANSWERS[case])


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_streamed_in_any_chunks_equals_whole(qwen_tok, case):
    text = assistant_output(_render(qwen_tok), USER, ANSWERS[case])
    want = _expected(ANSWERS[case])
    rng = random.Random(case)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _seen(*_stream(ThinkParser(HermesParser(NAMES)), pieces)) == want, pieces
    # one character at a time: every tag cut at every place
    assert _seen(*_stream(ThinkParser(HermesParser(NAMES)), list(text))) == want


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_streamed_token_by_token_through_the_detokenizer(qwen_tok, case):
    text = assistant_output(_render(qwen_tok), USER, ANSWERS[case])
    ids = qwen_tok.tok.encode(text, add_special_tokens=False).ids
    think = qwen_tok.tok.token_to_id("<think>")
    if "reasoning_content" in ANSWERS[case]:
        assert ids[0] == think          # one token, kept in the decoded text
    detok = qwen_tok.stream(True)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert _seen(*_stream(ThinkParser(HermesParser(NAMES)), pieces)) == _expected(ANSWERS[case])


def test_thinking_cut_short_is_all_reasoning_and_no_think_is_all_content():
    parser = ThinkParser(None)
    assert _stream(parser, ["<thi", "nk>\nstill ", "thinking\n</th"]) == \
        ("", [], "still thinking\n</th")
    assert ThinkParser(None).split("<think>\nstill thinking\n</th") == \
        ("", [], "still thinking\n</th")
    # Text that only looks like the tag's start is content, at once or at the end.
    assert _stream(ThinkParser(None), ["<th", "ere>"]) == ("<there>", [], "")
    assert _stream(ThinkParser(None), ["<thi"]) == ("<thi", [], "")
    assert ThinkParser(None).split("Answer <think>not a block</think>") == \
        ("Answer <think>not a block</think>", [], "")


def test_a_template_that_opens_the_block_leaves_the_model_in_it(qwen_dir, tmp_path):
    cfg = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        cfg | {"chat_template": OPEN_THINK_TEMPLATE}))
    tok = ServedTokenizer(tmp_path)
    ids = tok.encode_chat(USER)
    assert opens_thinking(tok.tok.decode(ids[-4:], skip_special_tokens=False))
    assert opens_thinking(tok.render_chat(USER))
    qwen = ServedTokenizer(qwen_dir)
    assert not opens_thinking(qwen.render_chat(USER))
    assert not opens_thinking(qwen.render_chat(USER, kwargs={"enable_thinking": False}))
    out = "The user wants weather.\n</think>\n\nSunny."
    assert ThinkParser(None, thinking=True).split(out) == ("Sunny.", [], "The user wants weather.")
    assert _stream(ThinkParser(None, thinking=True), list(out)) == \
        ("Sunny.", [], "The user wants weather.")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(qwen_dir, qwen_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(qwen_dir)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        ours = qwen_tok.render_chat(USER, kwargs=kwargs)
        assert ours == hf.apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                              **kwargs)
    off = qwen_tok.render_chat(USER, kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen_tok.render_chat(USER).endswith("</think>\n\n")


def _chat(**extra):
    return {"model": "m", "messages": USER, **extra}


def test_chat_template_kwargs_are_parsed_and_checked():
    req = parse_request(_chat(chat_template_kwargs={"enable_thinking": False}), "chat")
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert parse_request(_chat(), "chat").chat_template_kwargs is None
    for bad_kwargs, word in (({"messages": []}, "messages"),
                             ({"add_generation_prompt": False}, "add_generation_prompt"),
                             ({"not a name": 1}, "chat_template_kwargs"),
                             ("enable_thinking", "chat_template_kwargs")):
        with pytest.raises(ApiError) as err:
            parse_request(_chat(chat_template_kwargs=bad_kwargs), "chat")
        assert err.value.status == 400 and err.value.param == "chat_template_kwargs", bad_kwargs
        assert word in err.value.message
    with pytest.raises(ApiError) as err:
        parse_request({"model": "m", "prompt": "x",
                       "chat_template_kwargs": {"enable_thinking": False}}, "completions")
    assert err.value.param == "chat_template_kwargs"


def test_models_capabilities_name_the_reasoning_parser():
    from appliance.daemon.structured import capabilities
    assert capabilities("torch", "hermes", "qwen3")["reasoning_parser"] == "qwen3"
    assert capabilities("torch", "harmony", None)["reasoning_parser"] == "harmony"
    assert capabilities("torch", "hermes", None)["reasoning_parser"] is None
