"""The scheduler: prefill under a token budget, never mixed with decode, preemption by
recompute, and admission of handed-off KV through `kv_import` batches."""
from __future__ import annotations

import itertools

from appliance.engines.block_manager import BlockManager
from appliance.engines.messages import (
    KvHandle, Prefill, RequestFailed, SamplingParams, Tokens,
)
from appliance.engines.roofline import DeviceShape, StepTimeModel
from appliance.engines.scheduler import Batch, Scheduler
from appliance.engines.sequence import Role, Sequence, Status
from appliance.engines.sim import SimEngine
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import H100_SXM

BS = 4
_next_token = itertools.count(1000)


def seq(rid: str, n: int, max_tokens: int = 4, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens),
                    Role.FULL)


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 32,
         reserve_ratio: float = 0.0) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, reserve_ratio), budget, max_seqs)


def run(sched: Scheduler, batch: Batch) -> None:
    """What the engine does after a prefill or decode forward pass."""
    for s in batch.seqs:
        s.num_cached = len(s.tokens)
        s.tokens.append(next(_next_token))
        sched.blocks.commit(s)


def finish(sched: Scheduler, s: Sequence) -> None:
    sched.remove(s)
    sched.blocks.free(s)


# ---- prefill budget ----------------------------------------------------------------

