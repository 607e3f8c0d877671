"""A discrete-event simulation of a box's workers: the real simulator engine on a
virtual clock, routed by the daemon's own policy.

What runs is the engine code the daemon runs: `SimEngine`/`BatchEngine` with the real
`Scheduler` and `BlockManager`, sized as `worker/engine_factory` sizes a `sim` worker
(KV pool from `StepTimeModel.kv_capacity_tokens`, the engine config's block size, token
budget, max_seqs, reserve ratio). Only `_sleep` differs: it adds the roofline's step
time to a counter, and `VirtualCluster` turns those durations into a discrete-event
schedule, so an hour of trace replays in seconds and the result does not depend on the
machine:

- every worker has its own clock; it starts a step when it is free and has work, and
  the events of the step (tokens, PrefillDone, KvImported) happen when the step ends;
- which worker gets a request is `appliance.routing`, the policy the daemon's router
  applies: prefill / agg by fewest queued prompt tokens then fewest in flight; disagg's
  first token to the decode worker with the most free KV less blocks in flight;
  round-robin ties. The decode worker admits it in its own `kv_import` step
  (`import_kv` -> `StepTimeModel.transfer_s`, so the transfer occupies the decode worker
  as in the sim engine); KvImported frees the prefill worker's blocks.

Who drives it: `planner/replay.py` open-loop from a trace's arrival times,
`bench/bench_disagg_sim.py` closed-loop.
"""
from __future__ import annotations

import heapq
import itertools
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

from appliance.config import EngineConfig
from appliance.engines.messages import (
    Decode, IterationRecord, KvImported, Prefill, PrefillDone, RequestFailed, SamplingParams,
    Tokens,
)
from appliance.engines.roofline import DeviceShape, StepTimeModel
from appliance.engines.sim import SimEngine
from appliance.routing import Rotation, least_queued, most_free

VOCAB = list(range(1000, 33000))   # token ids the sim engine samples from (values are irrelevant)

# ---- the virtual-clock engine -------------------------------------------------------

