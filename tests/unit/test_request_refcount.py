"""A finished request leaves nothing behind: a dropped `Completion` is freed by reference
counting alone, with no cyclic collection (the daemon's tuned collector runs those
rarely; its memory under load is tests/integration/test_request_memory.py)."""
from __future__ import annotations

import gc
import random
import weakref
from types import SimpleNamespace

import orjson
import pytest

from appliance.daemon.completion import Completion
from appliance.daemon.openai_protocol import parse_body

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _chat_body(words: int, n: int = 1) -> bytes:
    text = " ".join(random.Random(words).choice(WORDS) for _ in range(words))
    return orjson.dumps({"model": "m", "n": n, "max_tokens": 4,
                         "messages": [{"role": "user", "content": text}]})


@pytest.mark.parametrize("n", [1, 3])
def test_a_dropped_completion_is_freed_by_reference_counting(n):
    """Without a cycle, the last reference going frees the request and its prompt at
    once, collector or not."""
    req = parse_body(_chat_body(1500, n), "chat")
    # What a Choice reads of the service at construction: the model's tool-call and
    # reasoning formats.
    svc = SimpleNamespace(tokenizer=SimpleNamespace(tool_parser="", reasoning_parser=None))
    comp = Completion(svc, req, "t", "rid-1", 1.0)
    comp.prompt = list(range(1000, 3000))
    assert len(comp.choices) == n
    prompt_owner = weakref.ref(comp)
    was = gc.isenabled()
    gc.disable()
    try:
        del comp
        assert prompt_owner() is None, [type(r).__name__ for r in gc.get_referrers(prompt_owner())]
    finally:
        if was:
            gc.enable()