def test_prefill_batches_respect_the_token_budget():
    sched = make(budget=16)
    seqs = [seq(f"r{i}", 6, start=100 * i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    sizes = []
    while sched.waiting:
        batch = sched.schedule()
        assert batch.phase == "prefill"
        assert sum(s.uncached for s in batch.seqs) <= 16
        sizes.append(len(batch.seqs))
        run(sched, batch)
    assert sizes == [2, 2, 1]
    assert sched.running == seqs                     # admitted in arrival order


def test_prompt_longer_than_the_budget_runs_alone():
    sched = make(budget=16)
    long, short = seq("long", 40), seq("short", 4, start=500)
    sched.add(long)
    sched.add(short)
    first = sched.schedule()
    assert first.phase == "prefill" and first.seqs == [long]
    assert first.seqs[0].uncached == 40
    run(sched, first)
    second = sched.schedule()
    assert second.phase == "prefill" and second.seqs == [short]


def test_long_prompt_behind_a_short_one_waits_for_the_next_step():
    sched = make(budget=16)
    short, long = seq("short", 4), seq("long", 40, start=500)
    sched.add(short)
    sched.add(long)
    first = sched.schedule()
    assert first.seqs == [short]
    assert list(sched.waiting) == [long]
    assert long.block_table == [] and long.status is Status.WAITING
    assert sched.blocks.num_free == 64 - 1           # the trial did not keep blocks
    run(sched, first)
    assert sched.schedule().seqs == [long]


def test_budget_counts_only_uncached_tokens():
    sched = make(budget=16)
    a = seq("a", 13)                                  # full blocks [0..3] [4..7] [8..11]
    sched.add(a)
    run(sched, sched.schedule())
    b = seq("b", 13)                                  # 12 cached, 1 to compute
    c = seq("c", 14, start=300)
    sched.add(b)
    sched.add(c)
    batch = sched.schedule()
    assert batch.seqs == [b, c]                       # 1 + 14 <= 16 although 13 + 14 > 16
    assert b.uncached == 1


def test_over_budget_trial_does_not_evict_prefix_cache():
    # A prompt that does not fit this step's budget must not hand out free blocks
    # that still carry cached prefixes.
    sched = make(num_blocks=8, budget=16)
    bm = sched.blocks
    b = seq("b", 20, start=500)                       # 5 blocks: 0..4
    sched.add(b)
    run(sched, sched.schedule())
    finish(sched, b)                                  # free: 5 6 7 4 3 2 1 0
    a = seq("a", 12)                                  # 3 full blocks: 5 6 7
    sched.add(a)
    run(sched, sched.schedule())
    finish(sched, a)                                  # free: 4 3 2 1 0 7 6 5
    assert bm.num_free == 8

    small = seq("small", 4, start=900)                # takes block 4
    too_big = seq("big", 20, start=700)               # 4 + 20 > 16: waits a step
    sched.add(small)
    sched.add(too_big)
    assert sched.schedule().seqs == [small]
    assert list(sched.waiting) == [too_big]
    assert too_big.block_table == []

    again = seq("again", 13)                          # a's 12 tokens + 1
    bm.allocate(again)
    assert again.num_cached == 12                     # all 3 prefix blocks still hit


# ---- prefill and decode never mix ------------------------------------------------

def test_never_mixes_prefill_and_decode_and_decodes_every_running_sequence():
    sched = make(budget=64)
    a, b = seq("a", 5), seq("b", 6, start=100)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.phase == "prefill" and batch.seqs == [a, b]
    run(sched, batch)

    c = seq("c", 7, start=200)
    sched.add(c)
    batch = sched.schedule()                          # prefill first, and only c
    assert batch.phase == "prefill" and batch.seqs == [c]
    assert a not in batch.seqs and b not in batch.seqs
    run(sched, batch)

    for _ in range(3):
        batch = sched.schedule()
        assert batch.phase == "decode"
        assert batch.seqs == sched.running == [a, b, c]
        for s in batch.seqs:                         # room for the token being fed
            assert len(s.block_table) * BS >= len(s.tokens)
        run(sched, batch)

    d = seq("d", 3, start=300)
    sched.add(d)
    batch = sched.schedule()
    assert batch.phase == "prefill" and batch.seqs == [d]


def test_max_seqs_caps_admission():
    sched = make(budget=100, max_seqs=2)
    for i in range(3):
        sched.add(seq(f"r{i}", 3, start=10 * i))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"]
    run(sched, batch)
    assert sched.schedule().phase == "decode"        # r2 waits for a slot
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_prefill_waits_when_kv_is_short_and_decode_runs_meanwhile():
    sched = make(num_blocks=4, budget=100, reserve_ratio=1.0)
    a = seq("a", 4, max_tokens=8)                     # 12 tokens -> 3 blocks (1 + 2 reserved)
    b = seq("b", 4, max_tokens=8, start=50)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a]
    run(sched, batch)
    batch = sched.schedule()
    assert batch.phase == "decode" and batch.seqs == [a]
    assert list(sched.waiting) == [b]


# ---- preemption ----------------------------------------------------------------

def test_decode_out_of_kv_preempts_the_newest_and_requeues_it_first():
    sched = make(num_blocks=4, budget=100, reserve_ratio=0.0)
    a, b = seq("a", 4, max_tokens=20), seq("b", 4, max_tokens=20, start=50)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())                      # both prefilled: 1 block each + 1 token
    later = seq("later", 3, start=90)
    # Decode until both need a third block: 2+2 blocks used, pool exhausted.
    while len(a.tokens) <= 2 * BS:
        batch = sched.schedule()
        assert batch.phase == "decode" and batch.seqs == [a, b]
        run(sched, batch)
    assert sched.blocks.num_free == 0
    sched.add(later)                                   # cannot be admitted: no KV
    b_tokens = list(b.tokens)

    batch = sched.schedule()
    assert batch.phase == "decode" and batch.seqs == [a]
    assert sched.preemptions == 1
    assert sched.running == [a]
    assert list(sched.waiting) == [b, later]          # front of the queue, ahead of later
    assert b.status is Status.WAITING
    assert b.block_table == [] and b.num_cached == 0
    assert b.tokens == b_tokens                       # generated tokens kept
    run(sched, batch)

    finish(sched, a)
    batch = sched.schedule()
    assert batch.phase == "prefill" and batch.seqs[0] is b
    # Recomputed from its own still-cached full blocks plus the rest.
    assert b.num_cached + b.uncached == len(b_tokens)
    assert b.uncached >= 1


