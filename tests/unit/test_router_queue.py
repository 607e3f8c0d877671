"""The router's fair queue: which request goes to a worker next when every worker of a
role is saturated (`appliance.daemon.dispatch`, applied by `daemon.router.Router`).

The router and its worker links are the real ones, without processes: a link is made
ready by hand, what the router sends it stays in its outbox, and a test plays the worker
by putting events on the request's channel."""
from __future__ import annotations

import asyncio

import pytest

from appliance.daemon.dispatch import QUEUE_STEPS, DispatchQueue, has_room, pick_with_room
from appliance.daemon.router import EngineError, NoWorker, Router, Trace
from appliance.daemon.workers import WorkerGone, WorkerPool
from appliance.engines.messages import (
    Hello, KvHandle, Prefill, PrefillDone, SamplingParams, Tokens, WorkerStats,
)
from appliance.config import ConfigError, TenantConfig, parse
from appliance.worker.spec import WorkerSpec


def _spec(name: str, role: str = "agg", max_seqs: int = 1, max_batch_tokens: int = 1000):
    return WorkerSpec(worker=name, role=role, engine="sim", devices=["sim0"], device_kind="sim",
                      model_dir="/nonexistent", max_seqs=max_seqs, max_batch_tokens=max_batch_tokens)


def _pool(*specs) -> WorkerPool:
    pool = WorkerPool(list(specs))
    for w in pool.workers.values():
        w.state = "ready"
        w._flush = lambda: None        # no process: what is sent stays in the outbox
    return pool


class Client:
    """One request through `Router.generate`, recorded: where it went and what it got."""

    def __init__(self, router: Router, name: str, tenant: str, tokens: int = 10,
                 priority: int | None = None, max_tokens: int = 1):
        self.router, self.name, self.tenant = router, name, tenant
        self.trace = Trace(name, 0.0)
        self.steps: list = []
        self.task = asyncio.create_task(self._run(tokens, priority, max_tokens))

    async def _run(self, tokens: int, priority, max_tokens: int):
        gen = self.router.generate(self.trace, [1] * tokens, SamplingParams(max_tokens=max_tokens),
                                   self.tenant, priority)
        async for step in gen:
            self.steps.append(step)


def _sent(pool: WorkerPool) -> list[str]:
    """Request ids the router has sent Prefills for, in order (the outboxes, unflushed)."""
    return [m.request_id for w in pool.workers.values() for m in w._outbox
            if isinstance(m, Prefill)]


def _finish(pool: WorkerPool, rid: str) -> None:
    for w in pool.workers.values():
        ch = w.channels.get(rid)
        if ch is not None:
            ch.put(Tokens(rid, [7], "length"))
            return
    raise AssertionError(f"{rid} is on no worker")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ---- saturation --------------------------------------------------------------------------

def test_a_worker_is_saturated_by_its_seqs_or_queued_steps_never_when_idle():
    pool = _pool(_spec("a0", max_seqs=2, max_batch_tokens=100))
    w = pool.workers["a0"]
    assert has_room(w, 10 ** 6)                       # idle: any prompt, however long
    w.inflight, w.pending_prefill_tokens = 1, 50
    assert has_room(w, QUEUE_STEPS * 100 - 50)
    assert not has_room(w, QUEUE_STEPS * 100 - 49)     # past QUEUE_STEPS full steps
    w.inflight = 2
    assert not has_room(w, 1)                          # at max_seqs
    other = _pool(_spec("a1", max_seqs=2)).workers["a1"]
    assert pick_with_room([w, other], 1) is other
    other.inflight = 2
    other.pending_prefill_tokens = 1
    assert pick_with_room([w, other], 1) is None


# ---- the queue -------------------------------------------------------------------------

def test_fast_path_does_not_queue_and_saturation_does():
    async def scenario():
        pool = _pool(_spec("a0", max_seqs=2))
        router = Router(pool, "agg")
        a, b, c = (Client(router, f"r{i}", "t") for i in range(3))
        await _settle()
        assert _sent(pool) == ["r0", "r1"] and len(router.dispatch) == 1
        assert router.depth("t") == 1
        _finish(pool, "r0")
        await _settle()
        assert _sent(pool) == ["r0", "r1", "r2"] and len(router.dispatch) == 0
        assert a.steps == [([7], "length", None)] and a.trace.prefill_worker == "a0"
        for rid in ("r1", "r2"):
            _finish(pool, rid)
        await asyncio.gather(a.task, b.task, c.task)
        assert pool.workers["a0"].inflight == 0 and router.depth("t") == 0

    asyncio.run(scenario())


def test_a_polite_tenant_goes_ahead_of_a_flood_waiting_at_the_router():
    async def scenario():
        pool = _pool(_spec("a0", max_seqs=1))
        router = Router(pool, "agg")
        flood = [Client(router, f"f{i}", "flood", tokens=500) for i in range(6)]
        await _settle()
        polite = Client(router, "p0", "polite", tokens=20)
        await _settle()
        assert router.depth("flood") == 5 and router.depth("polite") == 1
        order = []
        while len(order) < 7:
            sent = _sent(pool)
            rid = sent[len(order)]
            order.append(rid)
            _finish(pool, rid)
            await _settle()
        # f0 was at the worker already; the polite request is next, before f1..f5.
        assert order == ["f0", "p0", "f1", "f2", "f3", "f4", "f5"]
        await asyncio.gather(polite.task, *(c.task for c in flood))

    asyncio.run(scenario())


