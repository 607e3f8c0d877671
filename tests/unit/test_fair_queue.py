"""The fair queue itself (`engines.fair_queue`), the engine scheduler's fair prefill
steps, and the router's per-tenant concurrency gate (`daemon.fairness`)."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from appliance.config import ConfigError, TenantConfig, parse
from appliance.daemon.fairness import TenantGate
from appliance.engines.block_manager import BlockManager
from appliance.engines.fair_queue import FairQueue, VirtualClock, chunk_for_step_time
from appliance.engines.messages import SamplingParams
from appliance.engines.roofline import DeviceShape, StepTimeModel
from appliance.engines.scheduler import SHARED_WINDOW_S, Batch, Scheduler
from appliance.engines.sequence import Role, Sequence
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import H100_SXM

BS = 4
_tok = itertools.count(1000)


# ---- the queue ------------------------------------------------------------------------

def test_one_tenant_is_first_in_first_out():
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push(f"r{i}", "a")
    assert [q.pop() for _ in range(5)] == [f"r{i}" for i in range(5)]
    with pytest.raises(IndexError):
        q.pop()


def test_service_is_shared_by_weight_not_by_arrival():
    """A floods 30 requests before B's 10 arrive; B has weight 2. Charging one per pop,
    B gets two of every three turns while both wait, whatever the arrival order."""
    q: FairQueue[str] = FairQueue()
    for i in range(30):
        q.push(f"a{i}", "a", weight=1.0)
    for i in range(10):
        q.push(f"b{i}", "b", weight=2.0)
    served = []
    for _ in range(15):
        item = q.pop()
        served.append(item[0])
        q.charge(item[0], 1.0)
    assert served.count("b") == 10 and served.count("a") == 5
    assert served[0] == "b"          # the newcomer starts at the clock, not behind A's queue
    assert q.peek() == "a5" and len(q) == 25


def test_an_idle_tenant_banks_no_credit():
    """B served alone for a long while, then A arrives: A starts at the clock, so it
    alternates with B instead of getting B's whole history as a head start."""
    q: FairQueue[str] = FairQueue()
    for i in range(100):
        q.push(f"b{i}", "b")
    for _ in range(50):
        q.pop()
        q.charge("b", 1.0)
    for i in range(10):
        q.push(f"a{i}", "a")
    served = []
    for _ in range(10):
        item = q.pop()
        served.append(item[0])
        q.charge(item[0], 1.0)
    assert served.count("a") in (5, 6)           # it joins at the clock: one turn's lead at most


def test_priority_classes_come_first_and_remove_works():
    q: FairQueue[str] = FairQueue()
    q.push("low", "a", priority=5)
    q.push("x", "b", priority=0)
    q.push("urgent", "a", priority=-1)
    q.remove("x")
    assert [q.pop(), q.pop()] == ["urgent", "low"] and not q
    with pytest.raises(ValueError):
        q.remove("x")


def test_virtual_clock_charges_cost_over_weight():
    clock = VirtualClock()
    clock.join("a")
    clock.charge("a", 4.0, 100)
    assert clock.time("a") == 25.0
    clock.join("b")                      # b starts at the clock: a's last start, 0
    assert clock.time("b") == 0.0


def test_the_chunk_is_the_one_whose_step_takes_the_target_time():
    """70B fp8 on one H100 by the roofline: ~50 ms steps at a few hundred tokens, well
    below the 8,192-token budget; a step of the chosen chunk is <= 50 ms, one block
    more is over."""
    timing = StepTimeModel(DeviceShape.from_gpu(H100_SXM, 1.0), 1,
                           lookup_model_spec("llama-3.1-70b-fp8"))
    step = lambda n: timing.prefill_s([n], [0])        # noqa: E731
    chunk = chunk_for_step_time(step, 0.05, align=16, lo=16, hi=8192)
    assert 16 < chunk < 8192 and chunk % 16 == 0
    assert step(chunk) <= 0.05 < step(chunk + 16)
    assert chunk_for_step_time(lambda n: 1e-6 * n, 0.05, hi=8192) == 8192     # all fits
    assert chunk_for_step_time(lambda n: 1.0, 0.05, lo=16) == 16              # nothing does


