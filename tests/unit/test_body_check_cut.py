"""`api_schema.Body.check` checks a body against the schema cut down to the body's keys
(one compiled check per key set, bounded): it must accept and refuse exactly what the
whole schema's check does, with the same 400, and the parsed request must be the same."""
from __future__ import annotations

import copy
import random

import pytest

from appliance.daemon import api_schema
from appliance.daemon.api_error import ApiError
from appliance.daemon.api_schema import Body
from appliance.daemon.openai_protocol import parse_request
from appliance.daemon.openai_schema import CHAT, COMPLETIONS

CHAT_BASE = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETIONS_BASE = {"model": "m", "max_tokens": 16, "prompt": "Hi"}

# Values a field may be given, right or wrong for it.
VALUES = [None, 0, 1, -1, 2, 3.5, 1e9, True, False, "", "x", "auto", [], ["a"], ["a"] * 5,
          [1, 2], {}, {"type": "text"}, {"5": 1.0}, {"x": 1}, {"5": 500},
          [{"role": "user", "content": "a"}], [{"role": "tool", "content": "a"}],
          [{"role": "user", "tool_calls": [{"function": {"name": "f"}}]}],
          [{"role": "nobody"}], [{"type": "function", "function": {"name": "f"}}]]
FIELDS = ["temperature", "top_p", "n", "stream", "stream_options", "stop", "logit_bias",
          "seed", "messages", "prompt", "tools", "tool_choice", "response_format",
          "logprobs", "top_logprobs", "priority", "min_tokens", "stop_token_ids",
          "unknown_field", "structured_outputs", "guided_choice", "echo"]


def outcome(check, body):
    """What a check says of a body: None (accepted) or the 400's fields."""
    try:
        check(body)
    except ApiError as err:
        return (err.status, err.message, err.param, err.code)
    return None


def whole(body_schema: Body):
    """The whole schema's check, as `Body.check` answered before the cuts."""
    def check(body):
        try:
            body_schema._validate(body)
        except Exception as exc:
            raise api_schema.schema_error(exc) from None
    return check


def mutations(base: dict, n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        body = copy.deepcopy(base)
        for field in rng.sample(FIELDS, rng.randint(1, 3)):
            body[field] = copy.deepcopy(rng.choice(VALUES))
        if rng.random() < 0.1:
            del body[rng.choice(sorted(body))]
        yield body


@pytest.mark.parametrize("schema,base", [(CHAT, CHAT_BASE), (COMPLETIONS, COMPLETIONS_BASE)],
                         ids=["chat", "completions"])
def test_the_cut_check_accepts_and_refuses_as_the_whole_schema(schema, base, monkeypatch):
    monkeypatch.setattr(api_schema, "SPECIALIZED_KEY_SETS", 10_000)
    cut = Body(schema.schema)
    full = whole(Body(schema.schema))
    refused = accepted = 0
    for body in mutations(base, 300, seed=len(base)):
        expected = outcome(full, copy.deepcopy(body))
        assert outcome(cut.check, copy.deepcopy(body)) == expected, body
        refused += expected is not None
        accepted += expected is None
    assert refused > 50 and accepted > 20       # both sides of the line were exercised
    assert len(cut._by_keys) > 5


def test_a_cut_check_parses_to_the_same_request_as_the_whole_schema():
    """The whole schema's check also wrote absent fields' defaults into the body; the
    parsed request must not depend on that."""
    body = {**CHAT_BASE, "temperature": None, "stop": "x", "seed": 3}
    filled = copy.deepcopy(body)
    CHAT._validate(filled)                   # the whole check: defaults written in
    assert filled["frequency_penalty"] == 0.0 and "frequency_penalty" not in body
    assert parse_request(copy.deepcopy(body), "chat") == parse_request(filled, "chat")


def test_the_key_sets_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(api_schema, "SPECIALIZED_KEY_SETS", 3)
    body_schema = Body(CHAT.schema)
    for extra in ({"temperature": 1}, {"top_p": 1}, {"seed": 1}, {"n": 1}, {"stream": True}):
        body_schema.check({**CHAT_BASE, **extra})
    assert len(body_schema._by_keys) == 3
    # past the bound a body is still checked, by the whole schema
    with pytest.raises(ApiError) as err:
        body_schema.check({**CHAT_BASE, "n": 99})
    assert err.value.param == "n" and len(body_schema._by_keys) == 3
    # undeclared keys do not make key sets of their own
    before = dict(body_schema._by_keys)
    body_schema.check({**CHAT_BASE, "temperature": 1, "whatever": 1})
    assert body_schema._by_keys == before