def test_preempting_itself_when_alone():
    sched = make(num_blocks=2, budget=100, reserve_ratio=0.0)
    a = seq("a", 8, max_tokens=20)
    sched.add(a)
    run(sched, sched.schedule())                      # 9 tokens, 2 blocks: needs a third
    batch = sched.schedule()
    assert batch.phase == "decode" and batch.seqs == []
    assert sched.preemptions == 1
    assert list(sched.waiting) == [a] and sched.running == []


# ---- disaggregated decode ------------------------------------------------------

def handle_seq(rid: str, prompt_len: int, start: int = 0, max_tokens: int = 4) -> Sequence:
    prompt = list(range(start, start + prompt_len))
    handle = KvHandle("p0", rid, [0, 1, 2, 3][: -(-prompt_len // BS)], prompt_len, "layout")
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), Role.DECODE,
                    handle, first_token=7)


def test_decode_role_is_admitted_by_kv_import_then_decodes():
    sched = make(num_blocks=16, budget=16)
    d = handle_seq("d", 10)
    sched.add(d)
    batch = sched.schedule()
    assert batch.phase == "kv_import" and batch.seqs == [d]
    assert len(d.block_table) == sched.blocks.blocks_for(11)   # prompt + first token
    assert d not in sched.running                     # in flight until imported
    d.num_cached = d.handle.num_tokens
    sched.mark_imported(batch.seqs)
    assert d.handle is None and d.status is Status.RUNNING
    batch = sched.schedule()
    assert batch.phase == "decode" and batch.seqs == [d]
    assert d.uncached == 1                            # only the first token is fed


def test_an_import_in_flight_holds_its_blocks_and_its_seat_but_is_not_scheduled():
    """A pull from another box in flight (the engine moved the sequence to `importing`):
    the running sequence decodes alone, the import counts against max_seqs and keeps the
    scheduler busy, and it joins the decode batch once marked imported."""
    sched = make(num_blocks=32, budget=64, max_seqs=2)
    a = seq("a", 8, max_tokens=20)
    sched.add(a)
    run(sched, sched.schedule())
    d = handle_seq("d", 10, start=100)
    sched.add(d)
    batch = sched.schedule()
    assert batch.phase == "kv_import" and batch.seqs == [d]
    sched.importing.append(d)                         # what the engine does for a pull
    c = seq("c", 8, start=200)
    sched.add(c)
    for _ in range(3):
        batch = sched.schedule()
        assert batch.phase == "decode" and batch.seqs == [a]   # c waits: 2 seats taken
        run(sched, batch)
    assert list(sched.waiting) == [c] and d.block_table and sched.has_work()
    d.num_cached = d.handle.num_tokens
    sched.mark_imported([d])
    assert sched.importing == [] and sched.schedule().seqs == [a, d]


def test_a_failed_import_in_flight_is_requeued_for_recompute():
    sched = make(num_blocks=16, budget=64)
    d = handle_seq("d", 10)
    sched.add(d)
    sched.schedule()
    sched.importing.append(d)
    sched.blocks.free(d)
    sched.requeue(d)
    assert sched.importing == [] and list(sched.waiting) == [d] and d.role is Role.FULL
    assert sched.schedule().phase == "prefill"
    e = handle_seq("e", 10, start=100)                # aborted while its READ is in flight
    sched.add(e)
    assert sched.schedule().seqs == [e]
    sched.importing.append(e)
    sched.remove(e)
    assert sched.importing == [] and e.status is Status.FINISHED and e not in sched.running


def test_imports_that_do_not_fit_wait():
    sched = make(num_blocks=4, budget=16)
    d1, d2 = handle_seq("d1", 12), handle_seq("d2", 12, start=100)   # 13 tokens: 4 blocks each
    sched.add(d1)
    sched.add(d2)
    batch = sched.schedule()
    assert batch.phase == "kv_import" and batch.seqs == [d1]
    assert list(sched.waiting) == [d2]
    d1.num_cached = d1.handle.num_tokens
    sched.mark_imported(batch.seqs)
    batch = sched.schedule()
    assert batch.phase == "decode" and batch.seqs == [d1]   # d2 still does not fit
    assert list(sched.waiting) == [d2]
    finish(sched, d1)
    batch = sched.schedule()
    assert batch.phase == "kv_import" and batch.seqs == [d2]


def test_imports_ignore_prefix_cache():
    # The handle's blocks are copied in whole: reusing local blocks would mix pools.
    sched = make(num_blocks=16, budget=64)
    a = seq("a", 12)
    sched.add(a)
    run(sched, sched.schedule())
    d = handle_seq("d", 12)                           # same prompt as a
    sched.add(d)
    batch = sched.schedule()
    assert batch.phase == "kv_import"
    assert not set(d.block_table) & set(a.block_table)
    assert d.num_cached == 0


def test_preempted_decode_role_is_recomputed_as_full():
    sched = make(num_blocks=6, budget=64)
    a = seq("a", 8, max_tokens=20)                    # 2 blocks
    sched.add(a)
    run(sched, sched.schedule())
    d = handle_seq("d", 11, start=100)                # 12 tokens: 3 blocks
    sched.add(d)
    batch = sched.schedule()
    assert batch.phase == "kv_import"
    d.num_cached = d.handle.num_tokens
    sched.mark_imported(batch.seqs)
    batch = sched.schedule()
    assert batch.seqs == [a, d] and sched.blocks.num_free == 0
    run(sched, batch)                                 # d now needs a 4th block: none left
    batch = sched.schedule()
    assert batch.phase == "decode" and batch.seqs == [a]
    assert list(sched.waiting) == [d]
    assert d.role is Role.FULL and d.handle is None   # its source KV is gone: recompute here
    run(sched, batch)
    finish(sched, a)
    batch = sched.schedule()
    assert batch.phase == "prefill" and batch.seqs == [d]
    assert d.num_cached == 3 * BS                     # its own committed blocks still hit
    assert d.uncached == 1


# ---- end to end through the simulator --------------------------------------------

def sim(num_blocks: int, reserve_ratio: float, block_size: int = BS) -> SimEngine:
    spec = lookup_model_spec("llama-3.1-8b")
    timing = StepTimeModel(DeviceShape.from_gpu(H100_SXM, spec.weight_bytes), 1, spec)
    return SimEngine(timing=timing, vocab_ids=list(range(100, 200)), speed=1e12,
                     worker="w0", devices=("gpu0",), num_blocks=num_blocks,
                     block_size=block_size, max_batch_tokens=64, max_seqs=16,
                     max_context=4096, reserve_ratio=reserve_ratio)


def drive(engine: SimEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    for rid, (prompt, params) in requests.items():
        assert engine.add(Prefill(rid, prompt, params, handoff=False)) == []
    for _ in range(10_000):
        if not engine.has_work():
            break
        for ev in engine.step():
            assert not isinstance(ev, RequestFailed), ev
            if isinstance(ev, Tokens):
                assert ev.request_id not in reasons, "tokens after finish"
                out[ev.request_id].extend(ev.tokens)
                if ev.finish_reason:
                    reasons[ev.request_id] = ev.finish_reason
    assert not engine.has_work()
    return out, reasons


def test_over_admission_preempts_recomputes_and_loses_no_token():
    requests = {f"r{i}": ([10 * i + j for j in range(8)], SamplingParams(max_tokens=12, seed=i))
                for i in range(6)}
    tight = sim(num_blocks=12, reserve_ratio=0.0)     # each request grows to 5 blocks
    out, reasons = drive(tight, requests)
    assert tight.stats().preemptions > 0
    assert reasons == {rid: "length" for rid in requests}
    assert all(len(toks) == 12 for toks in out.values())
    assert tight.blocks.num_free == tight.blocks.num_blocks
    assert tight.blocks.reserved == 0
    assert tight.stats().running == tight.stats().waiting == 0

    # Recompute neither drops nor repeats a token: same streams as an unpressured run.
    roomy = sim(num_blocks=256, reserve_ratio=0.0)
    ref, _ = drive(roomy, requests)
    assert roomy.stats().preemptions == 0
    assert out == ref


def test_full_reservation_never_preempts():
    requests = {f"r{i}": ([10 * i + j for j in range(8)], SamplingParams(max_tokens=12, seed=i))
                for i in range(6)}
    engine = sim(num_blocks=12, reserve_ratio=1.0)
    out, reasons = drive(engine, requests)
    assert engine.stats().preemptions == 0
    assert all(len(toks) == 12 for toks in out.values())
    assert engine.blocks.num_free == 12


# ---- chunked prefill ----------------------------------------------------------------

def run_chunked(sched: Scheduler, batch: Batch) -> None:
    """The engine after a step with chunked prefill: a prompt chunk that leaves part of
    its prompt gives no token."""
    for i, s in enumerate(batch.seqs):
        if i < batch.num_prefill and s.step_tokens < s.uncached:
            s.num_cached += s.step_tokens
        else:
            s.num_cached = len(s.tokens)
            s.tokens.append(next(_next_token))
        sched.blocks.commit(s)


def chunked(num_blocks: int = 64, chunk: int = 8, max_seqs: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, 0.0), 1024, max_seqs, chunk_tokens=chunk)


def shape_of(batch: Batch) -> tuple[str, list[tuple[str, int]]]:
    return batch.phase, [(s.request_id, s.step_tokens if i < batch.num_prefill else 1)
                         for i, s in enumerate(batch.seqs)]


def steps_to_first_token(sched: Scheduler, prompt: Sequence) -> list:
    """Run steps until `prompt` has its first token; each step's `shape_of`."""
    steps = []
    while prompt.num_output == 0:
        batch = sched.schedule()
        steps.append(shape_of(batch))
        run_chunked(sched, batch)
    return steps


def test_chunked_prefill_splits_prompts_and_mixes_them_with_decodes():
    sched = chunked(chunk=8)
    short, long = seq("short", 3, max_tokens=20), seq("long", 21, start=500)
    sched.add(short)
    sched.add(long)
    steps = steps_to_first_token(sched, long)
    assert steps == [
        ("prefill", [("short", 3), ("long", 5)]),           # 8 prompt tokens per step
        ("mixed", [("long", 8), ("short", 1)]),             # prompts first, then decodes
        ("mixed", [("long", 8), ("short", 1)]),             # 5 + 8 + 8 = 21: long's token
    ]
    assert long.num_cached == 21 and len(long.tokens) == 22
    assert sched.running == [short, long] and not sched.prefilling
    assert shape_of(sched.schedule()) == ("decode", [("short", 1), ("long", 1)])


def test_chunked_prefill_continues_started_prompts_before_admitting_new_ones():
    sched = chunked(chunk=8)
    a, b = seq("a", 12), seq("b", 4, start=500)
    sched.add(a)
    first = sched.schedule()
    assert shape_of(first) == ("prefill", [("a", 8)])
    run_chunked(sched, first)
    assert sched.prefilling == [a] and sched.running == []
    assert sched.queued_prefill_tokens() == 4
    sched.add(b)
    second = sched.schedule()
    assert shape_of(second) == ("prefill", [("a", 4), ("b", 4)])
    run_chunked(sched, second)
    assert sched.running == [a, b] and not sched.prefilling


def test_chunked_prefill_counts_prompts_under_way_against_max_seqs_and_can_abort_them():
    sched = chunked(chunk=4, max_seqs=2)
    a, b, c = seq("a", 10), seq("b", 10, start=100), seq("c", 3, start=200)
    for s in (a, b, c):
        sched.add(s)
    shapes = []
    for _ in range(3):
        batch = sched.schedule()
        shapes.append(shape_of(batch))
        run_chunked(sched, batch)
    assert shapes == [("prefill", [("a", 4)]),               # the chunk is full at 4
                      ("prefill", [("a", 4)]),
                      ("prefill", [("a", 2), ("b", 2)])]
    assert sched.prefilling == [b] and sched.running == [a]
    assert list(sched.waiting) == [c]                        # two admitted = max_seqs
    free_before = sched.blocks.num_free
    finish(sched, b)                                         # an abort mid-prompt
    assert not sched.prefilling and sched.blocks.num_free == free_before + 3
    assert shape_of(sched.schedule()) == ("mixed", [("c", 3), ("a", 1)])


# ---- prompts riding on decode steps (a CPU decode worker's own prompts) -------------

def riding(ride_rows: int = 4, num_blocks: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, 0.0), 1024, 32, ride_rows=ride_rows)


