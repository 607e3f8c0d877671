"""The simulator driven through the engine contract: add / step / abort / release / sweep /
stats, in disaggregated (handoff) and aggregated mode."""
from __future__ import annotations

import time

import pytest

from appliance.engines import base
from appliance.engines.base import HANDOFF_MARGIN_S
from appliance.engines.messages import (
    Decode, IterationRecord, KvHandle, KvImported, Prefill, PrefillDone, RequestFailed,
    SamplingParams, Tokens,
)
from appliance.engines.roofline import DeviceShape, StepTimeModel
from appliance.engines.sim import SimEngine
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import H100_SXM

VOCAB = list(range(100, 200))
BS = 16
SPEC = lookup_model_spec("llama-3.1-8b")
TIMING = StepTimeModel(DeviceShape.from_gpu(H100_SXM, SPEC.weight_bytes), 1, SPEC)


def engine(worker: str = "w0", *, num_blocks: int = 64, block_size: int = BS,
           reserve_ratio: float = 1.0, eos: tuple[int, ...] = (), **kw) -> SimEngine:
    opts = dict(max_batch_tokens=2048, max_seqs=32, max_context=SPEC.max_context,
                handoff_timeout_s=30.0)
    opts.update(kw)
    return SimEngine(timing=TIMING, vocab_ids=VOCAB, speed=1e12, worker=worker,
                     devices=(f"{worker}-gpu0",), num_blocks=num_blocks,
                     block_size=block_size, eos_token_ids=eos, reserve_ratio=reserve_ratio,
                     **opts)


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def run_until_idle(eng: SimEngine, max_steps: int = 5000) -> list:
    events = []
    for _ in range(max_steps):
        if not eng.has_work():
            return events
        events.extend(eng.step())
    raise AssertionError(f"engine still busy after {max_steps} steps: {eng.stats()}")


def stream(events, rid: str) -> tuple[list[int], list[str | None]]:
    toks, reasons = [], []
    for e in of(events, Tokens):
        if e.request_id == rid:
            toks.extend(e.tokens)
            reasons.append(e.finish_reason)
    return toks, reasons


def disagg(seed: int = 3, max_tokens: int = 10, n: int = 40):
    """Prefill on one engine, decode on another; returns everything observed."""
    p, d = engine("p0"), engine("d0")
    params = SamplingParams(max_tokens=max_tokens, seed=seed)
    assert p.add(Prefill("r1", prompt(n), params, handoff=True)) == []
    pev = p.step()
    (done,) = of(pev, PrefillDone)
    assert d.add(Decode("r1", prompt(n), done.first_token, params, done.handle)) == []
    dev = run_until_idle(d)
    return p, d, done, pev, dev


# ---- disaggregated ------------------------------------------------------------------

def test_prefill_handoff_holds_kv_until_release():
    p, d, done, pev, dev = disagg()
    assert done.request_id == "r1" and done.finish_reason is None
    assert done.first_token in VOCAB
    h = done.handle
    assert isinstance(h, KvHandle)
    assert h.worker == "p0" and h.request_id == "r1"
    assert h.num_tokens == 40
    assert len(h.block_ids) == 3                      # ceil(40 / 16)
    assert h.layout == p.layout() == d.layout()

    st = p.stats()
    assert st.kv_blocks_handed_off == 3
    assert st.kv_blocks_free == 64 - 3
    assert st.running == st.waiting == 0
    assert not p.has_work()
    assert not set(h.block_ids) & set(p.blocks._free)

    # Held blocks are not handed to another request meanwhile.
    p.add(Prefill("other", prompt(60, start=500), SamplingParams(max_tokens=1), handoff=False))
    other = p.scheduler.waiting[0]
    p.step()
    assert not set(other.block_table) & set(h.block_ids)
    run_until_idle(p)

    p.release("r1")
    st = p.stats()
    assert st.kv_blocks_handed_off == 0
    assert st.kv_blocks_free == 64
    p.release("r1")                                   # idempotent: no double free
    assert p.stats().kv_blocks_free == 64
    assert all(r == 0 for r in p.blocks._ref)