# ---- the engine scheduler ----------------------------------------------------------------

def sq(rid: str, n: int, tenant: str, weight: float = 1.0, priority: int = 0,
       start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=4), Role.FULL,
                    tenant=tenant, weight=weight, priority=priority)


def run(sched: Scheduler, batch: Batch) -> None:
    for i, s in enumerate(batch.seqs):
        if i < batch.num_prefill and s.step_tokens < s.uncached:
            s.num_cached += s.step_tokens
        else:
            s.num_cached = len(s.tokens)
            s.tokens.append(next(_tok))
        sched.blocks.commit(s)


def shape(batch: Batch) -> list[tuple[str, int]]:
    return [(s.request_id, s.step_tokens) for s in batch.seqs[:batch.num_prefill]]


def test_a_short_prompt_goes_into_the_next_step_ahead_of_a_flood():
    """Unchunked, budget 64: the flood's 40-token prompts queue first. Alone, the
    flood runs whole prompts; once the polite tenant's 4-token prompt waits, the step
    shrinks to the fair chunk (16), the polite prompt goes into the very next step and
    the flood's prompt under way is chunked around it."""
    sched = Scheduler(BlockManager(256, BS, 0.0), 64, 32, fair_chunk_tokens=16)
    for i in range(6):
        sched.add(sq(f"f{i}", 40, "flood", start=100 * i))
    first = sched.schedule()
    assert shape(first) == [("f0", 40)]                 # one tenant: as before
    run(sched, first)
    sched.add(sq("p0", 4, "polite", start=5000))
    second = sched.schedule()
    assert ("p0", 4) in shape(second)
    assert sum(n for _, n in shape(second)) <= 16       # behind at most one chunk
    run(sched, second)
    assert next(s for s in second.seqs if s.request_id == "p0").num_output == 1
    # The polite tenant gone, the box still counts as shared for SHARED_WINDOW_S of
    # arrivals: steps stay one chunk, so its next prompt waits behind one chunk at most.
    steps = []
    while sched.waiting or sched.prefilling:
        b = sched.schedule()
        steps.append(shape(b))
        run(sched, b)
    assert all(sum(n for _, n in s) <= 16 for s in steps) and steps[-1][-1][0] == "f5"
    assert sched.shared
    # Flood prompts arriving a window later: one tenant again, whole prompts per step.
    later = sq("f6", 40, "flood", start=9000)
    later.arrival = SHARED_WINDOW_S + 1
    sched.add(later)
    assert not sched.shared and shape(sched.schedule()) == [("f6", 40)]


def test_contending_tenants_share_prefill_tokens_by_weight():
    """Two tenants with long queues, weights 3 and 1: over many steps the prompt tokens
    prefilled go 3:1 (within a chunk), though B's prompts all arrived first."""
    sched = Scheduler(BlockManager(4096, BS, 0.0), 64, 256, fair_chunk_tokens=32)
    for i in range(40):
        sched.add(sq(f"b{i}", 24, "b", weight=1.0, start=1000 * i))
    for i in range(40):
        sched.add(sq(f"a{i}", 24, "a", weight=3.0, start=100000 + 1000 * i))
    served = {"a": 0, "b": 0}
    for _ in range(30):
        b = sched.schedule()
        assert sum(n for _, n in shape(b)) <= 32
        for s, n in zip(b.seqs, (n for _, n in shape(b))):
            served[s.tenant] += n
        run(sched, b)
    assert served["a"] / served["b"] == pytest.approx(3.0, rel=0.1)


def test_a_better_priority_class_goes_first_and_the_tenant_count_is_kept():
    sched = Scheduler(BlockManager(256, BS, 0.0), 64, 32, fair_chunk_tokens=64)
    late = sq("late", 8, "a", priority=1, start=100)
    urgent = sq("urgent", 8, "b", priority=-1, start=200)
    sched.add(late)
    sched.add(urgent)
    b = sched.schedule()
    assert [s.request_id for s in b.seqs] == ["urgent", "late"]
    run(sched, b)
    for s in (late, urgent):
        sched.remove(s)
        sched.blocks.free(s)
    assert not sched._classes and not sched.clock.vt