def decoding(sched: Scheduler, *rids: str) -> list[Sequence]:
    """Sequences handed off to this worker, imported and decoding."""
    seqs = [handle_seq(rid, 3, start=100 * (i + 1), max_tokens=50) for i, rid in enumerate(rids)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.phase == "kv_import" and batch.seqs == seqs
    for s in seqs:
        s.num_cached = s.handle.num_tokens
    sched.mark_imported(seqs)
    return seqs


def test_a_riding_prompt_fills_the_decode_steps_spare_rows_until_its_last_chunk():
    """With 2 of 4 rows decoding, a 7-token prompt the router marked to ride goes in
    chunks of 2 beside both decodes (no step pauses them); its last chunk gives its first
    token and it decodes from the next step on."""
    sched = riding(ride_rows=4)
    a, b = decoding(sched, "a", "b")
    p = seq("p", 7, start=500)
    p.ride = True
    sched.add(p)
    steps = steps_to_first_token(sched, p)
    assert steps == [("mixed", [("p", 2), ("a", 1), ("b", 1)])] * 3 + [
        ("mixed", [("p", 1), ("a", 1), ("b", 1)])]
    assert sched.running == [a, b, p] and not sched.prefilling
    assert shape_of(sched.schedule()) == ("decode", [("a", 1), ("b", 1), ("p", 1)])


def test_a_prompt_runs_whole_unless_marked_to_ride_or_when_the_rows_are_taken():
    """Not marked (the router chose a whole step), or with as many decoding as the
    rows: one prefill step of the whole prompt, as without riding."""
    sched = riding(ride_rows=4)
    decoding(sched, "a", "b")
    whole = seq("whole", 7, start=500)
    sched.add(whole)
    assert shape_of(sched.schedule()) == ("prefill", [("whole", 7)])
    sched = riding(ride_rows=2)
    decoding(sched, "a", "b")
    p = seq("p", 7, start=500)
    p.ride = True
    sched.add(p)
    assert shape_of(sched.schedule()) == ("prefill", [("p", 7)])


def test_handed_off_sequences_come_in_while_a_prompt_rides_and_take_its_rows():
    """A prompt riding over many steps does not hold back the imports queued behind it
    (the prefill worker's handoffs); they decode beside it, and once they fill the rows
    the rest of the prompt runs whole in one step."""
    sched = riding(ride_rows=4)
    decoding(sched, "a", "b")
    p = seq("p", 9, start=500)
    p.ride = True
    sched.add(p)
    run_chunked(sched, first := sched.schedule())
    assert shape_of(first) == ("mixed", [("p", 2), ("a", 1), ("b", 1)])
    c, d = handle_seq("c", 3, start=700), handle_seq("d", 3, start=800)
    sched.add(c)
    sched.add(d)
    imported = sched.schedule()
    assert imported.phase == "kv_import" and imported.seqs == [c, d]
    for s in (c, d):
        s.num_cached = s.handle.num_tokens
    sched.mark_imported([c, d])
    assert shape_of(sched.schedule()) == ("prefill", [("p", 7)])   # 4 decoding: no room
