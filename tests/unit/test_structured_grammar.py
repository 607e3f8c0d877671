"""Structured outputs below the daemon: compiled grammars cached by hash and bounded, a
guide rebuilt from the tokens so far, and the grammar state surviving a preemption in
the torch engine. (Through real daemons: tests/integration/test_structured.py.)"""
from __future__ import annotations

import json
from typing import Literal
import pytest
from pydantic import BaseModel, Field

from appliance.engines.grammar import GrammarBook
from appliance.engines.messages import GuidedDecoding

pytest.importorskip("xgrammar")


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


# ---- the grammar book itself: compile once, rebuild from tokens -----------------------

def test_compiled_grammars_are_cached_by_hash_and_bounded(tiny_model):
    book = GrammarBook(tiny_model, 0, [1, 4], cache_size=2)
    a = GuidedDecoding("json_schema", json.dumps(PET_SCHEMA))
    book.guide(a)
    book.guide(GuidedDecoding("json_schema", json.dumps(PET_SCHEMA)))
    assert book.compilations == 1
    book.guide(GuidedDecoding("regex", "a+"))
    book.guide(GuidedDecoding("regex", "b+"))
    book.guide(a)       # evicted by the two regexes: compiled again
    assert book.compilations == 4


def test_a_guide_rebuilt_from_the_tokens_so_far_continues_the_grammar(tiny_model):
    """What a decode worker does after the handoff (and a preempted sequence after its
    recompute): a fresh matcher synced with the generated tokens allows what the
    original one allows."""
    import random
    book = GrammarBook(tiny_model, 0, [1, 4])
    spec = GuidedDecoding("json_schema", json.dumps(PET_SCHEMA))
    rng = random.Random(0)
    guide, generated = book.guide(spec), []
    for _ in range(6):
        generated.append(rng.choice(book.allowed(guide, generated)))
    rebuilt = book.guide(spec)
    assert book.allowed(rebuilt, generated) == book.allowed(guide, generated)
    assert rebuilt.taken == len(generated)


def run_to_end(eng) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step a torch engine until it has no work: each request's tokens and finish
    reason; no request may fail."""
    from appliance.engines.messages import RequestFailed, Tokens
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while eng.has_work():
        for ev in eng.step():
            assert not isinstance(ev, RequestFailed), ev
            if isinstance(ev, Tokens):
                out.setdefault(ev.request_id, []).extend(ev.tokens)
                if ev.finish_reason:
                    reasons[ev.request_id] = ev.finish_reason
    return out, reasons


def test_grammar_state_survives_preemption(tiny_model):
    """A KV pool too small for the batch: decoding sequences are preempted and recomputed,
    and their matchers carry on from the tokens they kept (torch engine, no daemon)."""
    from appliance.daemon.tokenizer import ServedTokenizer
    from appliance.engines.messages import Prefill, SamplingParams
    from test_torch_engine import make_engine

    eng = make_engine(tiny_model, "p0", num_blocks=8, reserve_ratio=0.0)
    spec = GuidedDecoding("json_schema", json.dumps(PET_SCHEMA))
    for i in range(6):
        prompt = [0] + [100 + 7 * i + k for k in range(23)]
        eng.add(Prefill(f"r{i}", prompt, SamplingParams(max_tokens=90, temperature=0.0,
                                                        guided=spec), False))
    out, reasons = run_to_end(eng)
    assert eng.scheduler.preemptions > 0
    tok = ServedTokenizer(tiny_model)
    assert reasons == {f"r{i}": "stop" for i in range(6)}
    for rid, ids in out.items():
        valid_pet(tok.decode(ids))


def test_a_model_without_an_end_token_refuses_a_grammar_instead_of_failing_a_step(tiny_model):
    """A complete output's mask allows only stop tokens: with none, nothing at all, and
    the engine's next step would fail (it killed the worker). Refused up front instead."""
    from appliance.engines.grammar import GrammarError
    book = GrammarBook(tiny_model, 0, [])
    with pytest.raises(GrammarError, match="no end-of-sequence token"):
        book.guide(GuidedDecoding("regex", "a+"))


def test_each_guided_row_gets_its_own_mask_wherever_it_lies_in_the_batch(tiny_model):
    """A step's logits hold guided and unguided sequences in any order: each guided row is
    masked by its own guide, unguided rows are left alone. (The mask used to hold only the
    guided rows, in order, while xgrammar reads mask row i for logits row i: a guided
    sequence after an unguided one failed the step, and its worker with it.)"""
    import torch
    book = GrammarBook(tiny_model, 0, [1, 4])
    a, b = book.guide(GuidedDecoding("regex", "a+")), book.guide(GuidedDecoding("regex", "b+"))
    want_a, want_b = set(book.allowed(a, [])), set(book.allowed(b, []))
    assert want_a != want_b
    logits = torch.zeros(5, book.vocab_size)
    book.apply(logits, [1, 3], [a, b], [[], []])

    def allowed(row: int) -> set[int]:
        return set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
    assert allowed(1) == want_a
    assert allowed(3) == want_b
    for row in (0, 2, 4):
        assert allowed(row) == set(range(book.vocab_size))


def test_guided_and_unguided_sequences_share_the_torch_engines_steps(tiny_model):
    """Unguided prompts ahead of guided ones in the same prefill and decode steps (torch
    engine, no daemon): every step runs, each guided answer is a valid Pet, and the
    unguided ones run to their length."""
    from appliance.daemon.tokenizer import ServedTokenizer
    from appliance.engines.messages import Prefill, SamplingParams
    from test_torch_engine import make_engine

    eng = make_engine(tiny_model, "p0", num_blocks=64)
    spec = GuidedDecoding("json_schema", json.dumps(PET_SCHEMA))
    for i in range(6):
        guided = i % 3 == 2     # rows 2 and 5 of each step
        prompt = [0] + [100 + 7 * i + k for k in range(23)]
        eng.add(Prefill(f"r{i}", prompt, SamplingParams(
            max_tokens=90 if guided else 12, temperature=0.0, ignore_eos=not guided,
            guided=spec if guided else None), False))
    out, reasons = run_to_end(eng)
    tok = ServedTokenizer(tiny_model)
    for i in range(6):
        if i % 3 == 2:
            assert reasons[f"r{i}"] == "stop"
            valid_pet(tok.decode(out[f"r{i}"]))
        else:
            assert (reasons[f"r{i}"], len(out[f"r{i}"])) == ("length", 12)