def test_decode_worker_imports_then_streams_max_tokens_minus_one():
    p, d, done, pev, dev = disagg(max_tokens=10)
    imported = of(dev, KvImported)
    assert [(e.request_id, e.source_worker) for e in imported] == [("r1", "p0")]
    assert dev.index(imported[0]) < dev.index(of(dev, Tokens)[0])
    toks, reasons = stream(dev, "r1")
    assert len(toks) == 10 - 1                        # the first token came from prefill
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert all(t in VOCAB for t in toks)
    recs = of(dev, IterationRecord)
    assert recs[0].phase == "kv_import"
    assert recs[0].entries == [("r1", 0, 40)]
    assert all(r.phase == "decode" for r in recs[1:])
    assert len(recs) == 1 + 9
    st = d.stats()
    assert st.kv_blocks_free == 64 and st.kv_blocks_handed_off == 0 and st.running == 0
    assert st.iterations == 10


def test_an_import_says_how_much_moved_and_how_long_it_took():
    """The transfer metrics' figures: the simulator's modelled bytes (tokens × the model's
    KV bytes per token) and modelled time (the link's, not the sleep `speed` shortens)."""
    _, _, _, _, dev = disagg(n=40)
    (ev,) = of(dev, KvImported)
    assert ev.transport == "sim"
    assert ev.nbytes == int(40 * SPEC.kv_bytes_per_token())
    assert ev.seconds == pytest.approx(TIMING.transfer_s(40))


def test_an_import_given_up_reports_no_transfer():
    """Recomputed instead (past its deadline): nothing moved, nothing to count."""
    pre, dec = engine("p0", handoff_timeout_s=0.0), engine("d0")
    pre.add(Prefill("r1", prompt(40), SamplingParams(max_tokens=6), handoff=True))
    (done,) = of(pre.step(), PrefillDone)
    dec.add(Decode("r1", prompt(40), done.first_token, SamplingParams(max_tokens=6), done.handle))
    time.sleep(0.01)
    (ev,) = of(dec.step(), KvImported)
    assert (ev.transport, ev.nbytes, ev.seconds) == ("", 0, 0.0)


def test_a_batched_import_shares_its_wall_time_by_bytes():
    """One copy call moved several requests' blocks: each gets its share of the time."""
    from appliance.engines.sequence import Sequence

    class Sized(SimEngine):
        def kv_import_bytes(self, seq):
            return {"a": 1000, "b": 3000}[seq.request_id]
    eng = Sized(timing=TIMING, vocab_ids=VOCAB, speed=1e12, worker="d0", devices=("g",),
                num_blocks=8, block_size=BS, eos_token_ids=(), max_batch_tokens=64, max_seqs=4,
                max_context=1024, handoff_timeout_s=1.0)
    seqs = [Sequence.__new__(Sequence) for _ in range(2)]
    for s, rid in zip(seqs, "ab"):
        s.request_id = rid
    assert base.BatchEngine.kv_import_seconds(eng, seqs, 0.4) == pytest.approx([0.1, 0.3])


def test_same_seed_same_tokens_on_fresh_engines():
    _, _, done1, _, dev1 = disagg(seed=11)
    _, _, done2, _, dev2 = disagg(seed=11)
    assert done1.first_token == done2.first_token
    assert stream(dev1, "r1")[0] == stream(dev2, "r1")[0]
    _, _, done3, _, dev3 = disagg(seed=12)
    assert ([done3.first_token] + stream(dev3, "r1")[0]
            != [done1.first_token] + stream(dev1, "r1")[0])