def test_waiting_tenants_are_dispatched_in_proportion_to_their_weights():
    async def scenario():
        pool = _pool(_spec("a0", max_seqs=1))
        router = Router(pool, "agg", tenants={"big": TenantConfig(weight=2.0),
                                              "small": TenantConfig(weight=1.0)})
        blocker = Client(router, "x", "other")
        await _settle()
        big = [Client(router, f"b{i}", "big", tokens=100) for i in range(8)]
        small = [Client(router, f"s{i}", "small", tokens=100) for i in range(8)]
        await _settle()
        order = []
        _finish(pool, "x")
        await _settle()
        while len(order) < 9:
            rid = _sent(pool)[len(order) + 1]
            order.append(rid)
            _finish(pool, rid)
            await _settle()
        assert sum(r.startswith("b") for r in order) == 6      # 2:1 over the first nine
        for c in big + small:
            c.task.cancel()
        await asyncio.gather(blocker.task, *(c.task for c in big + small), return_exceptions=True)
        assert len(router.dispatch) == 0 and pool.workers["a0"].inflight == 0

    asyncio.run(scenario())


def test_a_better_priority_class_goes_first_and_fair_queuing_off_is_arrival_order():
    async def scenario(fair: bool):
        pool = _pool(_spec("a0", max_seqs=1))
        router = Router(pool, "agg", tenants={"batch": TenantConfig(priority=5)},
                        fair_queuing=fair)
        blocker = Client(router, "x", "search")
        await _settle()
        clients = [Client(router, "b0", "batch"), Client(router, "b1", "batch"),
                   Client(router, "s0", "search", tokens=50)]
        await _settle()
        order = []
        _finish(pool, "x")
        await _settle()
        while len(order) < 3:
            rid = _sent(pool)[len(order) + 1]
            order.append(rid)
            _finish(pool, rid)
            await _settle()
        await asyncio.gather(blocker.task, *(c.task for c in clients))
        return order

    assert asyncio.run(scenario(True)) == ["s0", "b0", "b1"]
    assert asyncio.run(scenario(False)) == ["b0", "b1", "s0"]


# ---- nothing leaks -------------------------------------------------------------------------

def test_a_request_cancelled_while_waiting_leaves_nothing_behind():
    async def scenario():
        pool = _pool(_spec("a0", max_seqs=1))
        router = Router(pool, "agg", tenants={"t": TenantConfig(max_concurrent=5)})
        w = pool.workers["a0"]
        first = Client(router, "r0", "t")
        waiting = [Client(router, f"r{i}", "t", tokens=30) for i in (1, 2)]
        await _settle()
        assert router.depth("t") == 2 and w.inflight == 1 and w.pending_prefill_tokens == 10
        waiting[0].task.cancel()                       # the client went away
        await _settle()
        assert waiting[0].task.cancelled()
        assert router.depth("t") == 1 and w.inflight == 1 and w.pending_prefill_tokens == 10
        assert router.gate.inflight["t"] == 2          # its max_concurrent slot is back
        # Granted, then cancelled before it ran: the claim goes back, the room passes on.
        third = Client(router, "r3", "t")
        await _settle()
        _finish(pool, "r0")
        while "r2" not in w.channels:                  # r0's generator ends: r2 granted
            await asyncio.sleep(0)
        waiting[1].task.cancel()
        await _settle()
        assert waiting[1].task.cancelled()
        assert _sent(pool)[-1] == "r3" and set(w.channels) == {"r3"}
        assert w.inflight == 1 and w.pending_prefill_tokens == 10
        _finish(pool, "r3")
        await asyncio.gather(first.task, third.task)
        assert w.inflight == 0 and w.pending_prefill_tokens == 0 and not w.channels
        assert len(router.dispatch) == 0 and router.depth("t") == 0
        assert router.gate.inflight == {}

    asyncio.run(scenario())


def test_waiting_requests_follow_a_repartition_and_fail_when_no_worker_is_left():
    async def scenario():
        pool = _pool(_spec("p0", role="prefill"), _spec("d0", role="decode"),
                     _spec("p1", role="prefill"))
        router = Router(pool, "disagg")
        router.set_routing(["p0", "d0"])               # p1 is not routed (yet)
        first = Client(router, "r0", "t")
        waiting = [Client(router, f"r{i}", "t") for i in (1, 2)]
        await _settle()
        assert router.depth("t") == 2
        # A repartition: p1 replaces p0 (p0 drains). The waiting requests go to p1 at once.
        router.set_routing(["p1", "d0"])
        await _settle()
        assert [m.request_id for m in pool.workers["p1"]._outbox] == ["r1"]
        assert waiting[0].trace.prefill_worker == "p1" and router.depth("t") == 1
        # Then no prefill worker at all: the one left waiting is told, as a new request is.
        router.set_routing(["d0"])
        await _settle()
        assert waiting[1].task.done()
        with pytest.raises(NoWorker):
            waiting[1].task.result()
        assert router.depth("t") == 0 and len(router.dispatch) == 0
        for c in (first, waiting[0]):
            c.task.cancel()
        await asyncio.gather(first.task, waiting[0].task, return_exceptions=True)
        assert all(not w.channels and w.inflight == 0 for w in pool.workers.values())

    asyncio.run(scenario())


