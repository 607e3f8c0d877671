"""Replay a request trace through the simulated cluster, and what the planner would
have said over it.

The cluster is `planner/cluster_sim.py` (the real sim engine on a virtual clock, routed
by the daemon's policy); this module drives it open-loop from a trace's arrival times
(Azure LLM trace format), measures TTFT and ITL with the hub's percentile, and sizes the
trace's windows as the planner would (`plan_replay`, behind `applianced plan replay`).
"""
from __future__ import annotations

import csv
import heapq
import statistics
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from appliance.config import EngineConfig
from appliance.percentiles import percentile
from appliance.planner.cluster_sim import VirtualCluster, Worker, box_workers, build_workers

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