def test_layout_mismatch_is_refused():
    p = engine("p0")
    params = SamplingParams(max_tokens=5, seed=1)
    p.add(Prefill("r1", prompt(40), params, handoff=True))
    (done,) = of(p.step(), PrefillDone)
    other = engine("d0", block_size=8)
    assert other.layout() != p.layout()
    events = other.add(Decode("r1", prompt(40), done.first_token, params, done.handle))
    assert len(events) == 1 and isinstance(events[0], RequestFailed)
    assert events[0].code == "kv_layout_mismatch"
    assert events[0].request_id == "r1"
    assert not other.has_work()
    assert other.stats().kv_blocks_free == other.blocks.num_blocks


def test_sweep_frees_orphaned_handoffs_after_timeout():
    p = engine("p0", handoff_timeout_s=30.0)
    p.add(Prefill("r1", prompt(40), SamplingParams(max_tokens=5), handoff=True))
    (done,) = of(p.step(), PrefillDone)
    assert p.stats().kv_blocks_handed_off == 3
    # The deadline travels in the handle, on the host-wide monotonic clock.
    assert done.handle.expires_at == pytest.approx(time.monotonic() + 30.0, abs=5.0)
    p.sweep(time.monotonic() + 1.0)                   # not yet expired
    assert p.stats().kv_blocks_handed_off == 3
    # Past the deadline but within the margin a decode worker may still be copying.
    p.sweep(done.handle.expires_at + HANDOFF_MARGIN_S / 2)
    assert p.stats().kv_blocks_handed_off == 3
    p.sweep(done.handle.expires_at + HANDOFF_MARGIN_S + 0.01)
    st = p.stats()
    assert st.kv_blocks_handed_off == 0
    assert st.kv_blocks_free == 64
    p.release("r1")                                   # late release after the sweep
    assert p.stats().kv_blocks_free == 64
    assert all(r == 0 for r in p.blocks._ref)


def test_prefill_that_finishes_immediately_hands_nothing_off():
    p = engine("p0")
    p.add(Prefill("r1", prompt(20), SamplingParams(max_tokens=1), handoff=True))
    (done,) = of(p.step(), PrefillDone)
    assert done.handle is None and done.finish_reason == "length"
    assert p.stats().kv_blocks_handed_off == 0 and p.stats().kv_blocks_free == 64


def test_abort_of_handed_off_request_frees_its_kv():
    p = engine("p0")
    p.add(Prefill("r1", prompt(40), SamplingParams(max_tokens=5), handoff=True))
    p.step()
    p.abort("r1")
    assert p.stats().kv_blocks_handed_off == 0 and p.stats().kv_blocks_free == 64


def test_prefill_worker_batches_prompts_despite_large_max_tokens():
    # Handed-off requests never decode on the prefill worker, so their max_tokens must
    # not be reserved there: all four prompts go in one batch on a 16-block pool.
    p = engine("p0", num_blocks=16, reserve_ratio=1.0)
    for i in range(4):
        p.add(Prefill(f"r{i}", prompt(8, start=100 * i + 1), SamplingParams(max_tokens=100),
                      handoff=True))
    events = p.step()
    assert len(of(events, PrefillDone)) == 4
    assert p.blocks.reserved == 0


def test_failed_kv_import_fails_the_requests_and_keeps_serving():
    p = engine("p0")
    params = SamplingParams(max_tokens=5, seed=1)
    p.add(Prefill("r1", prompt(40), params, handoff=True))
    (done,) = of(p.step(), PrefillDone)
    d = engine("d0")

    def broken(seqs):
        raise ConnectionError("source worker p0 is gone")

    d.import_kv = broken
    d.add(Decode("r1", prompt(40), done.first_token, params, done.handle))
    events = d.step()
    failed = of(events, RequestFailed)
    assert [(e.request_id, e.code) for e in failed] == [("r1", "kv_import_failed")]
    assert not d.has_work()
    assert d.stats().kv_blocks_free == 64
    # The worker is still usable.
    d.add(Prefill("r2", prompt(10), SamplingParams(max_tokens=3), handoff=False))
    toks, reasons = stream(run_until_idle(d), "r2")
    assert len(toks) == 3 and reasons[-1] == "length"


