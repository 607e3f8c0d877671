"""Replay a request trace through the real simulator engine on a virtual clock.

What runs is the engine code the daemon runs: `SimEngine`/`BatchEngine` with the real
`Scheduler` and `BlockManager`, sized as `worker/engine_factory` sizes a `sim` worker
(KV pool from `StepTimeModel.kv_capacity_tokens`, the engine config's block size, token
budget, max_seqs, reserve ratio). Only `_sleep` differs: it adds the roofline's step
time to a counter, and `VirtualCluster` turns those durations into a discrete-event
schedule, so an hour of trace replays in seconds and the result does not depend on the
machine:

- every worker has its own clock; it starts a step when it is free and has work, and
  the events of the step (tokens, PrefillDone, KvImported) happen when the step ends;
- disagg: the first token goes to the decode worker chosen as the daemon's router does
  (most free KV less blocks in flight, round-robin ties), which admits it in its own
  `kv_import` step (`import_kv` -> `StepTimeModel.transfer_s`, so the transfer occupies
  the decode worker as in the sim engine); KvImported frees the prefill worker's blocks;
- prefill / agg worker choice: fewest queued prompt tokens, then fewest in flight,
  round-robin ties (the router's `_least_queued`).

`bench/bench_disagg_sim.py` drives the same cluster closed-loop; `TraceReplay` here
drives it open-loop from a trace's arrival times (Azure LLM trace format).
"""
from __future__ import annotations

import csv
import heapq
import itertools
import random
import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from appliance.config import EngineConfig
from appliance.engines.messages import (
    Decode, IterationRecord, KvImported, Prefill, PrefillDone, RequestFailed, SamplingParams,
    Tokens,
)
from appliance.engines.roofline import DeviceShape, StepTimeModel
from appliance.engines.sim import SimEngine
from appliance.percentiles import percentile

VOCAB = list(range(1000, 33000))   # token ids the sim engine samples from (values are irrelevant)


# ---- traces -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float            # seconds since the trace's first request
    prompt: int         # ContextTokens
    output: int         # GeneratedTokens


def load_azure_trace(path: str | Path, start: int = 0, count: int | None = None) -> list[TraceRequest]:
    """Rows of an Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens),
    times made relative to the first kept row. A malformed file is one ValueError line."""
    path = Path(path)
    rows = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
            if not reader.fieldnames or not need <= set(reader.fieldnames):
                raise ValueError(f"{path}: not an Azure LLM trace (needs columns "
                                 f"{', '.join(sorted(need))}; has {reader.fieldnames})")
            for line, row in enumerate(reader, start=2):
                try:
                    ts = row["TIMESTAMP"].strip()
                    t = datetime.strptime(ts[:26], "%Y-%m-%d %H:%M:%S.%f" if "." in ts
                                          else "%Y-%m-%d %H:%M:%S").timestamp()
                    p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                except (ValueError, TypeError, AttributeError):
                    raise ValueError(f"{path}:{line}: malformed row {dict(row)}") from None
                if p < 0 or o < 0:
                    raise ValueError(f"{path}:{line}: negative token count")
                rows.append((t, p, o))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    rows.sort()
    rows = rows[start:start + count if count is not None else None]
    if not rows:
        raise ValueError(f"{path}: no requests in the selected rows")
    t0 = rows[0][0]
    return [TraceRequest(t - t0, p, o) for t, p, o in rows]


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
        self.turns = {"front": itertools.count(), "decode": itertools.count()}
        self.heap: list = []
        self.seq = itertools.count()
        self.reqs: dict[str, Req] = {}
        self.finished: list[Req] = []
        self.n_sent = 0
        # A shared prompt body; the first token is unique per request, and the prefix
        # cache hashes blocks as a chain, so no block of any prompt is ever a cache hit.
        self.body: list[int] = []

    # -- routing, as appliance.daemon.router does it ---------------------------------
    def _rotated(self, workers: list[Worker], key: str) -> list[Worker]:
        k = next(self.turns[key]) % len(workers)
        return workers[k:] + workers[:k]

    def _least_queued(self) -> Worker:
        return min(self._rotated(self.front, "front"),
                   key=lambda w: (w.pending_prefill_tokens, w.inflight))

    def _most_free(self) -> Worker:
        return max(self._rotated(self.decoders, "decode"),
                   key=lambda w: (w.engine.blocks.num_free - w.pending_kv_blocks, -w.inflight))

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


