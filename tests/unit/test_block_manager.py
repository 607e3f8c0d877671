"""Paged KV bookkeeping: accounting, prefix caching over the hash chain, reservations."""
from __future__ import annotations

import random

import pytest

from appliance.engines.block_manager import BlockManager
from appliance.engines.messages import SamplingParams
from appliance.engines.sequence import Role, Sequence

BS = 4


def seq(rid: str, prompt: list[int], max_tokens: int = 1, role: Role = Role.FULL) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), role)


def compute(bm: BlockManager, s: Sequence) -> None:
    """What the engine does after a forward pass over s: all its tokens now hold KV."""
    s.num_cached = len(s.tokens)
    bm.commit(s)


def check_invariants(bm: BlockManager) -> None:
    assert 0 <= bm.reserved <= bm.num_free
    assert bm.available >= 0
    free = set(bm._free)
    for block, ref in enumerate(bm._ref):
        assert ref >= 0
        assert (ref == 0) == (block in free), f"block {block}: ref {ref}, free {block in free}"
        assert bm._free_map[block] == (ref == 0), f"block {block}: free map out of date"


# ---- accounting ---------------------------------------------------------------------

def test_allocate_takes_blocks_for_all_tokens_and_free_returns_them():
    bm = BlockManager(16, BS, reserve_ratio=0)
    a = seq("a", list(range(10)))          # 10 tokens -> 3 blocks
    b = seq("b", list(range(50, 55)))      # 5 tokens  -> 2 blocks
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert len(set(a.block_table) | set(b.block_table)) == 5      # no block given twice
    assert bm.num_free == 11
    assert all(bm._ref[x] == 1 for x in a.block_table + b.block_table)
    bm.free(a)
    assert bm.num_free == 14 and a.block_table == [] and a.num_cached == 0
    bm.free(b)
    assert bm.num_free == bm.num_blocks == 16
    assert bm.reserved == 0
    check_invariants(bm)


def test_shared_blocks_are_ref_counted_and_freed_by_the_last_holder():
    bm = BlockManager(16, BS, reserve_ratio=0)
    prompt = list(range(10))
    a = seq("a", prompt)
    bm.allocate(a)
    compute(bm, a)
    b = seq("b", prompt[:8] + [77, 78])
    bm.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [bm._ref[x] for x in shared] == [2, 2]
    assert bm.num_free == 16 - 3 - 1      # b took only its unshared third block
    bm.free(a)
    assert [bm._ref[x] for x in shared] == [1, 1]
    assert not any(x in bm._free for x in shared)     # still held by b
    assert bm.num_free == 16 - 3
    bm.free(b)
    assert bm.num_free == 16
    check_invariants(bm)


# ---- prefix caching --------------------------------------------------------------

def test_second_sequence_sharing_two_full_blocks_gets_the_same_blocks():
    bm = BlockManager(32, BS, reserve_ratio=0)
    a = seq("a", list(range(10)))           # full blocks: [0..3], [4..7]
    bm.allocate(a)
    compute(bm, a)
    b = seq("b", list(range(8)) + [90, 91, 92])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_cached == 2 * BS
    assert b.prefix_hit == 2 * BS
    assert b.uncached == 3