def test_a_worker_that_dies_is_not_given_waiting_requests():
    async def scenario():
        pool = _pool(_spec("a0", max_seqs=1))
        router = Router(pool, "agg")
        w = pool.workers["a0"]
        first = Client(router, "r0", "t")
        second = Client(router, "r1", "t")
        await _settle()
        # What `WorkerLink._died` does, without a process: not ready, then listeners.
        w.state = "restarting"
        w.channels.clear()
        w.inflight = w.pending_prefill_tokens = 0
        pool.on_death(w)
        await _settle()
        with pytest.raises(NoWorker):
            second.task.result()
        assert not w.channels and len(router.dispatch) == 0
        first.task.cancel()
        await asyncio.gather(first.task, return_exceptions=True)

    asyncio.run(scenario())


def test_dispatch_queue_gives_back_a_grant_its_request_no_longer_wants():
    class Worker:
        inflight, pending_prefill_tokens = 1, 0

        class spec:
            max_seqs, max_batch_tokens = 1, 100

    w = Worker()
    claims, unclaims = [], []

    def claim(worker):
        worker.inflight += 1
        claims.append(worker)
        return worker

    def unclaim(worker):
        worker.inflight -= 1
        unclaims.append(worker)

    async def scenario():
        q = DispatchQueue()
        tasks = {t: asyncio.create_task(q.wait(5, t[0], 1.0, 0, claim, unclaim, lambda: [w]))
                 for t in ("a1", "a2", "b1")}
        await _settle()
        assert (q.depth("a"), q.depth("b"), len(q), claims) == (2, 1, 3, [])
        w.inflight = 0                                  # room for one
        q.pump(lambda: [w])
        assert len(claims) == 1 and w.inflight == 1     # b (fewer waiting) is granted...
        tasks["b1"].cancel()                            # ...and cancelled before it runs
        await _settle()
        assert tasks["b1"].cancelled() and unclaims == [w]
        assert tasks["a1"].done() and tasks["a1"].result() is w   # the room passed on
        assert w.inflight == 1 and (q.depth("a"), q.depth("b"), len(q)) == (1, 0, 1)
        tasks["a2"].cancel()
        await asyncio.gather(tasks["a2"], return_exceptions=True)
        assert len(q) == 0 and q.depth("a") == 0 and q.queue.clock.vt == {}
        assert len(claims) == 2 and w.inflight == 1

    asyncio.run(scenario())


# ---- the decode side's KV (disagg) ----------------------------------------------------

def _stats(w, total: int) -> None:
    """A worker's stats report as `WorkerLink._read` keeps it, without a process."""
    w.stats = WorkerStats(w.id, 0, 0, 0, total, total, 0, 0, 0.0, 0, 0)


def _done(pool: WorkerPool, rid: str) -> None:
    """The prefill worker finishes `rid` outright (its answer was one token)."""
    pool.workers["p0"].channels[rid].put(PrefillDone(rid, 7, None, "length"))


def test_requests_wait_in_fair_order_for_kv_on_the_decode_side():
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=100, max_batch_tokens=10 ** 6),
                     _spec("d0", role="decode"))
        router = Router(pool, "disagg", decode_kv_gate=True)
        _stats(pool.workers["d0"], total=12)
        # 32-token prompts and 1-token answers (block size 16): 3 blocks, and one for the
        # first token. The prefill worker has room for all; the decode side for three.
        flood = [Client(router, f"f{i}", "flood", tokens=32) for i in range(5)]
        await _settle()
        assert _sent(pool) == ["f0", "f1", "f2"] and router.depth("flood") == 2
        assert router.decode_committed == 12
        polite = Client(router, "p0", "polite", tokens=32)
        await _settle()
        assert router.depth("polite") == 1          # behind the queue, not past it
        # a request ends: its blocks are free again, and the polite one goes first
        _done(pool, "f0")
        await _settle()
        assert flood[0].steps == [([7], "length", None)]
        assert _sent(pool) == ["f0", "f1", "f2", "p0"] and router.depth("flood") == 2
        for rid, then in (("f1", "f3"), ("f2", "f4")):
            _done(pool, rid)
            await _settle()
            assert _sent(pool)[-1] == then
        for rid in ("p0", "f3", "f4"):
            _done(pool, rid)
        await asyncio.gather(*(c.task for c in (*flood, polite)))
        assert router.decode_committed == 0 and len(router.dispatch) == 0
        assert all(not w.channels and w.inflight == 0 for w in pool.workers.values())

    asyncio.run(scenario())


def test_decode_kv_holds_back_nothing_it_cannot_judge_and_refuses_what_never_fits():
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=100, max_batch_tokens=10 ** 6),
                     _spec("d0", role="decode"))
        router = Router(pool, "disagg", decode_kv_gate=True)
        d0 = pool.workers["d0"]
        # no stats report yet: not held back
        first = [Client(router, f"a{i}", "t", tokens=32) for i in range(3)]
        await _settle()
        assert _sent(pool) == ["a0", "a1", "a2"]
        _stats(d0, total=12)
        # a prompt that d0 could not import even empty: a clear error at once, no wait
        huge = Client(router, "huge", "t", tokens=16 * 20)
        await asyncio.gather(huge.task, return_exceptions=True)
        err = huge.task.exception()
        assert isinstance(err, EngineError) and err.code == "kv_capacity", err
        assert "largest holds 12" in str(err) and router.depth("t") == 0
        # a long answer that d0 could hold only empty counts as its whole pool (as d0
        # reserves it), and waits like any other
        long = Client(router, "long", "t", tokens=32, max_tokens=16 * 20)
        await _settle()
        assert _sent(pool)[-1] == "a2" and router.depth("t") == 1
        # one cancelled while it waits commits nothing
        long.task.cancel()
        await _settle()
        assert router.depth("t") == 0 and router.decode_committed == 4 * 3
        for c in first:
            c.task.cancel()
        await asyncio.gather(*(c.task for c in (*first, long)), return_exceptions=True)
        assert router.decode_committed == 0 and router._committed == {}
        # an idle decode side takes any request, whatever it reported
        _stats(d0, total=3)
        alone = Client(router, "alone", "t", tokens=32)
        await _settle()
        assert _sent(pool)[-1] == "alone"
        _done(pool, "alone")
        await alone.task

    asyncio.run(scenario())