# ---- aggregated -----------------------------------------------------------------

def test_agg_streams_tokens_until_length():
    e = engine("a0")
    assert e.add(Prefill("r1", prompt(30), SamplingParams(max_tokens=7, seed=5),
                         handoff=False)) == []
    first = e.step()
    assert not of(first, PrefillDone)
    assert len(of(first, Tokens)) == 1
    events = first + run_until_idle(e)
    toks, reasons = stream(events, "r1")
    assert len(toks) == 7
    assert reasons == [None] * 6 + ["length"]
    assert all(len(t.tokens) == 1 for t in of(events, Tokens))
    assert e.stats().kv_blocks_free == 64
    assert e.blocks.reserved == 0


def test_stop_token_ends_with_stop():
    ref, _ = stream(run_agg(SamplingParams(max_tokens=30, seed=9)), "r1")
    stop = ref[4]
    cut = ref.index(stop)
    toks, reasons = stream(run_agg(SamplingParams(max_tokens=30, seed=9,
                                                  stop_token_ids=(stop,))), "r1")
    assert toks == ref[:cut + 1]
    assert reasons[-1] == "stop"


def test_eos_stops_unless_ignored():
    ref, _ = stream(run_agg(SamplingParams(max_tokens=30, seed=9)), "r1")
    eos = ref[3]
    toks, reasons = stream(run_agg(SamplingParams(max_tokens=30, seed=9), eos=(eos,)), "r1")
    assert toks == ref[:ref.index(eos) + 1] and reasons[-1] == "stop"
    toks, reasons = stream(run_agg(SamplingParams(max_tokens=30, seed=9, ignore_eos=True),
                                   eos=(eos,)), "r1")
    assert toks == ref and reasons[-1] == "length"


def run_agg(params: SamplingParams, **kw) -> list:
    e = engine("a0", **kw)
    e.add(Prefill("r1", prompt(30), params, handoff=False))
    return run_until_idle(e)


def test_abort_mid_decode_frees_blocks():
    e = engine("a0")
    e.add(Prefill("r1", prompt(40), SamplingParams(max_tokens=100), handoff=False))
    e.add(Prefill("r2", prompt(20, start=300), SamplingParams(max_tokens=100), handoff=False))
    for _ in range(5):
        e.step()
    assert e.stats().running == 2
    assert e.stats().kv_blocks_free < 64
    e.abort("r1")
    assert e.stats().running == 1
    e.abort("r2")
    assert not e.has_work()
    st = e.stats()
    assert st.kv_blocks_free == 64 and st.running == st.waiting == 0
    assert e.blocks.reserved == 0
    assert e.step() == []
    e.abort("r2")                                     # unknown id: harmless
    assert e.stats().kv_blocks_free == 64


def test_abort_while_waiting():
    e = engine("a0", num_blocks=8, reserve_ratio=1.0)
    e.add(Prefill("r1", prompt(20), SamplingParams(max_tokens=100), handoff=False))
    e.add(Prefill("r2", prompt(20, start=300), SamplingParams(max_tokens=10), handoff=False))
    e.step()
    assert e.stats().waiting == 1                     # r1 reserved the whole pool
    e.abort("r2")
    assert e.stats().waiting == 0
    e.abort("r1")
    assert not e.has_work() and e.stats().kv_blocks_free == 8


def test_duplicate_and_oversized_requests_are_refused():
    e = engine("a0", num_blocks=4)
    assert e.add(Prefill("r1", prompt(10), SamplingParams(max_tokens=2), handoff=False)) == []
    (dup,) = e.add(Prefill("r1", prompt(10), SamplingParams(max_tokens=2), handoff=False))
    assert isinstance(dup, RequestFailed) and dup.request_id == "r1"
    (big,) = e.add(Prefill("r2", prompt(4 * BS), SamplingParams(max_tokens=2), handoff=False))
    assert isinstance(big, RequestFailed) and big.code == "kv_capacity"


