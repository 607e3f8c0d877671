"""Aggregated vs disaggregated serving on a simulated 8xH100 node, on a virtual clock.

    .venv/bin/python bench/bench_disagg_sim.py [--quick] [--jobs 2] [--agg-chunk 512]

The workload of NVIDIA's Dynamo claim (~+30% throughput/GPU for disaggregation on one
8xH100 node, Llama-70B FP8, ISL 3000 / OSL 150): every request has a 3,000-token prompt
(unique: no prefix-cache hits) and generates exactly 150 tokens (ignore_eos). Closed
loop: C users, each sends its next request the moment the previous one finishes.

What runs is the real engine code, on the virtual-clock cluster of
`appliance/planner/cluster_sim.py` (which `applianced plan replay` drives open-loop):
`SimEngine`/`BatchEngine` with the real `Scheduler` and `BlockManager`, engines built with the sizes `engine_factory._build_sim` would give
them (`StepTimeModel.kv_capacity_tokens`, config defaults for block size, token budget,
max_seqs, reserve ratio). The change that matters is `_sleep`: instead of sleeping, the
engine adds the roofline's step time to a counter, and this file turns those durations
into a discrete-event schedule (the other change, a BlockManager whose prefix-hash
`commit` is incremental, is for speed only and is checked to give identical numbers):

- every worker has its own clock; it starts a step when it is free and has work, and the
  events the step emits (tokens, PrefillDone, KvImported) happen when the step ends;
- disagg: PrefillDone (the first token) goes to the decode worker chosen as the daemon's
  router does (most free KV less blocks in flight, round-robin ties); the decode worker
  admits it in its own `kv_import` step, whose duration is the engine's own
  `import_kv` -> `StepTimeModel.transfer_s` (so the transfer occupies the decode worker,
  as it does in the sim engine); KvImported releases the prefill worker's blocks;
- agg / prefill worker choice: fewest queued prompt tokens, then fewest in flight,
  round-robin ties (the router's `_least_queued`).

Nothing here depends on the machine's speed: results are exact and reproducible.
Metrics per run are taken over a window after a warm-up (3C completed requests, then
4C more; --quick: C and C): output tokens/s per GPU (all 8
GPUs count, whatever their role), per-user tokens/s = 1 / mean inter-token latency
(ITL = (e2e - TTFT) / (OSL - 1) per request), TTFT p50/p90. The comparison takes, for
each per-user rate target, the best throughput/GPU any agg configuration reaches at or
above that rate vs the best disagg one (interpolating each configuration's C-curve at
the target), and their ratio. Writes bench/results/disagg_sim.json.

--agg-chunk N adds every agg layout a second time with chunked prefill
(`engine.prefill_chunk_tokens` = N: prompts in chunks of N tokens, a decode step between
two chunks), so "best agg" is the better of the two at each target.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance.config import EngineConfig  # noqa: E402
from appliance.engines.roofline import DeviceShape, StepTimeModel  # noqa: E402
from appliance.models.specs import lookup_model_spec  # noqa: E402
from appliance.planner.cluster_sim import (  # noqa: E402
    VirtualCluster, VirtualSimEngine, Worker, build_engine as _build_engine,
)
from appliance.partitions.catalogue import lookup_gpu  # noqa: E402

MODEL = "llama-3.1-70b-fp8"
GPU = "H100"
NODE_GPUS = 8
ISL = 3000
OSL = 150
DEFAULTS = EngineConfig()          # the daemon's engine defaults, not re-chosen here

CONCURRENCY = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]
CONCURRENCY_QUICK = [2, 8, 16, 32, 64, 128, 256]
TARGETS = [10, 20, 30, 40, 50, 75, 100]     # tokens/s/user


# ---- configurations ---------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    mode: str                 # "agg" | "disagg"
    groups: tuple             # ((role, tp, count), ...)
    chunk: int = 0            # agg only: engine.prefill_chunk_tokens

    @property
    def name(self) -> str:
        if self.mode == "agg":
            (_, tp, n), = self.groups
            return f"agg {n}x tp{tp}" + (f" chunk{self.chunk}" if self.chunk else "")
        (_, ptp, pn), (_, dtp, dn) = self.groups
        return f"disagg {pn}P(tp{ptp})+{dn}D(tp{dtp})"

    @property
    def gpus(self) -> int:
        return sum(tp * n for _, tp, n in self.groups)


def all_configs(agg_chunk: int = 0) -> list[Config]:
    configs = [Config("agg", (("agg", tp, NODE_GPUS // tp),), chunk)
               for chunk in sorted({0, agg_chunk}) for tp in (1, 2, 4, 8)]
    for ptp, dtp in itertools.product((1, 2, 4), (1, 2, 4)):
        for pn in range(1, NODE_GPUS // ptp):
            rest = NODE_GPUS - ptp * pn
            if rest > 0 and rest % dtp == 0:
                configs.append(Config("disagg", (("prefill", ptp, pn), ("decode", dtp, rest // dtp))))
    return configs


QUICK_CONFIGS = {"agg 8x tp1", "agg 4x tp2", "agg 2x tp4", "agg 1x tp8",
                 "disagg 4P(tp1)+4D(tp1)", "disagg 1P(tp2)+3D(tp2)", "disagg 2P(tp2)+2D(tp2)",
                 "disagg 3P(tp2)+1D(tp2)", "disagg 1P(tp4)+1D(tp4)", "disagg 4P(tp1)+1D(tp4)",
                 "disagg 6P(tp1)+1D(tp2)"}


def timing_for(tp: int) -> StepTimeModel:
    model = lookup_model_spec(MODEL)
    return StepTimeModel(DeviceShape.from_gpu(lookup_gpu(GPU), model.weight_bytes), tp, model)


def feasibility(cfg: Config) -> str | None:
    """Why the engine factory would refuse this, or why it cannot hold one request."""
    for role, tp, _ in cfg.groups:
        tokens = timing_for(tp).kv_capacity_tokens(DEFAULTS.gpu_mem_fraction)
        blocks = tokens // DEFAULTS.block_size
        if blocks < 1:
            return f"{role} tp{tp}: weights leave no KV room"
        need = -(-(ISL + (OSL if role != "prefill" else 1)) // DEFAULTS.block_size)
        if blocks < need:
            return f"{role} tp{tp}: KV pool of {tokens} tokens cannot hold one request"
    return None


# ---- the closed loop on the planner's virtual-clock cluster ------------------------

def build_engine(worker: str, tp: int, chunk: int = 0) -> VirtualSimEngine:
    """As engine_factory._build_sim builds a `sim` worker on tp simulated H100s."""
    return _build_engine(worker, timing_for(tp), DEFAULTS, chunk=chunk)


class Replay(VirtualCluster):
    """Closed loop: C users, each sends its next request when the previous one ends."""

    def __init__(self, cfg: Config, concurrency: int, warmup: int, measure: int, seed: int = 0):
        workers = [Worker(f"{role}{i}", role, tp, build_engine(f"{role}{i}", tp, cfg.chunk))
                   for role, tp, n in cfg.groups for i in range(n)]
        super().__init__(workers, cfg.mode, seed)
        self.cfg = cfg
        self.C = concurrency
        self.warmup = warmup
        self.measure = measure
        self.token_times: list[float] = []
        self.t0 = self.t1 = None
        self.base = 0
        # A shared prompt body (see VirtualCluster): no block is ever a cache hit.
        self.body = [self.rng.randrange(1000, 33000) for _ in range(ISL - 1)]

    def arrive(self, user: int, t: float) -> None:
        self.send(t, ISL, OSL, user)

    def on_token(self, req, now: float, n: int) -> None:
        self.token_times.extend([now] * n)

    def on_finish(self, req, now: float) -> None:
        self.send(now, ISL, OSL, req.user)     # closed loop: the user's next request

    def decoding_entries(self, rec):
        return [e for e in rec.entries if rec.phase == "decode" or e[2] > ISL]

    def done(self) -> bool:
        if self.t0 is None and len(self.finished) >= self.warmup:
            self.t0, self.base = self.now, len(self.finished)
        elif self.t0 is not None and len(self.finished) - self.base >= self.measure:
            self.t1 = self.now
            return True
        return False

    def run(self) -> dict:
        # Users start spread over the first second (otherwise they all arrive in the
        # same instant and stay in lock-step cohorts for the whole run).
        starts = sorted((self.rng.uniform(0.0, 1.0), u) for u in range(self.C))
        for t, u in starts:
            heapq.heappush(self.heap, (t, next(self.seq), None, u))
        self.run_loop()
        return self.metrics(self.t0, self.t1)

    def metrics(self, t0: float, t1: float) -> dict:
        span = t1 - t0
        tokens = sum(1 for t in self.token_times if t0 <= t <= t1)
        done = [r for r in self.finished if t0 <= r.done <= t1]
        itl = [(r.done - r.first) / (OSL - 1) for r in done]
        ttft = sorted(r.first - r.sent for r in done)
        e2e = [r.done - r.sent for r in done]
        roles = {}
        for w in self.workers:
            agg = roles.setdefault(w.role, {"workers": 0, "busy_s": 0.0, "prefill_s": 0.0,
                                            "decode_steps": 0, "decode_seqs": 0})
            agg["workers"] += 1
            for a, b, phase in w.steps:
                overlap = max(0.0, min(b, t1) - max(a, t0))
                agg["busy_s"] += overlap
                if phase == "prefill":
                    agg["prefill_s"] += overlap
            agg["decode_steps"] += w.decode_steps
            agg["decode_seqs"] += w.decode_seqs
        # Share of the window each role's workers spent running steps (any phase).
        util = {role: round(a["busy_s"] / (a["workers"] * span), 3) for role, a in roles.items()}
        prefill_share = {role: round(a["prefill_s"] / (a["workers"] * span), 3)
                         for role, a in roles.items()}
        batch = {role: round(a["decode_seqs"] / a["decode_steps"], 1)
                 for role, a in roles.items() if a["decode_steps"]}
        return {
            "config": self.cfg.name, "mode": self.cfg.mode, "concurrency": self.C,
            "window_s": round(span, 3), "requests": len(done),
            "tok_s_gpu": tokens / span / self.cfg.gpus,
            "tok_s_user": 1.0 / statistics.fmean(itl),
            "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "e2e_mean_s": statistics.fmean(e2e),
            "busy_share": util, "prefill_time_share": prefill_share, "mean_decode_batch": batch,
            "preemptions": sum(w.engine.scheduler.preemptions for w in self.workers),
        }


# ---- sweep ----------------------------------------------------------------------------

def sweep(job: tuple[Config, list[int], bool]) -> list[dict]:
    cfg, levels, quick = job
    results = []
    for c in levels:
        warmup = max(c, 8) if quick else max(3 * c, 24)
        measure = max(c, 16) if quick else max(4 * c, 64)
        r = Replay(cfg, c, warmup, measure).run()
        results.append(r)
        # Saturated: more users only lengthen the queue (per-user rate falls, throughput
        # does not rise), so larger C cannot be on the frontier.
        if len(results) >= 2 and r["tok_s_gpu"] < 1.01 * results[-2]["tok_s_gpu"]:
            break
    return results


def frontier_at(runs: list[dict], target: float) -> tuple[float, str, float] | None:
    """Best tok/s/GPU at per-user rate >= target: (tok/s/GPU, where, TTFT p50).

    Each configuration's runs form a curve over C; where it crosses the target between
    two measured C, throughput and TTFT are interpolated linearly in per-user rate."""
    best = None
    by_cfg: dict[str, list[dict]] = {}
    for r in runs:
        by_cfg.setdefault(r["config"], []).append(r)
    for name, rs in by_cfg.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        cands = [(r["tok_s_gpu"], f"{name} C={r['concurrency']}", r["ttft_p50_s"])
                 for r in rs if r["tok_s_user"] >= target]
        for a, b in zip(rs, rs[1:]):
            ua, ub = a["tok_s_user"], b["tok_s_user"]
            if ua >= target > ub:
                f = (ua - target) / (ua - ub)
                cands.append((a["tok_s_gpu"] + f * (b["tok_s_gpu"] - a["tok_s_gpu"]),
                              f"{name} C={a['concurrency']}..{b['concurrency']}",
                              a["ttft_p50_s"] + f * (b["ttft_p50_s"] - a["ttft_p50_s"])))
        for cand in cands:
            if best is None or cand[0] > best[0]:
                best = cand
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer configurations and levels")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (configurations in parallel)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "disagg_sim.json"))
    ap.add_argument("--agg-chunk", type=int, default=0,
                    help="also run every agg layout with chunked prefill of this many tokens")
    args = ap.parse_args()

    started = time.perf_counter()
    levels = CONCURRENCY_QUICK if args.quick else CONCURRENCY
    configs, skipped = [], []
    for cfg in all_configs(args.agg_chunk):
        if args.quick and cfg.name.split(" chunk")[0] not in QUICK_CONFIGS:
            continue
        why = feasibility(cfg)
        (skipped.append({"config": cfg.name, "reason": why}) if why else configs.append(cfg))
    # Longest jobs first (big-batch configurations simulate the most sequences).
    configs.sort(key=lambda c: -max(tp for _, tp, _ in c.groups))
    jobs = [(cfg, levels, args.quick) for cfg in configs]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            runs = [r for rs in pool.map(sweep, jobs) for r in rs]
    else:
        runs = [r for job in jobs for r in sweep(job)]
    order = {cfg.name: i for i, cfg in enumerate(all_configs(args.agg_chunk))}
    runs.sort(key=lambda r: (order[r["config"]], r["concurrency"]))

    kv = {tp: timing_for(tp).kv_capacity_tokens(DEFAULTS.gpu_mem_fraction) for tp in (1, 2, 4, 8)}
    print(f"# agg vs disagg, sim {NODE_GPUS}x{GPU}, {MODEL}, ISL {ISL} / OSL {OSL}, closed loop\n")
    print("KV pool per worker (kv_capacity_tokens, gpu_mem_fraction "
          f"{DEFAULTS.gpu_mem_fraction}): " + ", ".join(
              f"tp{tp} {n:,} tokens ({n // (ISL + OSL)} requests)" for tp, n in kv.items()))
    for s in skipped:
        print(f"skipped {s['config']}: {s['reason']}")
    if not skipped:
        print("No configuration is infeasible by the factory's rule (tp1 fits, with room for "
              f"{kv[1] // (ISL + OSL)} requests per worker).")
    print("\n| config | C | tok/s/GPU | tok/s/user | TTFT p50 s | TTFT p90 s | busy share | decode batch |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r in runs:
        busy = " ".join(f"{k[0].upper()}{v:.2f}" for k, v in r["busy_share"].items())
        batch = " ".join(f"{k[0].upper()}{v:g}" for k, v in r["mean_decode_batch"].items())
        print(f"| {r['config']} | {r['concurrency']} | {r['tok_s_gpu']:.0f} | {r['tok_s_user']:.1f} "
              f"| {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {busy} | {batch} |")

    print("\n| config | peak tok/s/GPU | at C | tok/s/user there | TTFT p50 there | tok/s/user at C=min |")
    print("|---|---:|---:|---:|---:|---:|")
    for cfg in sorted(configs, key=lambda c: order[c.name]):
        rs = [r for r in runs if r["config"] == cfg.name]
        peak = max(rs, key=lambda r: r["tok_s_gpu"])
        print(f"| {cfg.name} | {peak['tok_s_gpu']:.0f} | {peak['concurrency']} | "
              f"{peak['tok_s_user']:.1f} | {peak['ttft_p50_s']:.2f} | {rs[0]['tok_s_user']:.1f} |")

    agg = [r for r in runs if r["mode"] == "agg"]
    dis = [r for r in runs if r["mode"] == "disagg"]
    comparison = []
    print("\n| tok/s/user target | best agg tok/s/GPU | agg at (TTFT p50) "
          "| best disagg tok/s/GPU | disagg at (TTFT p50) | disagg/agg |")
    print("|---:|---:|---|---:|---|---:|")
    for target in TARGETS:
        a, d = frontier_at(agg, target), frontier_at(dis, target)
        ratio = d[0] / a[0] if a and d else None
        comparison.append({
            "target_tok_s_user": target, "ratio": ratio,
            **{k: x and {"tok_s_gpu": x[0], "at": x[1], "ttft_p50_s": x[2]}
               for k, x in (("agg", a), ("disagg", d))}})
        fmt = lambda x: ("-", "none reaches it") if x is None else (  # noqa: E731
            f"{x[0]:.0f}", f"{x[1]} ({x[2]:.2f} s)")
        print(f"| {target} | {fmt(a)[0]} | {fmt(a)[1]} | {fmt(d)[0]} | {fmt(d)[1]} | "
              f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    elapsed = time.perf_counter() - started
    print(f"\n{len(runs)} runs in {elapsed:.0f} s wall (virtual clock: machine-independent results)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "workload": {"model": MODEL, "gpu": GPU, "gpus": NODE_GPUS, "isl": ISL, "osl": OSL,
                     "loop": "closed", "concurrency_levels": levels},
        "engine_defaults": {k: getattr(DEFAULTS, k) for k in
                            ("block_size", "max_batch_tokens", "max_seqs", "gpu_mem_fraction",
                             "reserve_ratio")},
        "agg_chunk": args.agg_chunk,
        "kv_capacity_tokens": kv, "skipped": skipped, "runs": runs, "comparison": comparison,
        "quick": args.quick, "wall_s": round(elapsed, 1), "python": platform.python_version(),
    }, indent=1))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