def _kill(w) -> None:
    """What `WorkerLink._died` does to a worker that died: its requests hear WorkerGone,
    its counters reset, it restarts (not ready) and the pool is told."""
    gone = WorkerGone(f"worker {w.id} died (-9)")
    for ch in w.channels.values():
        ch.put(gone)
    w.channels.clear()
    w.inflight = w.kv_holds = w.pending_prefill_tokens = w.pending_kv_blocks = 0
    w.stats = None
    w.state = "restarting"
    w.pool.on_death(w)


def _handoff(pool: WorkerPool, rid: str) -> None:
    """p-worker `rid` is prefilled and its KV handed off (the decode is next)."""
    for w in pool.workers.values():
        if w.role == "prefill" and rid in w.channels:
            w.channels[rid].put(PrefillDone(rid, 7, KvHandle(w.id, rid, [0, 1, 2], 32, "l"),
                                            None))
            return
    raise AssertionError(f"{rid} is on no prefill worker")


def test_decode_kv_is_given_back_however_a_request_ends_across_a_model_swap():
    """Every way a placed request can end gives back exactly what it committed: its
    decode worker dying mid-decode, its prefill worker dying mid-prefill, the routing set
    switched to new workers under a waiting request (a swap), the client gone while it
    prefills and while it decodes. Afterwards nothing is counted and a request as large
    as the decode side goes at once."""
    async def scenario():
        spec = dict(role="prefill", max_seqs=100, max_batch_tokens=10 ** 6)
        pool = _pool(_spec("p0", **spec), _spec("d0", role="decode"))
        router = Router(pool, "disagg", decode_kv_gate=True)
        _stats(pool.workers["d0"], total=12)
        ask = dict(tokens=32, max_tokens=32)      # 4 blocks + 1: five each
        a, b = Client(router, "a", "t", **ask), Client(router, "b", "t", **ask)
        await _settle()
        assert router.decode_committed == 10 and _sent(pool) == ["a", "b"]
        c = Client(router, "c", "t", **ask)        # 10 + 5 > 12: waits
        await _settle()
        assert router.depth("t") == 1
        # a: prefilled, decoding on d0, which dies
        _handoff(pool, "a")
        await _settle()
        assert "a" in pool.workers["d0"].channels
        _kill(pool.workers["d0"])
        await asyncio.gather(a.task, return_exceptions=True)
        assert isinstance(a.task.exception(), WorkerGone)
        await _settle()
        assert _sent(pool)[-1] == "c" and router.decode_committed == 10   # a's room, passed on
        # b and c: their prefill worker dies mid-prefill
        _kill(pool.workers["p0"])
        await asyncio.gather(b.task, c.task, return_exceptions=True)
        assert all(isinstance(x.task.exception(), WorkerGone) for x in (b, c))
        assert router.decode_committed == 0 and router._committed == {}
        # one arriving now, with no prefill worker ready, is told so (never left waiting)
        x = Client(router, "x", "t", **ask)
        await asyncio.gather(x.task, return_exceptions=True)
        assert isinstance(x.task.exception(), NoWorker)
        # the swap: new workers, routed all at once; the old ones are gone
        new = [pool.add(_spec("p1", **spec)), pool.add(_spec("d1", role="decode"))]
        for w in new:
            w.state = "ready"
            w._flush = lambda: None
        _stats(new[1], total=12)
        router.set_routing(["p1", "d1"])
        d, e = Client(router, "d", "t", **ask), Client(router, "e", "t", **ask)
        await _settle()
        assert router.decode_committed == 10
        d.task.cancel()                            # client gone mid-prefill
        _handoff(pool, "e")
        await _settle()
        assert "e" in new[1].channels
        e.task.cancel()                            # client gone mid-decode
        await asyncio.gather(d.task, e.task, return_exceptions=True)
        assert router.decode_committed == 0 and router._committed == {}
        assert all(not w.channels and w.inflight == 0 and w.kv_holds == 0 for w in new)
        # nothing leaked: a request as large as the whole decode side goes at once
        f = Client(router, "f", "t", tokens=16 * 9, max_tokens=32)
        g = Client(router, "g", "t", tokens=16, max_tokens=1)
        await _settle()
        assert [m.request_id for m in new[0]._outbox if isinstance(m, Prefill)][-1] == "f"
        assert router.decode_committed == 12 and router.depth("t") == 1
        new[0].channels["f"].put(PrefillDone("f", 7, None, "length"))
        await f.task
        await _settle()
        new[0].channels["g"].put(PrefillDone("g", 7, None, "length"))
        await g.task
        assert router.decode_committed == 0 and router._committed == {}

    asyncio.run(scenario())