@pytest.mark.parametrize("reserve_ratio", [1.0, 0.0])
def test_request_that_could_outgrow_the_pool_does_not_hang_the_worker(reserve_ratio):
    # 4 blocks of 16 = 64 tokens of KV; max_tokens asks for far more than that.
    e = engine("a0", num_blocks=4, reserve_ratio=reserve_ratio)
    e.add(Prefill("big", prompt(10), SamplingParams(max_tokens=500), handoff=False))
    e.add(Prefill("small", prompt(10, start=300), SamplingParams(max_tokens=5),
                  handoff=False))
    events = run_until_idle(e, max_steps=500)
    assert not of(events, RequestFailed)
    big, big_reasons = stream(events, "big")
    small, small_reasons = stream(events, "small")
    assert big_reasons[-1] == "length" and 10 + len(big) == 4 * BS   # ends at the pool
    assert small_reasons[-1] == "length" and len(small) == 5
    assert e.stats().kv_blocks_free == 4 and e.blocks.reserved == 0


# ---- iteration records and prefix cache -----------------------------------------

def test_iteration_records_describe_each_step():
    e = engine("a0")
    e.add(Prefill("r1", prompt(40), SamplingParams(max_tokens=3), handoff=False))
    e.add(Prefill("r2", prompt(25, start=500), SamplingParams(max_tokens=3), handoff=False))
    before = time.time()
    (rec,) = of(e.step(), IterationRecord)
    assert rec.phase == "prefill"
    assert rec.worker == "a0" and rec.devices == ("a0-gpu0",) and rec.simulated is True
    assert rec.approximate is False       # the batch loop sees every batch exactly
    assert rec.entries == [("r1", 40, 40), ("r2", 25, 25)]
    assert rec.wall_s >= 0 and before - 1 <= rec.start <= time.time()

    (rec,) = of(e.step(), IterationRecord)
    assert rec.phase == "decode"
    assert rec.entries == [("r1", 1, 41), ("r2", 1, 26)]
    (rec,) = of(e.step(), IterationRecord)
    assert rec.entries == [("r1", 1, 42), ("r2", 1, 27)]
    assert not e.has_work()
    assert e.stats().iterations == 3


def test_prefix_cache_hit_on_second_identical_prompt():
    p = engine("p0")
    params = SamplingParams(max_tokens=4)
    p.add(Prefill("r1", prompt(40), params, handoff=True))
    (d1,) = of(p.step(), PrefillDone)
    assert d1.cached_tokens == 0
    p.release("r1")                                   # freed, still cached
    p.add(Prefill("r2", prompt(40), params, handoff=True))
    events = p.step()
    (d2,) = of(events, PrefillDone)
    assert d2.cached_tokens == 32                     # 2 full blocks; the last token recomputed
    assert d2.handle.block_ids[:2] == d1.handle.block_ids[:2]
    (rec,) = of(events, IterationRecord)
    assert rec.entries == [("r2", 40 - 32, 40)]
    assert p.stats().prefix_hit_tokens == 32

    # Also while the first request still holds its blocks.
    p.add(Prefill("r3", prompt(40), params, handoff=False))
    (t,) = of(p.step(), Tokens)
    assert t.cached_tokens == 32


