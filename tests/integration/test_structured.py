"""Structured outputs: response_format and vLLM's structured_outputs / guided_* through
the official `openai` client against real daemons (simulator, and the torch engine with
random weights in disaggregated mode, so the grammar crosses the prefill->decode
handoff). A random model's output is valid for the schema only because of the grammar:
that is what these tests check."""
from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from appliance.engines.grammar import MAX_SCHEMA_BYTES
from helpers.daemons import engine_daemon

pytest.importorskip("xgrammar")

MODEL = "tiny-llama"


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    kind: Literal["cat", "dog", "fish"]


PET_SCHEMA = Pet.model_json_schema()


def valid_pet(text: str) -> Pet:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "vaccinated", "kind"}, obj
    return Pet.model_validate(obj)


@pytest.fixture(scope="module", params=["sim", "torch"])
def daemon(request, tiny_model, tmp_path_factory):
    d = engine_daemon(request.param, tiny_model, tmp_path_factory, "structured",
                      config="[server]\nlog_requests = true\n")
    d.engine = request.param
    yield d
    d.stop()


def ask(client, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON"}], **kw)


def test_json_schema_output_is_valid_for_every_choice(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA,
                                                  "strict": True}}
    r = ask(daemon.client(), response_format=fmt, n=3, seed=5, temperature=1.0)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c
        valid_pet(c.message.content)


def test_parse_helper_returns_a_pydantic_object(daemon):
    r = daemon.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "a pet"}], response_format=Pet,
        max_tokens=120, temperature=0)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert pet == valid_pet(r.choices[0].message.content)


def test_streamed_structured_output_is_valid(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    chunks = list(ask(daemon.client(), response_format=fmt, stream=True, seed=9, n=2))
    texts = {0: "", 1: ""}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        valid_pet(text)


def test_max_tokens_cuts_the_json_with_finish_length(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    r = ask(daemon.client(), response_format=fmt, max_tokens=4, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 4
    assert '{"name": "'.startswith(c.message.content[:10])  # the schema's first property
    with pytest.raises(ValueError):
        json.loads(c.message.content)


def test_json_object_mode_gives_an_object(daemon):
    r = ask(daemon.client(), response_format={"type": "json_object"}, max_tokens=300, seed=3,
            temperature=0)
    c = r.choices[0]
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:   # a random model may write a long object; what it wrote is still an object
        assert c.finish_reason == "length"


def test_completions_endpoint_takes_response_format(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    r = daemon.client().completions.create(model=MODEL, prompt="pet:", max_tokens=120,
                                           seed=2, extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop"
    valid_pet(r.choices[0].text)


def test_vllm_spellings_choice_regex_and_alias(daemon):
    client = daemon.client()
    r = ask(client, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
            seed=4, n=3)
    assert {c.message.content for c in r.choices} <= {"yes", "no", "maybe"}
    assert all(c.finish_reason == "stop" for c in r.choices)
    r = ask(client, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"}, seed=4)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    r = ask(client, extra_body={"guided_json": PET_SCHEMA}, seed=4)
    valid_pet(r.choices[0].message.content)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": "{not json"}}},
     "response_format", "not JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format", "'not' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strng"}}}}, "response_format", "strng"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"$ref": "#/nope"}}}},
     "response_format", "nope"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_regex": "(("}, "guided_regex", "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json", "only one"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "grammar"),
])
def test_bad_constraints_are_a_400_naming_the_field(daemon, body, param, words):
    code, _, err = daemon.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert code == 400, err
    assert err["error"]["param"] == param
    assert words in err["error"]["message"], err


def test_deep_and_huge_schemas_are_refused(daemon):
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                             for i in range(MAX_SCHEMA_BYTES // 200)}}
    for schema, words in ((deep, "deeper"), (huge, "bytes")):
        with pytest.raises(openai.BadRequestError) as exc:
            ask(daemon.client(), response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}})
        assert exc.value.body["param"] == "response_format"
        assert words in exc.value.body["message"]