def test_the_decode_kv_gate_never_holds_a_request_past_its_wait():
    """Long answers can hold the decode side's KV for minutes (a swap's streams with
    30,000-token answers held it for good in test_workflows): a request the gate holds
    goes on after `decode_kv_gate_wait_s` anyway, as it would ungated."""
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=100, max_batch_tokens=10 ** 6),
                     _spec("d0", role="decode"))
        router = Router(pool, "disagg", decode_kv_gate=True, decode_kv_gate_wait_s=0.3)
        _stats(pool.workers["d0"], total=12)
        streams = [Client(router, f"s{i}", "t", tokens=32, max_tokens=32) for i in range(2)]
        await _settle()
        late = Client(router, "late", "t", tokens=32, max_tokens=32)
        await _settle()
        assert _sent(pool) == ["s0", "s1"] and router.depth("t") == 1
        t0 = asyncio.get_running_loop().time()
        while "late" not in _sent(pool):
            assert asyncio.get_running_loop().time() - t0 < 5, "held past its wait"
            await asyncio.sleep(0.02)
        assert asyncio.get_running_loop().time() - t0 >= 0.2
        # it is not counted (the decode worker decides for it): what the gate admitted
        # still leaves its room to the next short request
        assert router.depth("t") == 0 and router.decode_committed == 10
        short = Client(router, "short", "t", tokens=15, max_tokens=1)     # two blocks
        await _settle()
        assert _sent(pool)[-1] == "short" and router.decode_committed == 12
        _done(pool, "short")
        await short.task
        for rid in ("s0", "s1", "late"):
            _done(pool, rid)
        await asyncio.gather(*(c.task for c in (*streams, late)))
        assert router.decode_committed == 0

    asyncio.run(scenario())


def test_the_decode_seq_cap_holds_requests_in_fair_order_per_ready_decode_worker():
    """`decode_max_seqs`: no more requests placed and unfinished than so many per ready
    decode worker; those beyond wait in the fair queue, before any prefill, and go as
    requests end; no KV accounting is needed for it (no stats report, any prompt)."""
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=100, max_batch_tokens=10 ** 6),
                     _spec("d0", role="decode"), _spec("d1", role="decode"))
        pool.workers["d1"].state = "starting"
        router = Router(pool, "disagg", decode_max_seqs=2)
        assert router.gated and not router.kv_gated
        flood = [Client(router, f"f{i}", "flood", tokens=32) for i in range(6)]
        await _settle()
        assert _sent(pool) == ["f0", "f1"] and router.depth("flood") == 4
        polite = Client(router, "q", "polite", tokens=16 * 40)    # larger than any pool
        await _settle()
        assert router.depth("polite") == 1
        _done(pool, "f0")
        await _settle()
        assert _sent(pool) == ["f0", "f1", "q"] and router.depth("flood") == 4
        # a second decode worker ready: room for two more at once
        pool.workers["d1"].state = "ready"
        router._pump()
        await _settle()
        assert _sent(pool) == ["f0", "f1", "q", "f2", "f3"] and router.depth("flood") == 2
        assert router.decode_admission() == {
            "max_seqs_per_decode_worker": 2, "kv_gate": False, "counted": 4,
            "kv_blocks_counted": sum(router._committed.values()), "waiting": 2}
        # no decode worker ready: nothing to judge by, nothing held back
        for w in ("d0", "d1"):
            pool.workers[w].state = "starting"
        router._pump()
        await _settle()
        assert _sent(pool)[-2:] == ["f4", "f5"] and len(router.dispatch) == 0
        for rid in ("f1", "q", "f2", "f3", "f4", "f5"):
            _done(pool, rid)
        await asyncio.gather(*(c.task for c in (*flood, polite)))
        assert router._committed == {} and router.decode_committed == 0

    asyncio.run(scenario())


def test_the_decode_seq_cap_counts_a_prompt_the_decode_worker_prefills_itself():
    """Unlike the KV gate, the cap leaves conditional disaggregation on: a prompt the
    decode worker prefills itself is one more sequence in decode, counted like one
    handed off; and a request held past `decode_kv_gate_wait_s` goes on uncounted."""
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=3, max_batch_tokens=100),
                     _spec("d0", role="decode", max_seqs=100))
        router = Router(pool, "disagg", queue_tokens=1000, decode_max_seqs=2,
                        decode_kv_gate_wait_s=0.3)
        assert router.queue_tokens == 1000
        a = Client(router, "a", "t", tokens=10, max_tokens=4)
        await _settle()
        b = Client(router, "b", "t", tokens=10, max_tokens=4)     # p0 busy: empty d0 takes it
        await _settle()
        assert _placed(pool) == {"a": ("p0", True), "b": ("d0", False)}
        c = Client(router, "c", "t", tokens=10, max_tokens=4)
        await _settle()
        assert set(_placed(pool)) == {"a", "b"} and router.depth("t") == 1
        pool.workers["d0"].channels["b"].put(Tokens("b", [8], "length"))
        await b.task
        await _settle()
        assert _placed(pool)["c"] == ("d0", False) and sorted(router._committed) == ["a", "c"]
        late = Client(router, "late", "t", tokens=10, max_tokens=4)
        t0 = asyncio.get_running_loop().time()
        while "late" not in _placed(pool):
            assert asyncio.get_running_loop().time() - t0 < 5, "held past its wait"
            await asyncio.sleep(0.02)
        assert asyncio.get_running_loop().time() - t0 >= 0.2
        assert _placed(pool)["late"] == ("p0", True) and sorted(router._committed) == ["a", "c"]
        for client in (a, c, late):
            client.task.cancel()
        await asyncio.gather(a.task, c.task, late.task, return_exceptions=True)
        assert router._committed == {} and len(router.dispatch) == 0

    asyncio.run(scenario())