# ---- open-loop trace replay -----------------------------------------------------------

@dataclass
class ReplayResult:
    split: str
    requests: int
    virtual_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    itl_mean_s: float | None
    ttft_slo_met: float | None      # share of requests with TTFT ≤ SLO
    itl_slo_met: float | None
    busy_share: dict
    preemptions: int
    meets_slo: bool | None          # p90 TTFT and p90 ITL within the SLOs
    max_batch_tokens: int = 0       # the prefill workers' token budget
    prefill_batching: dict = field(default_factory=dict)   # what the budget did to the steps

    def to_json(self) -> dict:
        from dataclasses import asdict
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class TraceReplay(VirtualCluster):
    """Open loop: each trace request arrives at its own time, whatever came before."""

    def __init__(self, workers: list[Worker], mode: str, trace: list[TraceRequest],
                 max_prompt: int, seed: int = 0):
        super().__init__(workers, mode, seed)
        self.trace = trace
        self.max_prompt = max_prompt
        for i, r in enumerate(trace):
            heapq.heappush(self.heap, (r.t, next(self.seq), None, i))

    def arrive(self, i: int, t: float) -> None:
        r = self.trace[i]
        osl = max(1, r.output)
        prompt = max(1, min(r.prompt, self.max_prompt - osl - 1))
        self.send(t, prompt, osl)

    def done(self) -> bool:
        return len(self.finished) == len(self.trace)

    def result(self, split: str, end: float, ttft_slo: float | None = None,
               itl_slo: float | None = None) -> ReplayResult:
        ttft = [r.first - r.sent for r in self.finished]
        itl = [(r.done - r.first) / (r.osl - 1) for r in self.finished if r.osl > 1]
        busy = {}
        for role in sorted({w.role for w in self.workers}):
            ws = [w for w in self.workers if w.role == role]
            busy[role] = round(sum(b - a for w in ws for a, b, _ in w.steps) / (len(ws) * end), 4) \
                if end > 0 else 0.0
        tp90, ip90 = percentile(ttft, 0.9), percentile(itl, 0.9)
        front = [w for w in self.workers if w.role in ("prefill", "agg")]
        meets = None
        if ttft_slo is not None and itl_slo is not None:
            meets = (tp90 is None or tp90 <= ttft_slo) and (ip90 is None or ip90 <= itl_slo)
        return ReplayResult(
            split=split, requests=len(self.finished), virtual_s=end,
            ttft_p50_s=percentile(ttft, 0.5), ttft_p90_s=tp90, ttft_p99_s=percentile(ttft, 0.99),
            ttft_mean_s=statistics.fmean(ttft) if ttft else None,
            itl_p50_s=percentile(itl, 0.5), itl_p90_s=ip90, itl_p99_s=percentile(itl, 0.99),
            itl_mean_s=statistics.fmean(itl) if itl else None,
            ttft_slo_met=(sum(x <= ttft_slo for x in ttft) / len(ttft)) if ttft and ttft_slo else None,
            itl_slo_met=(sum(x <= itl_slo for x in itl) / len(itl)) if itl and itl_slo else None,
            busy_share=busy, preemptions=sum(w.engine.scheduler.preemptions for w in self.workers),
            meets_slo=meets, max_batch_tokens=max((w.max_batch_tokens for w in front), default=0),
            prefill_batching={
                "steps": sum(w.prefill_steps for w in front),
                "prompts_per_step": round(sum(w.prefill_prompts for w in front)
                                          / max(1, sum(w.prefill_steps for w in front)), 4),
                "multi_prompt_steps": sum(w.multi_prompt_steps for w in front),
                "multi_prompt_max_tokens": max((w.multi_prompt_max_tokens for w in front),
                                               default=0)})


