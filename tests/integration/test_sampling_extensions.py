"""vLLM's sampling extensions on a real daemon with the torch engine: min_tokens,
stop_token_ids, skip_special_tokens, include_stop_str_in_output, min_p and
repetition_penalty; what is still not implemented is refused, naming the field."""
from __future__ import annotations

import pytest

from appliance.models.tiny import SPECIAL_IDS
from helpers.daemons import start_daemon

MODEL = "tiny-llama"
EOT = SPECIAL_IDS["<|eot_id|>"]
HEADER = SPECIAL_IDS["<|start_header_id|>"]


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("ext"), tiny_model, "--devices", "cpu",
                     "--engine", "torch", "--mode", "agg")
    yield d
    d.stop()


def complete(d, **kw):
    code, _, body = d.post("/v1/completions", {"model": MODEL, "prompt": "def main():",
                                               "temperature": 0, **kw})
    assert code == 200, body
    return body


def test_min_tokens_holds_off_the_end_of_sequence(daemon):
    forced_eos = {str(EOT): 100}
    r = complete(daemon, max_tokens=20, logit_bias=forced_eos)
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    r = complete(daemon, max_tokens=20, logit_bias=forced_eos, min_tokens=6)
    assert r["usage"]["completion_tokens"] == 7      # 6 held, then the EOS
    assert r["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_the_output(daemon):
    free = complete(daemon, max_tokens=8)
    r = complete(daemon, max_tokens=8, logit_bias={"1000": 100}, stop_token_ids=[1000])
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    assert free["usage"]["completion_tokens"] == 8
    code, _, err = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x",
                                                   "stop_token_ids": [999999]})
    assert code == 400 and err["error"]["param"] == "stop_token_ids"


def test_skip_special_tokens_false_shows_them(daemon):
    bias = {str(HEADER): 100}
    assert complete(daemon, max_tokens=2, logit_bias=bias)["choices"][0]["text"] == ""
    shown = complete(daemon, max_tokens=2, logit_bias=bias, skip_special_tokens=False)
    assert shown["choices"][0]["text"] == "<|start_header_id|>" * 2


def test_return_tokens_as_token_ids_names_the_sampled_and_alternative_ids(daemon, tiny_model):
    """Each logprob entry names its token "token_id:N": the ids, decoded, give the text
    (exact even where a token is part of a character), with the same log-probabilities."""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model / "tokenizer.json"))
    named = complete(daemon, max_tokens=12, logprobs=2)["choices"][0]
    ids = complete(daemon, max_tokens=12, logprobs=2,
                   return_tokens_as_token_ids=True)["choices"][0]
    tokens = ids["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    as_ints = [int(t.split(":", 1)[1]) for t in tokens]
    assert tok.decode(as_ints) == named["text"] == ids["text"]
    assert ids["logprobs"]["token_logprobs"] == named["logprobs"]["token_logprobs"]
    top = ids["logprobs"]["top_logprobs"][0]
    assert len(top) == 2 and all(k.startswith("token_id:") for k in top)
    code, _, chat = daemon.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True})
    assert code == 200, chat
    entries = chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3 and all(e["token"].startswith("token_id:") for e in entries)


def test_include_stop_str_in_output(daemon):
    text = complete(daemon, max_tokens=24)["choices"][0]["text"]
    stop = text[8:11]
    cut = complete(daemon, max_tokens=24, stop=[stop])["choices"][0]["text"]
    kept = complete(daemon, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert cut == text[:text.index(stop)]
    assert kept["choices"][0]["text"] == cut + stop
    assert kept["choices"][0]["finish_reason"] == "stop"


def test_min_p_and_repetition_penalty_change_sampling(daemon):
    base = complete(daemon, max_tokens=30)["choices"][0]["text"]
    # Greedy is the likeliest token, which min_p always keeps.
    assert complete(daemon, max_tokens=30, min_p=0.5)["choices"][0]["text"] == base
    # A token pushed up by a bias repeats; the repetition penalty halves its logit once
    # it has been seen, and other tokens come in.
    # (The random model's logit scale is not known in advance: the smallest bias that
    # makes the token repeat without the penalty is the one to try it with.)
    def tokens(**kw):
        r = complete(daemon, max_tokens=10, logprobs=1, **kw)
        return r["choices"][0]["logprobs"]["tokens"]

    lo, hi = 0.0, 64.0
    assert len(set(tokens(logit_bias={"1000": hi}))) == 1
    for _ in range(7):          # bisect to just above where it starts repeating
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(set(tokens(logit_bias={"1000": mid}))) == 1 else (mid, hi)
    assert len(set(tokens(logit_bias={"1000": hi}, repetition_penalty=2.0))) > 1
    greedy = complete(daemon, max_tokens=6)["choices"][0]["text"]
    hot = {complete(daemon, max_tokens=6, temperature=1.5, seed=s)["choices"][0]["text"]
           for s in range(3)}
    assert greedy not in hot
    for s in range(3):          # min_p 1 leaves only the likeliest token: greedy
        r = complete(daemon, max_tokens=6, temperature=1.5, seed=s, min_p=1.0)
        assert r["choices"][0]["text"] == greedy


@pytest.mark.parametrize("field, value", [
    ("use_beam_search", True), ("min_p", 1.5), ("repetition_penalty", 0), ("min_tokens", -1),
    ("skip_special_tokens", "no"), ("bad_words", ["x"]), ("allowed_token_ids", [1, 2])])
def test_unimplemented_or_bad_extensions_are_400(daemon, field, value):
    code, _, err = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x",
                                                   "max_tokens": 2, field: value})
    assert code == 400, err
    assert err["error"]["param"] == field


def test_min_tokens_above_max_tokens_is_400(daemon):
    code, _, err = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x",
                                                   "max_tokens": 2, "min_tokens": 3})
    assert code == 400 and err["error"]["param"] == "min_tokens"