class VirtualSimEngine(SimEngine):
    """The real SimEngine; `_sleep` advances a counter instead of the wall clock."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.elapsed = 0.0

    def _sleep(self, seconds: float) -> None:
        self.elapsed += seconds


def build_engine(worker: str, timing: StepTimeModel, engine: EngineConfig,
                 devices: tuple[str, ...] = (), chunk: int | None = None) -> VirtualSimEngine:
    """As engine_factory._build_sim builds a `sim` worker."""
    num_blocks = timing.kv_capacity_tokens(engine.gpu_mem_fraction) // engine.block_size
    return VirtualSimEngine(
        timing=timing, vocab_ids=VOCAB, speed=1.0, worker=worker,
        devices=devices or tuple(f"sim{i}" for i in range(timing.tp)), num_blocks=num_blocks,
        block_size=engine.block_size, max_batch_tokens=engine.max_batch_tokens,
        max_seqs=engine.max_seqs, max_context=timing.model.max_context,
        eos_token_ids=(), handoff_timeout_s=1e9, reserve_ratio=engine.reserve_ratio,
        prefill_chunk_tokens=engine.prefill_chunk_tokens if chunk is None else chunk)


@dataclass
class Worker:
    name: str
    role: str
    tp: int
    engine: VirtualSimEngine
    free_at: float = 0.0
    blocked: bool = False          # stepped and could schedule nothing: wait for a message
    pending_prefill_tokens: int = 0
    inflight: int = 0
    pending_kv_blocks: int = 0
    steps: list = field(default_factory=list)      # (start, end, phase) in virtual seconds
    decode_steps: int = 0
    decode_seqs: int = 0
    max_batch_tokens: int = 0      # the prefill token budget this worker's scheduler has
    prefill_steps: int = 0
    prefill_prompts: int = 0       # prompts over all prefill steps
    multi_prompt_steps: int = 0    # prefill steps that batched more than one prompt
    multi_prompt_max_tokens: int = 0   # the most tokens such a step batched (<= the budget)


@dataclass
class Req:
    rid: str
    sent: float
    prompt_len: int
    osl: int
    user: int = 0
    first: float | None = None
    done: float | None = None
    out: int = 0
    prefill_worker: Worker | None = None
    decode_worker: Worker | None = None
    pending: int = 0
    prompt: list = field(default_factory=list)
    params: SamplingParams | None = None


class VirtualCluster(ABC):
    """Workers on one virtual clock, routed as the daemon routes. Subclasses decide when
    requests arrive (`arrive`, `on_finish`, the initial heap), when the run is over
    (`done`) and what to measure."""

    def __init__(self, workers: list[Worker], mode: str, seed: int = 0):
        self.mode = mode
        self.rng = random.Random(seed)
        self.workers = workers
        self.by_name = {w.name: w for w in self.workers}
        self.front = [w for w in self.workers if w.role in ("agg", "prefill")]
        self.decoders = [w for w in self.workers if w.role == "decode"]
        self.rotation = Rotation()
        self.heap: list = []
        self.seq = itertools.count()
        self.reqs: dict[str, Req] = {}
        self.finished: list[Req] = []
        self.n_sent = 0
        # A shared prompt body; the first token is unique per request, and the prefix
        # cache hashes blocks as a chain, so no block of any prompt is ever a cache hit.
        self.body: list[int] = []

    # -- routing: the daemon router's own policy (appliance.routing) -------------------
    def _least_queued(self) -> Worker:
        return least_queued(self.rotation.rotate(self.front, "front"))

    def _most_free(self) -> Worker:
        return most_free(self.rotation.rotate(self.decoders, "decode"),
                         lambda w: w.engine.blocks.num_free - w.pending_kv_blocks)

    # -- events -----------------------------------------------------------------------
    def _deliver(self, w: Worker, msg) -> None:
        for ev in w.engine.add(msg):
            raise RuntimeError(f"{w.name} refused {msg.request_id}: {ev}")
        w.blocked = False

    def _prompt(self, n: int) -> list[int]:
        if len(self.body) < n - 1:
            self.body += [self.rng.randrange(1000, 33000) for _ in range(n - 1 - len(self.body))]
        return [self.n_sent] + self.body[:n - 1]

    def send(self, now: float, prompt_len: int, osl: int, user: int = 0) -> Req:
        rid = f"r{self.n_sent}"
        self.n_sent += 1
        req = Req(rid, now, prompt_len, osl, user)
        req.params = SamplingParams(max_tokens=osl, ignore_eos=True, seed=None)
        self.reqs[rid] = req
        w = self._least_queued()
        req.prefill_worker = w
        w.pending_prefill_tokens += prompt_len
        w.inflight += 1
        req.prompt = self._prompt(prompt_len)
        self._deliver(w, Prefill(rid, req.prompt, req.params, handoff=self.mode == "disagg"))
        return req

    def _first_token(self, req: Req, now: float) -> None:
        req.first = now
        req.out = 1
        req.prefill_worker.pending_prefill_tokens -= req.prompt_len
        self.on_token(req, now, 1)

    def _finish(self, req: Req, now: float) -> None:
        req.done = now
        req.prompt = []
        del self.reqs[req.rid]
        self.finished.append(req)
        self.on_finish(req, now)

    def on_token(self, req: Req, now: float, n: int) -> None:
        pass

    def on_finish(self, req: Req, now: float) -> None:
        pass

    def handle(self, w: Worker, events: list, now: float) -> None:
        for ev in events:
            if isinstance(ev, Tokens):
                req = self.reqs[ev.request_id]
                if req.first is None:
                    self._first_token(req, now)
                else:
                    req.out += len(ev.tokens)
                    self.on_token(req, now, len(ev.tokens))
                if ev.finish_reason is not None:
                    w.inflight -= 1
                    assert req.out == req.osl, (req.out, ev.finish_reason)
                    self._finish(req, now)
            elif isinstance(ev, PrefillDone):
                req = self.reqs[ev.request_id]
                self._first_token(req, now)
                w.inflight -= 1
                if ev.handle is None:
                    self._finish(req, now)
                    continue
                dw = self._most_free()
                req.decode_worker = dw
                req.pending = len(ev.handle.block_ids) + 1
                dw.pending_kv_blocks += req.pending
                dw.inflight += 1
                self._deliver(dw, Decode(req.rid, req.prompt, ev.first_token, req.params, ev.handle))
            elif isinstance(ev, KvImported):
                req = self.reqs[ev.request_id]
                src = self.by_name[ev.source_worker]
                src.engine.release(ev.request_id)
                src.blocked = False
                w.pending_kv_blocks -= req.pending
                req.pending = 0
            elif isinstance(ev, RequestFailed):
                raise RuntimeError(f"{w.name}: {ev}")

    def step(self, w: Worker, now: float) -> None:
        eng = w.engine
        before, preempt = eng.elapsed, eng.scheduler.preemptions
        events = eng.step()
        d = eng.elapsed - before
        if d <= 0.0:
            if eng.scheduler.preemptions == preempt:
                w.blocked = True        # nothing admissible until a message arrives
            return
        rec = next(e for e in events if isinstance(e, IterationRecord))
        w.steps.append((now, now + d, rec.phase))
        if rec.phase == "prefill":
            w.prefill_steps += 1
            w.prefill_prompts += len(rec.entries)
            if len(rec.entries) > 1:
                w.multi_prompt_steps += 1
                w.multi_prompt_max_tokens = max(w.multi_prompt_max_tokens,
                                                sum(e[1] for e in rec.entries))
        if rec.phase in ("decode", "mixed"):
            decoding = self.decoding_entries(rec)
            if decoding:
                w.decode_steps += 1
                w.decode_seqs += len(decoding)
        w.free_at = now + d
        heapq.heappush(self.heap, (now + d, next(self.seq), w, events))

    def decoding_entries(self, rec: IterationRecord) -> list:
        """Decoding sequences of a step: all of a decode step; in a mixed one (chunked
        prefill), those past their prompt."""
        if rec.phase == "decode":
            return rec.entries
        return [e for e in rec.entries if e[0] in self.reqs
                and e[2] > self.reqs[e[0]].prompt_len]

    @abstractmethod
    def arrive(self, payload, t: float) -> None:
        """An arrival scheduled on the heap with worker None."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the run is over (every request the subclass tracks has finished)."""

    def run_loop(self) -> float:
        """Run until `done()`; returns the virtual time it ended."""
        now = self.now = 0.0
        while True:
            while self.heap and self.heap[0][0] <= now:
                t, _, w, payload = heapq.heappop(self.heap)
                if w is None:
                    self.arrive(payload, t)
                else:
                    self.handle(w, payload, t)
            self.now = now
            if self.done():
                return now
            for w in self.workers:
                if not w.blocked and w.free_at <= now and w.engine.has_work():
                    self.step(w, now)
            nxt = [self.heap[0][0]] if self.heap else []
            nxt += [w.free_at for w in self.workers
                    if w.free_at > now and not w.blocked and w.engine.has_work()]
            if not nxt:
                raise RuntimeError("simulation stalled: no events and no runnable worker")
            now = min(nxt)