def replay_trace(trace: list[TraceRequest], model, devices: str, split: str, tp: int = 1,
                 engine: EngineConfig | None = None, ttft_slo: float | None = None,
                 itl_slo: float | None = None, seed: int = 0) -> ReplayResult:
    """Replay `trace` on the box `devices` split `split` (P+D) with the sim engine."""
    engine = engine or EngineConfig()
    workers = build_workers(box_workers(devices, split, tp), model, engine)
    max_prompt = min([model.max_context] + [w.engine.blocks.num_blocks * w.engine.blocks.block_size
                                            for w in workers])
    sim = TraceReplay(workers, "disagg", trace, max_prompt, seed)
    end = sim.run_loop()
    return sim.result(split, end, ttft_slo, itl_slo)


# ---- what the planner would have said over a trace ------------------------------------

def arrival_scv(times: list[float], t0: float = 0.0) -> tuple[float, int]:
    """(c_a², gaps) as the trends measure it: per minute from t0, the squared CV of the
    gaps ending in that minute, averaged weighted by gaps (planner/trends.py)."""
    from appliance.planner.trends import gap_stats, scv
    by_min: dict[int, list[float]] = {}
    for t in sorted(times):
        by_min.setdefault(int((t - t0) // 60), []).append(t)
    wsum, total = 0.0, 0
    for ts in by_min.values():
        n, s, sq = gap_stats(ts)
        if (c2 := scv(n, s, sq)) is not None:
            wsum, total = wsum + n * c2, total + n
    return (wsum / total if total else 1.0), total


def trace_workload(trace: list[TraceRequest], t0: float, t1: float, quantile: float):
    """(mean Workload, Workload at the q-quantile of per-minute rates) over [t0, t1),
    both with the window's burstiness: c_a² of arrivals, c_L² of prompt lengths."""
    from appliance.planner.sizing import Workload
    from appliance.planner.trends import MIN_GAPS
    rows = [r for r in trace if t0 <= r.t < t1]
    width = max(1e-9, t1 - t0)
    if not rows:
        return Workload(0.0, 0.0, 0.0), Workload(0.0, 0.0, 0.0)
    minutes = max(1, int(round(width / 60)))
    counts = [0] * minutes
    for r in rows:
        counts[min(minutes - 1, int((r.t - t0) // 60))] += 1
    pt = statistics.fmean(r.prompt for r in rows)
    ot = statistics.fmean(max(1, r.output) for r in rows)
    ca2, gaps = arrival_scv([r.t for r in rows], t0)
    ca2 = ca2 if gaps >= MIN_GAPS else 1.0    # as the planner: too few gaps, assume Poisson
    cl2 = statistics.pvariance([r.prompt for r in rows]) / (pt * pt) if pt > 0 else 0.0
    per_min = sorted(c / 60.0 for c in counts)
    upper = per_min[min(len(per_min) - 1, int(quantile * len(per_min)))]
    return (Workload(len(rows) / width, pt, ot, 0.0, ca2, cl2),
            Workload(max(upper, len(rows) / width), pt, ot, 0.0, ca2, cl2))


def plan_replay(trace: list[TraceRequest], model, devices: str, split: str, tp: int, slo,
                quantile: float = 0.9, window_s: float = 300.0,
                engine: EngineConfig | None = None, progress=None,
                budgets: list[int] | None = None) -> dict:
    """Replays `trace` on the current split and on the planner's recommendation for it,
    and says what the planner would have recommended window by window. `budgets`: the
    prefill token budgets (`engine.max_batch_tokens`, 0 = auto from the profile's knee)
    to replay each split with; the first is the one `replay` reports, all of them are
    under `by_budget` (default: the engine config's)."""
    from appliance.planner.profiles import simulated_profile
    from appliance.planner.sizing import prefill_ttft, size
    engine = engine or EngineConfig()
    shapes = box_workers(devices, split, tp)
    pre = next(s for s in shapes if s.role == "prefill")
    dec = next(s for s in shapes if s.role == "decode")
    pp = simulated_profile(model, pre.gpu, tp, engine.gpu_mem_fraction)
    dp = pp if dec.gpu is pre.gpu else simulated_profile(model, dec.gpu, tp, engine.gpu_mem_fraction)
    current = (sum(s.role == "prefill" for s in shapes), sum(s.role == "decode" for s in shapes))
    split = f"{current[0]}+{current[1]}"
    from appliance.partitions import discover
    total = len([d for d in discover(devices).devices if d.is_gpu]) // tp
    end = trace[-1].t + 1e-6
    windows = []
    t = 0.0
    while t < end:
        mean_w, upper_w = trace_workload(trace, t, min(end, t + window_s), quantile)
        sz = size(upper_w, slo, pp, dp, current, total, engine.max_seqs)
        windows.append({"t": round(t, 3), "requests": sum(1 for r in trace if t <= r.t < t + window_s),
                        "rate": round(mean_w.rate, 4), "rate_upper": round(upper_w.rate, 4),
                        "arrival_scv": round(upper_w.arrival_scv, 3),
                        "prompt_tokens": round(mean_w.prompt_tokens, 1),
                        "output_tokens": round(mean_w.output_tokens, 1), "rho": sz.rho,
                        "recommended": f"{sz.recommended[0]}+{sz.recommended[1]}",
                        "bottleneck": sz.bottleneck})
        t += window_s
    mean_all, upper_all = trace_workload(trace, 0.0, end, quantile)
    overall = size(upper_all, slo, pp, dp, current, total, engine.max_seqs)
    rec = f"{overall.recommended[0]}+{overall.recommended[1]}"
    splits = list(dict.fromkeys([split, rec]))
    # What the bound predicts for each split at the p90 minute, beside what ran (the
    # same whatever the token budget).
    bounds = {}
    for s in splits:
        n_pre = int(s.split("+")[0])
        bound = prefill_ttft(upper_all, pp, n_pre)
        poisson = prefill_ttft(replace(upper_all, arrival_scv=1.0, prompt_scv=0.0), pp, n_pre)
        bounds[s] = {
            "ttft_mean_s": round(bound, 4) if bound is not None and bound != float("inf") else None,
            "ttft_mean_poisson_s": (round(poisson, 4) if poisson is not None
                                    and poisson != float("inf") else None),
            "meets_ttft_slo": bound is not None and bound <= slo.ttft_s,
            "basis": "Kingman G/G/1 per prefill worker at the p90 minute's rate"}
    budgets = list(dict.fromkeys(budgets or [engine.max_batch_tokens]))
    by_budget: dict[str, dict] = {}
    for budget in budgets:
        label = "auto" if budget == 0 else str(budget)
        eng = replace(engine, max_batch_tokens=budget)
        results = by_budget[label] = {}
        for s in splits:
            if progress:
                progress(f"replaying {len(trace)} requests on {devices} split {s}, "
                         f"max_batch_tokens {label} (virtual clock)")
            results[s] = replay_trace(trace, model, devices, s, tp, eng, slo.ttft_s,
                                      slo.itl_s).to_json()
            results[s]["bound"] = dict(bounds[s])
    results = next(iter(by_budget.values()))
    return {
        "simulated": True, "devices": devices, "model": model.name, "tp": tp,
        "requests": len(trace), "duration_s": round(end, 3),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "checked_at": "p90 TTFT and p90 ITL"},
        "quantile": quantile,
        "workload": {"mean": mean_all.__dict__, "upper": upper_all.__dict__},
        "rho": overall.rho, "rho_source": "estimated from the simulated (roofline) profile",
        "current": split, "recommended": rec, "bottleneck": overall.bottleneck,
        "why": overall.why, "sizing": overall.to_json(),
        "burstiness": overall.burstiness,
        "prefill_token_budget": pp.prefill_knee_tokens(),
        "windows": windows, "window_s": window_s, "replay": results,
        "max_batch_tokens": next(iter(by_budget)), "by_budget": by_budget,
    }