def test_fair_queuing_off_keeps_arrival_order():
    sched = Scheduler(BlockManager(256, BS, 0.0), 16, 32, fair_chunk_tokens=8, fair=False)
    for i in range(3):
        sched.add(sq(f"f{i}", 16, "flood", start=100 * i))
    sched.add(sq("p", 4, "polite", start=5000))
    order = []
    while sched.waiting:
        b = sched.schedule()
        order += shape(b)
        run(sched, b)
    assert order == [("f0", 16), ("f1", 16), ("f2", 16), ("p", 4)]


# ---- the router's gate -----------------------------------------------------------------

def test_tenant_config_parses_and_refuses_bad_values():
    cfg = parse('[tenants.search]\nweight = 3\nmax_concurrent = 2\n[tenants.default]\npriority = 1\n')
    assert cfg.tenants == {"search": TenantConfig(weight=3.0, max_concurrent=2),
                           "default": TenantConfig(priority=1)}
    with pytest.raises(ConfigError, match="tenants.x.weight must be positive"):
        parse("[tenants.x]\nweight = 0\n")
    with pytest.raises(ConfigError, match="unknown key tenants.x.wieght"):
        parse("[tenants.x]\nwieght = 2\n")


def test_the_gate_holds_requests_over_max_concurrent_and_lets_the_best_class_go_first():
    async def scenario():
        gate = TenantGate({"a": TenantConfig(max_concurrent=1, priority=0)})
        first = gate.share("a")
        await gate.acquire(first)
        order = []

        async def req(name, priority):
            share = gate.share("a", priority)
            await gate.acquire(share)
            order.append(name)
            await asyncio.sleep(0)
            gate.release("a")

        tasks = [asyncio.create_task(req("batchy", 5)), asyncio.create_task(req("normal", None))]
        gone = asyncio.create_task(req("gone", 2))
        await asyncio.sleep(0.01)
        assert gate.depth("a") == 3 and order == []           # waiting, not refused
        gone.cancel()
        await asyncio.sleep(0.01)
        assert gate.depth("a") == 2
        gate.release("a")
        await asyncio.gather(*tasks)
        assert order == ["normal", "batchy"]
        assert gate.inflight == {} and gate.depth("a") == 0
        # A request may lower its standing, not raise it above its tenant's class.
        assert gate.share("a", -5).priority == 0 and gate.share("a", 3).priority == 3
        # Unnamed tenants: [tenants.default] if any, else unlimited with weight 1.
        assert gate.share("other").max_concurrent == 0
        assert TenantGate({"default": TenantConfig(max_concurrent=3)}).share("x").max_concurrent == 3
        assert TenantGate({}).share("x").weight == 1.0
    asyncio.run(scenario())


class _FakeAggWorker:
    """The router's view of one aggregated worker (fake at the process boundary only):
    records what is sent and answers each Prefill with one finishing token."""

    def __init__(self):
        from appliance.daemon.workers import Channel
        self._channel = Channel
        self.id, self.role, self.ready = "agg0", "agg", True
        self.pending_prefill_tokens = self.inflight = 0
        self.ride_next = False
        self.channels, self.sent = {}, []

    def open(self, rid):
        self.channels[rid] = self._channel()
        self.inflight += 1
        return self.channels[rid]

    def close(self, rid):
        if self.channels.pop(rid, None) is not None:
            self.inflight -= 1

    def send(self, msg):
        from appliance.engines.messages import Prefill, Tokens
        self.sent.append(msg)
        if isinstance(msg, Prefill):
            self.channels[msg.request_id].put(Tokens(msg.request_id, [7], "stop"))


