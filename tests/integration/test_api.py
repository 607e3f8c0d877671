"""The OpenAI-compatible API of a real daemon (sim engine, CPU, real worker processes),
driven by the official `openai` client and raw HTTP for malformed input."""
from __future__ import annotations

import json
import socket

import openai
import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import http, start_daemon

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("api"), tiny_model, "--devices", "cpu",
                     "--engine", "sim", "--sim-speed", "50",
                     config="[server]\nmax_body_bytes = 65536\n")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ServedTokenizer(tiny_model)


def chat(client, content="Hello there", **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_chat_usage_is_exact(daemon, tok):
    client = daemon.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "How are you?"}], max_tokens=12, seed=7)
    assert raw.headers["x-request-id"]
    r = raw.parse()
    assert raw.headers["x-request-id"] in r.id
    expected_prompt = len(tok.encode_chat([{"role": "user", "content": "How are you?"}]))
    assert r.usage.prompt_tokens == expected_prompt
    assert r.usage.completion_tokens == 12          # the simulator never emits EOS
    assert r.usage.total_tokens == expected_prompt + 12
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.model_extra["simulated"] is True


def test_max_completion_tokens_and_seed(daemon):
    client = daemon.client()
    a = chat(client, max_completion_tokens=9, seed=3)
    b = chat(client, max_completion_tokens=9, seed=3)
    c = chat(client, max_completion_tokens=9, seed=4)
    assert a.usage.completion_tokens == 9
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


def test_streaming_matches_non_streaming(daemon):
    client = daemon.client()
    full = chat(client, "stream me", max_tokens=20, seed=11)
    chunks = list(chat(client, "stream me", max_tokens=20, seed=11, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    # Without include_usage there is no usage chunk.
    plain = list(chat(client, "stream me", max_tokens=5, seed=11, stream=True))
    assert all(c.usage is None for c in plain)


def test_completions_text_and_token_prompts(daemon, tok):
    client = daemon.client()
    r = client.completions.create(model=MODEL, prompt="def main():", max_tokens=6, seed=1)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(tok.encode("def main():"))
    assert r.usage.completion_tokens == 6
    ids = tok.encode("def main():")
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, seed=1)
    assert r2.choices[0].text == r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="def main():", max_tokens=6,
                                            seed=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_stop_string_truncates(daemon):
    client = daemon.client()
    base = client.completions.create(model=MODEL, prompt="x = ", max_tokens=40, seed=5)
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=40, seed=5, stop=[stop])
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=40, seed=5, stop=stop, stream=True) if c.choices)
    assert streamed == text[:cut]


def test_models_health_ready_metrics(daemon):
    models = daemon.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["simulated"] is True
    assert http("GET", daemon.url + "/health")[0] == 200
    code, _, body = http("GET", daemon.url + "/ready")
    assert code == 200 and body["simulated"] is True
    chat(daemon.client(), max_tokens=2)
    code, _, text = http("GET", daemon.url + "/metrics")
    text = text.decode() if isinstance(text, bytes) else text
    assert code == 200
    host = socket.gethostname()     # [site] appliance = "" -> the host name, on every series
    assert (f'applianced_worker_up{{appliance="{host}",role="prefill",simulated="true",'
            f'site="local",worker="prefill0"}} 1.0') in text
    assert (f'applianced_requests_total{{appliance="{host}",model="tiny-llama",simulated="true",'
            f'site="local",status="ok",tenant="default"}}') in text


def _error(resp, status, code=None, param=None):
    got_status, headers, body = resp
    assert got_status == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return headers, body


@pytest.mark.parametrize("payload,param", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed"),
    ({"model": MODEL, "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
     "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 21}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": [5, 1]}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "min_p": 1.1}, "min_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 2.5}, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "suffix": "}"}, "suffix"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_parameters_are_400(daemon, payload, param):
    route = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
    _error(daemon.post(route, payload), 400, param=param)


