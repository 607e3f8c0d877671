"""Preparing a request is bounded in cost: prompts that cannot fit the context are refused
before anything is tokenized. (The pool's processes on a real daemon:
tests/integration/test_prepare_pool.py.)"""
from __future__ import annotations

import pytest

from appliance.daemon.completion import prepare_prompt
from appliance.daemon.openai_protocol import ApiError, parse_request
from appliance.daemon.tokenizer import ServedTokenizer


def test_prompts_that_cannot_fit_are_refused_before_tokenizing(tiny_model):
    tok = ServedTokenizer(tiny_model)

    class CountingTokenizer:
        """The served tokenizer, counting calls that do the expensive work."""
        calls = 0
        max_token_chars = tok.max_token_chars
        vocab_size = tok.vocab_size

        def encode(self, *a, **kw):
            CountingTokenizer.calls += 1
            return tok.encode(*a, **kw)

        def encode_chat(self, *a, **kw):
            CountingTokenizer.calls += 1
            return tok.encode_chat(*a, **kw)

    ctok = CountingTokenizer()
    many = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}] * 5000},
                         "chat")
    long_word = parse_request({"model": "m", "prompt": "a" * 1_000_000}, "completions")
    for req in (many, long_word):
        with pytest.raises(ApiError) as e:
            prepare_prompt(ctok, req, "m", 4096)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert CountingTokenizer.calls == 0
    # The bound is a lower bound: what may fit is tokenized and judged on its tokens.
    fits = parse_request({"model": "m", "prompt": "hello " * 1000}, "completions")
    prompt, max_tokens = prepare_prompt(ctok, fits, "m", 4096)
    assert CountingTokenizer.calls == 1 and prompt == tok.encode("hello " * 1000)
    assert max_tokens == 4096 - len(prompt)