def test_the_router_sends_the_tenants_share_with_the_request_and_the_engine_keeps_it():
    import pickle
    from types import SimpleNamespace
    from appliance.daemon.router import Router, Trace
    from appliance.engines.messages import Prefill
    worker = _FakeAggWorker()
    pool = SimpleNamespace(workers={"agg0": worker}, ready_listeners=[], death_listeners=[])
    router = Router(pool, "agg", 0, {"search": TenantConfig(weight=3.0, priority=1)})

    async def ask(tenant, priority):
        out = []
        async for tokens, reason, _ in router.generate(Trace("r-" + tenant, 0.0), [1, 2, 3],
                                                       SamplingParams(max_tokens=2),
                                                       tenant, priority):
            out += tokens
        return out

    assert asyncio.run(ask("search", 4)) == [7]
    asyncio.run(ask("other", None))
    first, second = worker.sent
    assert (first.tenant, first.weight, first.priority) == ("search", 3.0, 4)
    assert (second.tenant, second.weight, second.priority) == ("other", 1.0, 0)
    assert router.gate.inflight == {}
    # Across the process boundary and into the engine's sequence.
    wire = pickle.loads(pickle.dumps(first))
    assert isinstance(wire, Prefill) and (wire.tenant, wire.weight, wire.priority) == ("search", 3.0, 4)
    from appliance.engines.sim import SimEngine
    timing = StepTimeModel(DeviceShape.from_gpu(H100_SXM, 1.0), 1,
                           lookup_model_spec("llama-3.1-70b-fp8"))
    eng = SimEngine(timing=timing, vocab_ids=list(range(100, 200)), speed=1e6, worker="w",
                    devices=("sim0",), num_blocks=4096, block_size=16, max_batch_tokens=8192,
                    max_seqs=64, max_context=8192)
    assert eng.add(wire) == []
    seq = eng.scheduler.waiting[0]
    assert (seq.tenant, seq.weight, seq.priority) == ("search", 3.0, 4)
    # The simulator's fair chunk: the ~50 ms step of this device and model.
    assert eng.scheduler.fair_chunk_tokens == chunk_for_step_time(
        lambda n: timing.prefill_s([n], [0]), align=16, lo=16, hi=8192)


def test_a_request_priority_is_parsed_and_bad_values_are_a_400():
    from appliance.daemon.api_error import ApiError
    from appliance.daemon.openai_protocol import parse_body
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": 3}'
    assert parse_body(body, "chat").priority == 3
    assert parse_body(body.replace(b', "priority": 3', b""), "chat").priority is None
    for bad in (b'"high"', b"1.5", str(1 << 40).encode()):
        with pytest.raises(ApiError) as err:
            parse_body(body.replace(b"3}", bad + b"}"), "chat")
        assert err.value.status == 400 and "priority" in str(err.value.message)


def test_a_torch_worker_takes_its_fair_chunk_from_the_measured_profile(tiny_model, tmp_path):
    """`applianced profile` measured this model on the CPU: each torch worker's chunk is
    the ~50 ms step of that profile; without a profile, 0 (the engine's own default)."""
    from appliance.config import Config
    from appliance.daemon.setup import measured_profiles, worker_specs
    from appliance.models.specs import spec_from_hf_config
    from appliance.partitions import discover, plan_partition
    from appliance.planner.profiles import Profile, save_profile
    inv = discover("cpu")
    plan = plan_partition(inv)
    cfg = Config()
    assert all(s.fair_chunk_tokens == 0 for s in worker_specs(
        cfg, inv, plan, "torch", tiny_model,
        profiles=measured_profiles(cfg, inv, plan, "torch", tiny_model, tmp_path)))
    name = spec_from_hf_config(tiny_model / "config.json").name
    save_profile(Profile(model=name, device="cpu", tp=1, source="measured", created=1.0,
                         prefill=[[t, 0.002 + t / 10000] for t in (16, 64, 256, 1024, 4096)],
                         decode=[[1, 100, 0.01], [1, 1000, 0.02], [4, 100, 0.03],
                                 [4, 1000, 0.05]], kv_capacity_tokens=1000), tmp_path)
    profiles = measured_profiles(cfg, inv, plan, "torch", tiny_model, tmp_path)
    specs = worker_specs(cfg, inv, plan, "torch", tiny_model, profiles=profiles)
    # 2 ms + 0.1 ms a token: 480 tokens take 50 ms.
    assert {s.fair_chunk_tokens for s in specs} == {480}
    assert measured_profiles(cfg, inv, plan, "sim", tiny_model, tmp_path) == {}