def test_sequence_differing_in_the_first_block_gets_no_hits():
    bm = BlockManager(32, BS, reserve_ratio=0)
    a = seq("a", list(range(10)))
    bm.allocate(a)
    compute(bm, a)
    # Same second block contents, different first block: the chain differs from the start.
    c = seq("c", [999, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(c)
    assert c.num_cached == 0
    assert not set(c.block_table) & set(a.block_table)


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(32, BS, reserve_ratio=0)
    a = seq("a", list(range(10)))
    bm.allocate(a)
    compute(bm, a)
    d = seq("d", list(range(2 * BS)))       # exactly two full, cached blocks
    assert bm.admission_cost(d) == (1, 0)   # one block reused, one fresh for the last token
    bm.allocate(d)
    assert d.num_cached == BS
    assert d.block_table[0] == a.block_table[0]
    assert d.block_table[1] != a.block_table[1]
    assert d.uncached == BS                 # the second block is recomputed


def test_uncommitted_blocks_give_no_hits():
    bm = BlockManager(32, BS, reserve_ratio=0)
    prompt = list(range(12))
    a = seq("a", prompt)
    bm.allocate(a)                          # allocated, forward pass not run yet
    b = seq("b", prompt + [50])
    bm.allocate(b)
    assert b.num_cached == 0
    assert not set(b.block_table) & set(a.block_table)
    compute(bm, a)
    c = seq("c", prompt + [51])
    bm.allocate(c)
    assert c.num_cached == 3 * BS
    assert c.block_table[:3] == a.block_table


def test_freed_cached_blocks_hit_until_handed_out_again_lru():
    bm = BlockManager(4, BS, reserve_ratio=0)
    prompt = list(range(9))                 # blocks [0..3] [4..7] [8]
    a = seq("a", prompt)
    bm.allocate(a)
    compute(bm, a)
    first, second, tail = a.block_table
    bm.free(a)
    assert bm.num_free == 4

    # Free but still cached: a new sequence gets the very same blocks back.
    b = seq("b", prompt[:8] + [40])
    assert bm.admission_cost(b) == (3, 0)   # the two hits come out of the free list too
    bm.allocate(b)
    assert b.block_table[:2] == [first, second]
    assert b.num_cached == 2 * BS
    bm.free(b)
    # LRU: the longest-free blocks go out first; `second` was freed before `first`
    # (tail-first) so it goes before it.
    filler = seq("filler", list(range(100, 100 + 3 * BS)))
    bm.allocate(filler)
    assert second in filler.block_table and first not in filler.block_table
    bm.free(filler)

    c = seq("c", prompt[:8] + [41])
    bm.allocate(c)
    assert c.block_table[0] == first
    assert c.num_cached == BS               # `second` was handed out: no longer a hit
    bm.free(c)

    # Hand every block out once: nothing hits any more.
    everything = seq("all", list(range(200, 200 + 4 * BS)))
    bm.allocate(everything)
    bm.free(everything)
    d = seq("d", prompt[:8] + [42])
    bm.allocate(d)
    assert d.num_cached == 0
    bm.free(d)
    check_invariants(bm)


def test_cache_hit_on_block_in_use_costs_no_free_block():
    bm = BlockManager(8, BS, reserve_ratio=0)
    a = seq("a", list(range(9)))
    bm.allocate(a)
    compute(bm, a)
    b = seq("b", list(range(8)) + [60])
    assert bm.admission_cost(b) == (1, 0)   # both hits are held by a: only the tail is new
    before = bm.num_free
    bm.allocate(b)
    assert bm.num_free == before - 1


# ---- reservations ----------------------------------------------------------------

def test_admission_cost_includes_reservation_for_max_tokens():
    bm = BlockManager(10, BS, reserve_ratio=1.0)
    s = seq("s", list(range(5)), max_tokens=8)       # 5 + 8 = 13 tokens -> 4 blocks
    assert bm.admission_cost(s) == (2, 2)
    bm.allocate(s)
    assert s.reserved_blocks == 2
    assert bm.reserved == 2
    assert bm.num_free == 8
    assert bm.available == 6

    too_big = seq("big", list(range(100, 108)), max_tokens=20)   # 28 tokens -> 7 blocks
    assert sum(bm.admission_cost(too_big)) == 7
    assert not bm.can_admit(too_big)                 # 7 > 6 available (8 free)
    fits = seq("fits", list(range(200, 204)), max_tokens=20)    # 24 tokens -> 6 blocks
    assert bm.can_admit(fits)
    bm.allocate(fits)
    assert bm.available == 0
    assert not bm.can_admit(seq("one", [1], max_tokens=1))
    check_invariants(bm)

    bm.free(s)
    bm.free(fits)
    assert bm.reserved == 0 and bm.available == bm.num_blocks


def test_half_reservation_ratio():
    bm = BlockManager(20, BS, reserve_ratio=0.5)
    s = seq("s", list(range(4)), max_tokens=16)      # 4 + 8 = 12 tokens -> 3 blocks
    assert bm.admission_cost(s) == (1, 2)


def test_append_block_consumes_the_reservation_first():
    bm = BlockManager(10, BS, reserve_ratio=1.0)
    s = seq("s", list(range(4)), max_tokens=8)       # 12 tokens -> 3 blocks, 2 reserved
    bm.allocate(s)
    assert (s.reserved_blocks, bm.reserved, bm.num_free, bm.available) == (2, 2, 9, 7)

    s.tokens.append(500)                             # 5th token: needs block 2
    assert bm.needs_block(s)
    bm.append_block(s)
    assert len(s.block_table) == 2
    assert (s.reserved_blocks, bm.reserved, bm.num_free, bm.available) == (1, 1, 8, 7)

    for t in range(3):                               # tokens 6..8 fit in block 2
        s.tokens.append(501 + t)
        assert not bm.needs_block(s)
        bm.append_block(s)
    assert len(s.block_table) == 2

    s.tokens.append(504)                             # 9th token: last reserved block
    bm.append_block(s)
    assert (s.reserved_blocks, bm.reserved, bm.num_free, bm.available) == (0, 0, 7, 7)

    # Past the reservation (e.g. max_context > max_tokens): from the shared pool.
    s.tokens.extend([505, 506, 507, 508])
    bm.append_block(s)
    assert (s.reserved_blocks, bm.reserved, bm.num_free, bm.available) == (0, 0, 6, 6)
    bm.free(s)
    assert bm.num_free == 10 and bm.reserved == 0


def test_reserved_blocks_are_not_available_to_others_but_can_append_uses_them():
    bm = BlockManager(4, BS, reserve_ratio=1.0)
    s = seq("s", list(range(4)), max_tokens=12)      # 16 tokens -> 4 blocks: 1 + 3 reserved
    bm.allocate(s)
    assert bm.available == 0
    assert not bm.can_admit(seq("x", [1], max_tokens=1))
    s.tokens.append(9)
    assert bm.can_append(s)                          # its own reservation
    other = seq("o", [7], max_tokens=1)             # holds no blocks, needs one
    assert not bm.can_append(other)                  # nobody else's


def test_over_admission_can_append_fails_when_pool_is_empty():
    bm = BlockManager(2, BS, reserve_ratio=0)
    s = seq("s", list(range(8)), max_tokens=10)
    assert bm.admission_cost(s) == (2, 0)
    bm.allocate(s)
    s.tokens.append(1)
    assert bm.needs_block(s) and not bm.can_append(s)


def test_prefill_role_reserves_nothing():
    # A PREFILL sequence hands its KV off after the first token and never decodes on
    # this worker: reserving its max_tokens would only shrink the prefill batch.
    bm = BlockManager(10, BS, reserve_ratio=1.0)
    p = seq("p", list(range(5)), max_tokens=100, role=Role.PREFILL)
    assert bm.admission_cost(p) == (2, 0)
    assert bm.can_admit(p)
    bm.allocate(p)
    assert p.reserved_blocks == 0 and bm.reserved == 0


def test_random_workload_keeps_invariants_and_frees_everything():
    rng = random.Random(7)
    bm = BlockManager(24, BS, reserve_ratio=0.5)
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    live: list[Sequence] = []
    for i in range(400):
        op = rng.random()
        if op < 0.35:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 9)] + [
                rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
            if not prompt:
                continue
            s = seq(f"s{i}", prompt, max_tokens=rng.randrange(1, 12))
            if bm.can_admit(s):
                bm.allocate(s, run=rng.random() < 0.3)
                assert len(s.block_table) == bm.blocks_for(len(s.tokens))
                compute(bm, s)
                live.append(s)
        elif op < 0.8 and live:
            s = rng.choice(live)
            s.tokens.append(rng.randrange(1000))
            if bm.can_append(s):
                bm.append_block(s)
                compute(bm, s)
            else:
                s.tokens.pop()
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        check_invariants(bm)
    for s in live:
        bm.free(s)
    check_invariants(bm)
    assert bm.num_free == bm.num_blocks
    assert bm.reserved == 0
    assert all(r == 0 for r in bm._ref)


def test_fresh_blocks_come_in_ascending_runs():
    """Handoffs copy runs of blocks as one slice: the allocator keeps freed runs together
    (LRU picks the set, the table lists it in ascending order), and a `run` allocation
    (KV import) takes a free run outright when one is long enough, else a few long ones."""
    bm = BlockManager(16, BS, reserve_ratio=0)
    a = seq("a", list(range(6 * BS)))
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)                                  # freed tail first: LRU holds 5, 4, .., 0
    b = seq("b", list(range(500, 500 + 12 * BS)))
    bm.allocate(b)
    # The LRU set: the 10 never-used blocks (6..15) first, then a's tail blocks 5 and 4
    # (its head 0..3 stays cached); listed in ascending order: one run.
    assert b.block_table == list(range(4, 16))

    # Fragment the pool: holes of one block between used ones, and one run of 3.
    bm = BlockManager(16, BS, reserve_ratio=0)
    hold = [seq(f"h{i}", [i] * BS) for i in range(16)]
    for h in hold:
        bm.allocate(h)
    for i in (1, 3, 5, 9, 10, 11, 13):
        bm.free(hold[i])
    imp = seq("imp", list(range(3 * BS)), role=Role.DECODE)
    bm.allocate(imp, use_cache=False, run=True)
    assert imp.block_table == [9, 10, 11]
    lru = seq("lru", list(range(3 * BS)), role=Role.DECODE)
    bm.free(imp)
    bm.allocate(lru, use_cache=False)           # LRU set, sorted: not the run
    assert lru.block_table == [1, 3, 5]
    wide = seq("wide", list(range(4 * BS)), role=Role.DECODE)
    bm.allocate(wide, use_cache=False, run=True)  # no free run of 4: the run of 3, then 1
    assert wide.block_table == [9, 10, 11, 13]
    check_invariants(bm)


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