# ---- building a cluster for a box ---------------------------------------------------

@dataclass(frozen=True)
class WorkerShape:
    name: str
    role: str
    gpu: object          # GpuSpec
    tp: int
    devices: tuple[str, ...]


def box_workers(devices: str, split: str, tp: int, mode: str = "disagg") -> list[WorkerShape]:
    """The workers the daemon's partition planner would start on `devices`."""
    from appliance.partitions import discover, plan_partition
    inv = discover(devices)
    plan = plan_partition(inv, tp=tp, split=split, mode=mode)
    by_id = {d.id: d for d in inv.devices}
    out = []
    for slot in plan.workers():
        spec = by_id[slot.devices[0]].spec
        if spec is None:
            raise ValueError(f"replay needs catalogue GPUs (sim:...), got {devices!r}")
        out.append(WorkerShape(slot.worker, slot.role, spec, tp, slot.devices))
    return out


def timing_for(model, gpu, tp: int) -> StepTimeModel:
    return StepTimeModel(DeviceShape.from_gpu(gpu, model.weight_bytes), tp, model)


def batch_budget(model, gpu, tp: int, engine: EngineConfig) -> int:
    """The prefill token budget a `sim` worker on `gpu` runs with: the configured
    `engine.max_batch_tokens`, or with 0 (auto) the knee of the device's roofline
    profile, as the daemon resolves it at start-up (`planner/tuning.py`)."""
    if engine.max_batch_tokens > 0:
        return engine.max_batch_tokens
    from appliance.planner.tuning import token_budget
    return token_budget(model, gpu, tp, None, mem_fraction=engine.gpu_mem_fraction).tokens


def build_workers(shapes: list[WorkerShape], model, engine: EngineConfig) -> list[Worker]:
    workers = []
    for s in shapes:
        timing = timing_for(model, s.gpu, s.tp)
        if timing.kv_capacity_tokens(engine.gpu_mem_fraction) < engine.block_size:
            raise ValueError(f"{model.name} does not fit {s.tp}x {s.gpu.name} with room for KV "
                             f"(weights {model.weight_total_bytes() / 1e9:.0f} GB); "
                             "use a larger tp or an fp8 model spec")
        budget = batch_budget(model, s.gpu, s.tp, engine)
        eng = build_engine(s.name, timing, replace(engine, max_batch_tokens=budget), s.devices)
        workers.append(Worker(s.name, s.role, s.tp, eng, max_batch_tokens=budget))
    return workers