def test_chunked_prefill_in_the_simulator():
    """The same seeded tokens with and without chunks; the records show the chunks, and a
    prefill worker hands its KV off only after the last one."""
    params = SamplingParams(max_tokens=5, seed=3)
    outs, records = {}, {}
    for chunk in (0, 64):
        eng = engine(f"c{chunk}", prefill_chunk_tokens=chunk)
        eng.add(Prefill("a", prompt(150), params, handoff=False))
        eng.add(Prefill("b", prompt(20, start=500), params, handoff=False))
        events = run_until_idle(eng)
        outs[chunk] = {rid: stream(events, rid)[0] for rid in ("a", "b")}
        records[chunk] = [r for r in of(events, IterationRecord) if r.phase == "prefill"]
    assert outs[64] == outs[0] and len(outs[0]["a"]) == 5
    assert [e for r in records[0] for e in r.entries] == [("a", 150, 150), ("b", 20, 20)]
    assert [e for r in records[64] for e in r.entries] == [
        ("a", 64, 64), ("a", 64, 128), ("a", 22, 150), ("b", 20, 20)]
    assert [len(r.entries) for r in records[64]] == [1, 1, 2]   # b fills the last budget

    pre = engine("p0", prefill_chunk_tokens=64)
    pre.add(Prefill("a", prompt(150), params, handoff=True))
    done = []
    while not done:
        done = of(pre.step(), PrefillDone)
    assert done[0].handle.num_tokens == 150 and pre.stats().kv_blocks_handed_off == 10


def _handed_off(pre: SimEngine, rid: str, n: int = 40):
    pre.add(Prefill(rid, prompt(n), SamplingParams(max_tokens=6), handoff=True))
    (done,) = of(pre.step(), PrefillDone)
    return done


def test_decode_recomputes_an_import_past_its_deadline():
    """Never copies blocks its source may have freed: past the deadline the prompt is
    prefilled here instead; the source is told it may free (KvImported)."""
    pre, dec = engine("p0", handoff_timeout_s=0.0), engine("d0")
    done = _handed_off(pre, "r1")
    copied = []
    dec.import_kv = lambda seqs: copied.extend(seqs)
    assert dec.add(Decode("r1", prompt(40), done.first_token, SamplingParams(max_tokens=6),
                          done.handle)) == []
    time.sleep(0.01)
    events = dec.step()
    assert copied == []
    assert [(e.request_id, e.source_worker) for e in of(events, KvImported)] == [("r1", "p0")]
    events += run_until_idle(dec)
    toks, reasons = stream(events, "r1")
    assert len(toks) == 5 and reasons[-1] == "length"   # the first token came from p0
    phases = [e.phase for e in events if isinstance(e, IterationRecord)]
    assert "prefill" in phases
    st = dec.stats()
    assert st.kv_recomputes == 1 and st.kv_blocks_free == 64


def test_decode_discards_a_copy_that_ended_past_deadline_plus_margin(monkeypatch):
    """The copy began before the deadline but ended after the source may have freed the
    blocks (deadline + margin): the copied KV is thrown away and recomputed."""
    pre, dec = engine("p0", handoff_timeout_s=30.0), engine("d0")
    done = _handed_off(pre, "r1")
    clock = [done.handle.expires_at - 1.0]
    monkeypatch.setattr(base.time, "monotonic", lambda: clock[0])

    def slow_copy(seqs):
        clock[0] = done.handle.expires_at + HANDOFF_MARGIN_S + 0.5

    dec.import_kv = slow_copy
    dec.add(Decode("r1", prompt(40), done.first_token, SamplingParams(max_tokens=6),
                   done.handle))
    events = dec.step()
    assert of(events, KvImported) and dec.stats().kv_recomputes == 1
    assert dec.scheduler.waiting[0].request_id == "r1" and dec.scheduler.waiting[0].handle is None
    # A copy that ends within the margin is kept.
    dec2 = engine("d1")
    done2 = _handed_off(pre, "r2")
    clock[0] = done2.handle.expires_at - 1.0
    dec2.import_kv = lambda seqs: clock.__setitem__(0, done2.handle.expires_at + 0.5)
    dec2.add(Decode("r2", prompt(40), done2.first_token, SamplingParams(max_tokens=6),
                    done2.handle))
    dec2.step()
    assert dec2.stats().kv_recomputes == 0 and dec2.scheduler.running


