"""Request parameters are checked against the served model in one place, the daemon,
so every engine refuses the same requests the same way."""
from __future__ import annotations

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import start_daemon


@pytest.fixture(scope="module", params=["sim", "torch"])
def daemon(request, tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp(f"validate-{request.param}"), tiny_model,
                     "--devices", "cpu", "--engine", request.param, "--mode", "agg")
    yield d
    d.stop()


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
@pytest.mark.parametrize("token", ["vocab", "-1", "99999999"])
def test_out_of_vocabulary_logit_bias_is_400_on_every_engine(daemon, tiny_model, endpoint,
                                                            body, token):
    vocab = ServedTokenizer(tiny_model).vocab_size
    token = str(vocab) if token == "vocab" else token
    status, headers, err = daemon.post(endpoint, {"model": "tiny-llama", "max_tokens": 2,
                                                  "logit_bias": {token: 5}, **body})
    assert status == 400, err
    assert err["error"]["param"] == "logit_bias"
    assert err["error"]["code"] == "invalid_value"
    if token != "-1":       # (a negative id is not a token id at all: refused when parsed)
        assert f"[0, {vocab})" in err["error"]["message"]


def test_in_vocabulary_logit_bias_steers_every_engine(daemon, tiny_model):
    vocab = ServedTokenizer(tiny_model).vocab_size
    status, _, r = daemon.post("/v1/completions", {
        "model": "tiny-llama", "prompt": "Hello", "max_tokens": 3, "temperature": 0,
        "logit_bias": {str(vocab - 1): 100}, "ignore_eos": True})
    assert status == 200, r
    assert r["usage"]["completion_tokens"] == 3