def test_values_that_mean_off_are_accepted(daemon):
    code, _, body = daemon.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "min_p": 0, "repetition_penalty": 1, "tools": [], "response_format": {"type": "text"},
        "logprobs": False, "top_k": -1, "frequency_penalty": 0, "logit_bias": {"5": -100}})
    assert code == 200, body
    assert body["choices"][0]["logprobs"] is None


def test_n_choices_whole_and_streamed(daemon):
    c = daemon.client()
    r = chat(c, "Hi", max_tokens=5, n=3, seed=4, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens > 0
    one = chat(c, "Hi", max_tokens=5, seed=4, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == one.choices[0].message.content
    assert len({ch.message.content for ch in r.choices}) > 1

    stream = c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2, seed=9,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    texts, finish, usage_seen = ["", ""], [None, None], None
    for ch in stream:
        if ch.usage:
            usage_seen = ch.usage
        for choice in ch.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    whole = c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2, seed=9,
                                 extra_body={"ignore_eos": True})
    assert texts == [ch.text for ch in whole.choices] and finish == ["length", "length"]
    assert usage_seen.completion_tokens == 8


def test_echo_returns_the_prompt_first(daemon):
    code, _, body = daemon.post("/v1/completions", {"model": MODEL, "prompt": "Hello there",
                                                    "max_tokens": 3, "echo": True})
    assert code == 200, body
    text = body["choices"][0]["text"]
    assert text.startswith("Hello there") and len(text) > len("Hello there")
    code, _, body = daemon.post("/v1/completions", {"model": MODEL, "prompt": "Hello there",
                                                    "max_tokens": 0, "echo": True})
    assert code == 200 and body["choices"][0]["text"] == "Hello there"
    assert body["usage"]["completion_tokens"] == 0


def test_simulator_refuses_logprobs_in_one_line(daemon):
    _, body = _error(daemon.post("/v1/completions", {"model": MODEL, "prompt": "x",
                                                     "max_tokens": 2, "logprobs": 1}),
                     400, code="invalid_request")
    assert "not available from the sim engine" in body["error"]["message"]


def test_malformed_json_and_non_object(daemon):
    _error(daemon.post("/v1/chat/completions", raw=b'{"model": "tiny-llama", "messa'), 400,
           code="invalid_json")
    _error(daemon.post("/v1/completions", raw=b"[1, 2]"), 400)


def test_prompt_too_long_is_400(daemon, tok):
    ids = [5] * 5000
    _error(daemon.post("/v1/completions", {"model": MODEL, "prompt": ids}), 400,
           code="context_length_exceeded")
    _error(daemon.post("/v1/completions", {"model": MODEL, "prompt": [tok.vocab_size + 3]}), 400,
           param="prompt")


def test_unknown_model_and_route_are_404(daemon):
    with pytest.raises(openai.NotFoundError):
        daemon.client().chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "x"}])
    _error(daemon.post("/v1/chat/completions",
                       {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
           404, code="model_not_found", param="model")
    _error(http("GET", daemon.url + "/v1/nothing"), 404, code="unknown_route")


def test_body_too_large_is_413(daemon):
    big = json.dumps({"model": MODEL, "prompt": "a" * 100_000}).encode()
    _error(daemon.post("/v1/completions", raw=big), 413)


def test_request_ids_are_unique(daemon):
    ids = {daemon.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
    ).headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5


def test_content_parts_equal_plain_content(daemon):
    client = daemon.client()
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=5, seed=2, messages=[{"role": "user", "content": "ab cd"}])
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=5, seed=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "ab "}, {"type": "text", "text": "cd"}]}])
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content
    _error(daemon.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        400, param="messages[0].content")


def test_nulls_mean_defaults(daemon):
    code, headers, body = daemon.post("/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": None, "top_p": None,
        "seed": None, "stop": None, "stream": None, "n": None})
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == 3 and headers["X-Request-Id"]