def test_models_advertise_capabilities(daemon):
    (model,) = daemon.client().models.list().data
    caps = model.model_extra["capabilities"]
    assert caps["json_schema"] is True and caps["json_object"] is True
    assert caps["tools"] is True and caps["tool_choice_required"] is True
    assert caps["tool_parser"] == "hermes"


def test_request_records_say_when_a_grammar_was_applied(daemon):
    client = daemon.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    guided = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
        response_format=fmt).headers["x-request-id"]
    free = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}],
        max_tokens=5).headers["x-request-id"]
    import time
    deadline = time.monotonic() + 10
    rows = {}
    while time.monotonic() < deadline and len(rows) < 2:
        for line in daemon.log_text().splitlines():
            if line.startswith("{") and '"request_id"' in line:
                row = json.loads(line)
                if row["request_id"] in (guided, free):
                    rows[row["request_id"]] = row
        time.sleep(0.1)
    assert rows[guided]["structured"] is True
    assert rows[free]["structured"] is False


def test_logprobs_come_with_structured_output(daemon):
    if daemon.engine == "sim":
        pytest.skip("the simulator has no logprobs")
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    r = ask(daemon.client(), response_format=fmt, logprobs=True, top_logprobs=2, seed=6)
    c = r.choices[0]
    valid_pet(c.message.content)
    tokens = c.logprobs.content
    assert "".join(t.token for t in tokens) == c.message.content
    # The model's own log-probabilities (before the mask): the grammar's forced tokens
    # are not certain for a random model.
    assert any(t.logprob < -0.5 for t in tokens)
    assert all(len(t.top_logprobs) == 2 for t in tokens)


def test_guided_requests_share_steps_with_unguided_ones(daemon):
    """Guided requests sent while unguided ones decode land in the same steps, after
    them: every request is answered (a mask indexed by the guided rows alone used to fail
    such a step, and the worker with it: 503s for everyone), each guided answer is a valid
    Pet, and each unguided one runs to its length."""
    import asyncio
    import time
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    ask(daemon.client(), response_format=fmt, max_tokens=4)   # compiled before the burst

    async def run():
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        ended: list[float] = []
        sent: list[float] = []
        try:
            async def free(i):
                r = await client.completions.create(
                    model=MODEL, prompt=f"story {i} " * 6, max_tokens=600, temperature=0,
                    extra_body={"ignore_eos": True})
                ended.append(time.monotonic())
                return r

            async def guided(i):
                await asyncio.sleep(0.1 + 0.05 * i)         # while the free ones decode
                sent.append(time.monotonic())
                return await client.chat.completions.create(
                    model=MODEL, max_tokens=120, response_format=fmt, seed=i,
                    temperature=1.0,
                    messages=[{"role": "user", "content": "Describe a pet as JSON"}])
            answers = await asyncio.gather(*(free(i) for i in range(3)),
                                           *(guided(i) for i in range(5)))
        finally:
            await client.close()
        return answers, sent, ended
    answers, sent, ended = asyncio.run(run())
    assert min(sent) < min(ended)       # (the case under test: they overlapped)
    for r in answers[:3]:
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 600)
    for r in answers[3:]:
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        valid_pet(r.choices[0].message.content)


def test_the_daemon_never_loads_xgrammar_or_torch(daemon):
    """A small guided body is checked in a preparation child, not on the event loop: the
    grammar's compile imports xgrammar and torch (~2 s the first time), which would stall
    every stream and grow the daemon by hundreds of MB."""
    before = daemon.status()["prepared"]["pooled"]
    out = ask(daemon.client(), max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}})
    assert out.choices[0].finish_reason in ("stop", "length")
    assert daemon.status()["prepared"]["pooled"] == before + 1
    maps = open(f"/proc/{daemon.proc.pid}/maps").read()
    assert "xgrammar" not in maps and "libtorch" not in maps