def test_the_decode_seq_cap_is_off_where_no_decode_worker_shares_the_router():
    assert parse("[engine]\ndecode_max_seqs = 28\n", "t.toml").engine.decode_max_seqs == 28
    with pytest.raises(ConfigError) as err:
        parse("[engine]\ndecode_max_seqs = -1\n", "t.toml")
    assert str(err.value) == "t.toml: config: engine.decode_max_seqs must be 0 (off) or more, got -1"
    pool = _pool(_spec("p0", role="prefill"), _spec("d0", role="decode"))
    assert not Router(_pool(_spec("a0")), "agg", decode_max_seqs=4).gated
    assert not Router(pool, "disagg", decode_max_seqs=4, role="prefill").gated
    assert not Router(pool, "disagg").gated


# ---- conditional disaggregation by queue length ---------------------------------------

def _placed(pool: WorkerPool) -> dict[str, tuple[str, bool]]:
    """Each request the router sent a Prefill for: (worker, whether it hands its KV off)."""
    return {m.request_id: (w.id, m.handoff) for w in pool.workers.values()
            for m in w._outbox if isinstance(m, Prefill)}


def _first_token(pool: WorkerPool, rid: str, worker: str) -> None:
    pool.workers[worker].channels[rid].put(Tokens(rid, [7], None))


def test_a_long_prefill_queue_sends_one_prompt_at_a_time_to_the_decode_worker():
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=100, max_batch_tokens=100),
                     _spec("d0", role="decode", max_seqs=100))
        router = Router(pool, "disagg", queue_tokens=25)
        pool.workers["d0"].open("decoding")      # a sequence decodes there
        first = [Client(router, f"r{i}", "t", tokens=10, max_tokens=4) for i in range(4)]
        await _settle()
        # r0, r1: 10 and 20 tokens queued, under 25. r2 makes it 30: the decode worker,
        # with no prompt of its own, prefills it itself (no handoff). r3: the decode
        # worker has one under way, so the prefill worker.
        assert _placed(pool) == {"r0": ("p0", True), "r1": ("p0", True),
                                 "r2": ("d0", False), "r3": ("p0", True)}
        assert pool.workers["d0"].pending_prefill_tokens == 10
        # its first token: the decode worker may take another prompt
        _first_token(pool, "r2", "d0")
        await _settle()
        assert first[2].steps == [([7], None, None)]
        assert first[2].trace.prefill_worker == first[2].trace.decode_worker == "d0"
        assert pool.workers["d0"].pending_prefill_tokens == 0
        r4 = Client(router, "r4", "t", tokens=10)
        await _settle()
        assert _placed(pool)["r4"] == ("d0", False)
        # a prompt longer than one prefill step of the prefill worker never pauses the
        # decodes for longer: it waits for the prefill worker
        _first_token(pool, "r4", "d0")
        await _settle()
        long = Client(router, "long", "t", tokens=101)
        await _settle()
        assert _placed(pool)["long"] == ("p0", True)
        for c in (*first, r4, long):
            c.task.cancel()
        await asyncio.gather(*(c.task for c in (*first, r4, long)), return_exceptions=True)
        pool.workers["d0"].close("decoding")
        assert all(not w.channels and w.pending_prefill_tokens == 0
                   for w in pool.workers.values())

    asyncio.run(scenario())