def test_dead_source_recomputes_its_queued_imports_at_once():
    pre, other = engine("p0"), engine("p1")
    dec = engine("d0", max_seqs=1)
    a, b, c = _handed_off(pre, "a"), _handed_off(pre, "b"), _handed_off(other, "c")
    for d, src in ((a, "a"), (b, "b"), (c, "c")):
        dec.add(Decode(src, prompt(40), d.first_token, SamplingParams(max_tokens=6), d.handle))
    dec.step()                                       # a imported; b, c queued (max_seqs 1)
    events = dec.detach_peer("p0")
    assert [e.request_id for e in of(events, KvImported)] == ["b"]
    waiting = {s.request_id: s.handle for s in dec.scheduler.waiting}
    assert waiting["b"] is None and waiting["c"] is not None   # only p0's imports
    events = run_until_idle(dec)
    for rid in "abc":
        assert stream(events, rid)[1][-1] == "length"
    assert dec.stats().kv_recomputes == 1


def test_simulated_ttft_counts_the_steps_a_prompt_waited_for_not_the_wall():
    """A prompt's simulated time to first token is on the simulated device's clock: the
    modelled steps from its arrival to its first token. Wall time between steps (a loaded
    machine, a slow daemon) adds nothing; the step under way when it arrived counts from
    the point it arrived at."""
    eng = engine(max_batch_tokens=4096, num_blocks=512)
    step = lambda *n: TIMING.prefill_s(list(n), [0] * len(n))    # noqa: E731

    def first(events, rid):
        return next(e for e in of(events, PrefillDone) if e.request_id == rid)

    # Idle: its own step only, however long the worker sat idle before.
    time.sleep(0.02)
    assert eng.add(Prefill("q", prompt(32), SamplingParams(max_tokens=4), True,
                           tenant="flood")) == []
    done = first(eng.step(), "q")
    assert done.simulated_ttft_s == pytest.approx(step(32))
    # A long prompt's step under way when a short one arrives at its very start: the short
    # one waits for all of it, then its own step; a pause between the steps is not counted.
    assert eng.add(Prefill("long", prompt(4000, 500), SamplingParams(max_tokens=4), True,
                           tenant="flood")) == []
    first(eng.step(), "long")
    assert eng.add(Prefill("short", prompt(32, 7), SamplingParams(max_tokens=4), True,
                           tenant="polite"), received=eng._wall_start) == []
    time.sleep(0.05)
    done = first(eng.step(), "short")
    assert done.simulated_ttft_s == pytest.approx(step(4000) + step(32))
    # Arrived after the last step ended: nothing to wait for.
    assert eng.add(Prefill("late", prompt(32, 9), SamplingParams(max_tokens=4), True),
                   received=time.time()) == []
    assert first(eng.step(), "late").simulated_ttft_s == pytest.approx(step(32))
    # Half-way through a step's share of the wall (its sleep, and the worker's time since
    # the step before): half of the step is waited.
    slow = SimEngine(timing=TIMING, vocab_ids=VOCAB, speed=1.0, worker="w1", devices=("g",),
                     num_blocks=512, block_size=BS, max_batch_tokens=4096, max_seqs=32,
                     max_context=SPEC.max_context)
    slow.add(Prefill("long", prompt(4000), SamplingParams(max_tokens=4), True))
    slow.step()
    mid = (slow._wall_start + slow._wall_end) / 2
    slow.add(Prefill("mid", prompt(32, 7), SamplingParams(max_tokens=4), True), received=mid)
    done = first(slow.step(), "mid")
    assert done.simulated_ttft_s == pytest.approx(step(4000) / 2 + step(32), abs=1e-6)
    # Real engines leave it unset: a plain record field, so pickles as None.
    assert PrefillDone("x", 1, None, "stop").simulated_ttft_s is None