def test_an_empty_decode_worker_takes_a_prompt_that_would_wait_under_the_threshold():
    """Below `queue_tokens`, a decode worker with no request at all prefills the next
    prompt itself when it would wait behind another on the prefill worker; not while the
    prefill worker is free, nor once the decode worker has anything of its own; and when
    its last request ends, the router's queue is looked at again."""
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=2, max_batch_tokens=100),
                     _spec("d0", role="decode", max_seqs=100))
        router = Router(pool, "disagg", queue_tokens=1000, prefill_share=0.01)

        async def ends_on_d0(client: Client) -> None:
            pool.workers["d0"].channels[client.name].put(Tokens(client.name, [8], "length"))
            await client.task
            await _settle()

        a = Client(router, "a", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool) == {"a": ("p0", True)}             # the prefill worker is free
        b = Client(router, "b", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["b"] == ("d0", False)              # it would wait behind a
        c = Client(router, "c", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["c"] == ("p0", True)               # d0 has b under way
        _first_token(pool, "b", "d0")                           # b decodes on d0 now
        await _settle()
        d = Client(router, "d", "t", tokens=10, max_tokens=4)
        await _settle()
        # the prefill worker is at its max_seqs and d0 is not empty: d waits at the router
        # (1000 queued tokens are far off)
        assert "d" not in _placed(pool) and router.depth("t") == 1
        # b ends: d0 is empty again and takes d at once, though a and c still hold p0
        await ends_on_d0(b)
        assert _placed(pool)["d"] == ("d0", False) and router.depth("t") == 0
        # the same when d0's last request is one handed off to it: a's prompt is done on
        # p0 and a decodes on d0; d ends; e waits at the router (p0 has c and f, d0 has a);
        # a ends and d0, empty, takes e
        p0 = pool.workers["p0"]
        p0.channels["a"].put(PrefillDone("a", 7, KvHandle("p0", "a", [0], 10, "l"), None))
        await _settle()
        assert "a" in pool.workers["d0"].channels
        _first_token(pool, "d", "d0")
        await ends_on_d0(d)
        f = Client(router, "f", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["f"] == ("p0", True)
        e = Client(router, "e", "t", tokens=10, max_tokens=4)
        await _settle()
        assert "e" not in _placed(pool) and router.depth("t") == 1
        await ends_on_d0(a)
        assert _placed(pool)["e"] == ("d0", False) and router.depth("t") == 0
        for x in (c, e, f):
            x.task.cancel()
        await asyncio.gather(c.task, e.task, f.task, return_exceptions=True)
        assert all(not w.channels and w.pending_prefill_tokens == 0
                   for w in pool.workers.values())

    asyncio.run(scenario())


def test_an_empty_decode_worker_leaves_a_prompt_to_a_free_prefill_worker():
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=2, max_batch_tokens=100),
                     _spec("p1", role="prefill", max_seqs=2, max_batch_tokens=100),
                     _spec("d0", role="decode", max_seqs=100))
        router = Router(pool, "disagg", queue_tokens=1000)
        a = Client(router, "a", "t", tokens=10, max_tokens=4)
        await _settle()
        b = Client(router, "b", "t", tokens=10, max_tokens=4)
        await _settle()
        # a holds one prefill worker, the other is free: b goes there, not to d0
        assert {_placed(pool)[r][0] for r in "ab"} == {"p0", "p1"}
        c = Client(router, "c", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["c"] == ("d0", False)     # now it would wait: d0, empty
        for x in (a, b, c):
            x.task.cancel()
        await asyncio.gather(a.task, b.task, c.task, return_exceptions=True)

    asyncio.run(scenario())


def test_the_decode_worker_takes_the_fair_queues_head_not_a_newcomer():
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=1, max_batch_tokens=1000),
                     _spec("d0", role="decode", max_seqs=100))
        router = Router(pool, "disagg", queue_tokens=600)
        flood = [Client(router, f"f{i}", "flood", tokens=500) for i in range(4)]
        await _settle()
        # f0 on the prefill worker; f1 makes 1000 tokens queued: the decode worker's.
        # f2 and f3 wait at the router (the prefill worker is at its max_seqs).
        placed = _placed(pool)
        assert placed == {"f0": ("p0", True), "f1": ("d0", False)}
        assert router.depth("flood") == 2
        polite = Client(router, "p0", "polite", tokens=20)
        await _settle()
        assert router.depth("polite") == 1
        # The decode worker's prompt is done: the queue's head in fair order goes there,
        # the polite tenant's request before the flood's two.
        _first_token(pool, "f1", "d0")
        await _settle()
        assert _placed(pool)["p0"] == ("d0", False)
        assert router.depth("flood") == 2 and router.depth("polite") == 0
        assert polite.trace.prefill_worker == "d0"
        for c in (*flood, polite):
            c.task.cancel()
        await asyncio.gather(*(c.task for c in (*flood, polite)), return_exceptions=True)
        assert len(router.dispatch) == 0
        assert all(not w.channels and w.pending_prefill_tokens == 0
                   for w in pool.workers.values())

    asyncio.run(scenario())


def test_queue_tokens_apply_only_where_prompts_and_decodes_share_the_router():
    pool = _pool(_spec("p0", role="prefill"), _spec("d0", role="decode"))
    assert Router(pool, "disagg", queue_tokens=10).queue_tokens == 10
    # agg has no prefill side; the decode-KV gate counts every placement against the
    # decode side's KV, which a local prefill would bypass; a front sends decodes on
    assert Router(_pool(_spec("a0")), "agg", queue_tokens=10).queue_tokens == 0
    assert Router(pool, "disagg", queue_tokens=10, decode_kv_gate=True).queue_tokens == 0
    assert Router(pool, "disagg", queue_tokens=10, role="prefill").queue_tokens == 0


def test_queue_tokens_auto_is_on_for_torch_decode_workers_on_a_cpu_without_amx():
    import dataclasses
    from pathlib import Path

    from appliance.config import Config, ConfigError, parse
    from appliance.daemon.setup import CPU_QUEUE_TOKENS, queue_tokens, worker_specs
    from appliance.partitions import discover, plan_partition

    def specs(engine: str, mode: str = "disagg"):
        cfg = Config()
        inv = discover("cpu")
        inv = dataclasses.replace(inv, devices=(dataclasses.replace(inv.devices[0], cores=2),))
        plan = plan_partition(inv, mode=mode, cpu_threads=1 if mode == "agg" else 0)
        return worker_specs(cfg, inv, plan, engine, Path("/m"), [0, 1])

    assert Config().engine.conditional_disagg_queue_tokens == -1       # auto by default
    assert queue_tokens(-1, specs("torch"), amx=False) == CPU_QUEUE_TOKENS
    assert queue_tokens(-1, specs("torch"), amx=True) == 0    # the prefill core keeps up
    assert queue_tokens(-1, specs("sim"), amx=False) == 0  # a simulated GPU's decode is its own
    assert queue_tokens(-1, specs("torch", "agg"), amx=False) == 0
    assert queue_tokens(1536, specs("torch"), amx=True) == 1536   # set: on with AMX too
    assert queue_tokens(0, specs("torch")) == 0        # off, as set
    assert queue_tokens(300, specs("sim")) == 300      # set: wherever
    assert Config().engine.conditional_disagg_prefill_share == 0.5
    with pytest.raises(ConfigError) as err:
        parse("[engine]\nconditional_disagg_prefill_share = 0\n", "t.toml")
    assert "engine.conditional_disagg_prefill_share must be within (0, 1]" in str(err.value)
    assert parse("[engine]\nconditional_disagg_queue_tokens = 0\n",
                 "t.toml").engine.conditional_disagg_queue_tokens == 0
    with pytest.raises(ConfigError) as err:
        parse("[engine]\nconditional_disagg_queue_tokens = -2\n", "t.toml")
    assert "engine.conditional_disagg_queue_tokens must be -1 (auto)" in str(err.value)


def test_a_decode_worker_decodes_between_its_prompts_for_their_share():
    """`prefill_share` 0.5: after a prompt that took it ~0.2 s, the decode worker takes
    no other for ~0.2 s (its decodes run), then the fair queue's head goes to it."""
    async def scenario():
        loop = asyncio.get_running_loop()
        pool = _pool(_spec("p0", role="prefill", max_seqs=1, max_batch_tokens=1000),
                     _spec("d0", role="decode", max_seqs=100))
        router = Router(pool, "disagg", queue_tokens=1, prefill_share=0.5)
        a = Client(router, "a", "t")
        await _settle()
        b = Client(router, "b", "t")
        c = Client(router, "c", "t")
        await _settle()
        # a on the decode worker; b on the prefill worker (the decode worker has one);
        # c waits at the router (the prefill worker is at its max_seqs)
        assert _placed(pool) == {"a": ("d0", False), "b": ("p0", True)}
        await asyncio.sleep(0.2)
        _first_token(pool, "a", "d0")
        t0 = loop.time()
        while "d0" not in router._decodes_until:      # the router reads the token
            assert loop.time() - t0 < 3
            await asyncio.sleep(0)
        # the decode worker's prompt took >= 0.2 s: as long again of decodes only
        until = router._decodes_until["d0"]
        assert until - t0 >= 0.2 - 0.01
        # c waits for exactly that: never placed before it, placed on d0 after it
        while "c" not in _placed(pool):
            assert loop.time() < until + 3, "the decode worker never took the queue's head"
            await asyncio.sleep(0.01)
            if loop.time() < until:
                assert "c" not in _placed(pool) and router.depth("t") == 1
        assert _placed(pool)["c"] == ("d0", False) and loop.time() >= until
        for x in (a, b, c):
            x.task.cancel()
        await asyncio.gather(a.task, b.task, c.task, return_exceptions=True)
        assert all(not w.channels for w in pool.workers.values())

    asyncio.run(scenario())


def _riding(pool: WorkerPool, worker: str, rows: int) -> None:
    """`worker` said in its hello that its own prompts ride on its decode steps while
    fewer than `rows` sequences decode there (`Hello.ride_rows`)."""
    pool.workers[worker].hello = Hello(worker, 1, "decode", "torch", False, ("cpu",), "l", 16,
                                       100, ride_rows=rows)


def _rides(pool: WorkerPool, rid: str) -> bool:
    return next(m.ride for w in pool.workers.values() for m in w._outbox
                if isinstance(m, Prefill) and m.request_id == rid)


def test_a_short_queue_sends_a_prompt_to_ride_on_a_decode_worker_with_rows_to_spare():
    """Under `queue_tokens`, a decode worker whose decode steps would carry a prompt's
    rows (2 of its 4 rows decoding) takes a prompt that would wait behind another on the
    prefill worker, marked to ride, and no pause follows it (its decodes never stopped);
    with its rows taken it takes none; over the threshold a prompt goes to it whole, as
    before, and its decodes then run alone for the prompt's share."""
    async def scenario():
        pool = _pool(_spec("p0", role="prefill", max_seqs=100, max_batch_tokens=100),
                     _spec("d0", role="decode", max_seqs=100))
        _riding(pool, "d0", 4)
        router = Router(pool, "disagg", queue_tokens=35, prefill_share=0.5)
        d0 = pool.workers["d0"]
        d0.open("x")
        d0.open("y")                                # two sequences decode there
        a = Client(router, "a", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool) == {"a": ("p0", True)}         # the prefill worker is free
        b = Client(router, "b", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["b"] == ("d0", False) and _rides(pool, "b")
        _first_token(pool, "b", "d0")
        await _settle()
        assert "d0" not in router._decodes_until           # no pause after a ridden prompt
        d0.open("z")                                # b and z decode too: 4 of 4 rows
        c = Client(router, "c", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["c"] == ("p0", True)           # 20 queued: under 35, no rows
        e = Client(router, "e", "t", tokens=10, max_tokens=4)
        await _settle()
        assert _placed(pool)["e"] == ("p0", True)           # a, c, e: 30, under 35
        f = Client(router, "f", "t", tokens=10, max_tokens=4)
        await _settle()
        # 40 >= 35: the decode worker takes f whole, whatever its rows
        assert _placed(pool)["f"] == ("d0", False) and not _rides(pool, "f")
        _first_token(pool, "f", "d0")
        t0 = asyncio.get_running_loop().time()
        while "d0" not in router._decodes_until:            # a whole prompt: a pause
            assert asyncio.get_running_loop().time() - t0 < 3, "no pause after f"
            await asyncio.sleep(0)
        for x in (a, b, c, e, f):
            x.task.cancel()
        await asyncio.gather(*(x.task for x in (a, b, c, e, f)), return_exceptions=True)
        for rid in "xyz":
            d0.close(rid)
        assert all(not w.channels and w.pending_prefill_tokens == 0
                   for w in pool.workers.values())

    asyncio.run(scenario())
