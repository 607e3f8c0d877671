"""The planner as the daemon runs it: trends in, a plan out, and optionally a
repartition started when the plan has disagreed with the box for long enough.

It knows the box as `BoxShape` (the workers of each phase and their GPU type), never
the daemon. The daemon hands it three callables, so this package has no HTTP and no
daemon imports: `box_source` (the live partition, which workflows change),
`start_repartition` (submit the repartition workflow to the workflow engine) and
`workers_changing` (is a workflow that changes the workers running: then the box is in
flux, and the auto-apply clock waits).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from appliance.config import EngineConfig, PlannerConfig, parse_duration
from appliance.planner import forecast as fc
from appliance.planner.profiles import Profile, load_profile, simulated_profile
from appliance.planner.sizing import Slo, Workload, decode_batch, headroom, size
from appliance.planner.trends import MIN_GAPS, TrendStore, series

log = logging.getLogger("applianced.planner")

MAX_HORIZON_S = 8 * 604800
NOW_WINDOW_S = 900.0             # "now" = the last 15 minutes of trends
DECODE_COSTS_MAX = 8192          # distinct (prompt, output) shapes kept; then started afresh


@dataclass(frozen=True)
class BoxShape:
    """What the box is: workers per phase, their GPU type (GpuSpec or None = CPU) and tp."""

    model: object                   # ModelSpec
    prefill_gpu: object | None
    decode_gpu: object | None
    prefill_workers: int
    decode_workers: int
    tp: int
    total_gpus: int                 # GPUs of the box (the split of a fixed box is planned)
    simulated: bool
    mode: str = "disagg"
    kv_cache_bytes: int = 0         # CPU workers' KV pool (the roofline's would be the RAM)

    @property
    def current(self) -> tuple[int, int]:
        return self.prefill_workers, self.decode_workers

    @property
    def total_workers(self) -> int:
        return max(self.prefill_workers + self.decode_workers, self.total_gpus // self.tp)


@dataclass
class WhatIf:
    gpu: str | None = None
    ttft_slo: float | None = None
    itl_slo: float | None = None
    traffic_x: float = 1.0
    prompt_tokens: float | None = None
    output_tokens: float | None = None

    def applied(self) -> dict:
        return {k: v for k, v in self.__dict__.items()
                if v is not None and not (k == "traffic_x" and v == 1.0)}


WHATIF_PARAMS = ("gpu", "ttft_slo", "itl_slo", "traffic_x", "prompt_tokens", "output_tokens")


def parse_whatif(params: dict[str, str]) -> WhatIf:
    """Query parameters -> WhatIf; a bad one is one ValueError line naming it."""
    w = WhatIf()
    for key in ("ttft_slo", "itl_slo", "traffic_x", "prompt_tokens", "output_tokens"):
        if key in params:
            try:
                value = float(params[key])
            except ValueError:
                raise ValueError(f"{key} must be a number, got {params[key]!r}") from None
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{key} must be a positive number, got {params[key]!r}")
            setattr(w, key, value)
    if "gpu" in params:
        from appliance.partitions.catalogue import lookup_gpu
        w.gpu = lookup_gpu(params["gpu"]).name      # ValueError names the known ones
    return w


def profile_for(box: BoxShape, gpu, profile_dir: Path | None, engine: EngineConfig) -> Profile:
    """A measured profile from `applianced profile` when one exists for this (model,
    device, tp), else the roofline's."""
    device = gpu.name if gpu is not None else "cpu"
    measured = load_profile(profile_dir, box.model.name, device, box.tp)
    if measured is not None:
        return measured
    p = simulated_profile(box.model, gpu, box.tp, engine.gpu_mem_fraction)
    if gpu is None and box.kv_cache_bytes:
        p.kv_capacity_tokens = int(box.kv_cache_bytes // box.model.kv_bytes_per_token())
    return p


def _plain(x):
    """numpy scalars (the forecasters' output) as Python numbers: the plan is JSON."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


RHO_HISTORY = 240        # past buckets of rho in a plan: what the TUI's trend shows


class Planner:
    def __init__(self, cfg: PlannerConfig, box: BoxShape, db_path: str | Path,
                 engine: EngineConfig | None = None, profile_dir: Path | None = None,
                 start_repartition: Callable[[str], Awaitable[dict]] | None = None,
                 model_name: str | None = None, clock: Callable[[], float] = time.time,
                 box_source: Callable[[], BoxShape] | None = None,
                 workers_changing: Callable[[], bool] | None = None,
                 served_name: Callable[[], str] | None = None):
        self.cfg = cfg
        self.box = box
        self.box_source = box_source
        self.served_name = served_name
        self.workers_changing = workers_changing
        self.engine = engine or EngineConfig()
        self.profile_dir = profile_dir
        self.model_name = model_name or box.model.name
        self.clock = clock
        self.start_repartition = start_repartition
        self.prefill_profile = profile_for(box, box.prefill_gpu, profile_dir, self.engine)
        self.decode_profile = profile_for(box, box.decode_gpu, profile_dir, self.engine)
        self._prefill_cost: float | None = None
        self._decode_costs: dict[tuple[int, float], float] = {}
        self.gpu_source = (f"estimated from the {self.prefill_profile.source} profile "
                           "(no measured per-phase GPU-seconds in the request records)")
        self.trends = TrendStore(db_path, self._estimate, self.gpu_source)
        self.last_recommended: tuple[int, int] | None = None
        self.differs_since: float | None = None
        self.applied: list[dict] = []
        self.batch_tokens: dict | None = None     # engine.max_batch_tokens as the daemon applied it

    # -- trends -----------------------------------------------------------------------
    def observe(self, rec) -> None:
        self.trends.observe(rec)

    def _estimate(self, rec) -> tuple[float, float]:
        """Busy GPU-seconds one request costs each phase at the profiles' operating
        points: prefill at the knee throughput, decode at the SLO's batch B*.

        Runs for every request the daemon serves (in the trends thread, which shares
        the GIL with the event loop), so both operating points are looked up once per
        distinct shape, not searched again per request."""
        if rec.status == "rejected":
            return 0.0, 0.0
        uncached = max(0, rec.prompt_tokens - rec.cached_tokens)
        per_choice = rec.output_tokens / max(1, rec.choices)
        return (uncached * self._prefill_gpu_s_per_token(),
                rec.output_tokens * self._decode_gpu_s_per_token(rec.prompt_tokens, per_choice))

    # The two operating points are cached on the planner itself (a method cache of
    # functools would hold every planner ever made alive through its `self` keys).
    def _prefill_gpu_s_per_token(self) -> float:
        if self._prefill_cost is None:
            pp = self.prefill_profile
            tput = pp.prefill_tokens_per_s(pp.prefill_knee_tokens())
            self._prefill_cost = pp.tp / tput if tput else 0.0
        return self._prefill_cost

    def _decode_gpu_s_per_token(self, prompt_tokens: int, per_choice: float) -> float:
        key = (prompt_tokens, per_choice)
        cost = self._decode_costs.get(key)
        if cost is None:
            dp = self.decode_profile
            b, itl, _ = decode_batch(dp, self.cfg.itl_slo_s, prompt_tokens, per_choice,
                                     self.engine.max_seqs)
            cost = dp.tp * itl / max(1, b)
            if len(self._decode_costs) >= DECODE_COSTS_MAX:
                self._decode_costs.clear()
            self._decode_costs[key] = cost
        return cost

    # -- planning ---------------------------------------------------------------------
    def follow_box(self) -> None:
        """Take the live partition and model from `box_source` and `served_name`: after a
        repartition the current split is the new one (else auto-apply would keep "fixing"
        a box already fixed), after a model swap the trends and profiles are the new
        model's. Profiles are rebuilt only when a phase's GPU type or the model changed."""
        if self.served_name is not None:
            try:
                self.model_name = self.served_name()
            except Exception:
                log.exception("planner: cannot read the served model's name")
        if self.box_source is None:
            return
        try:
            box = self.box_source()
        except Exception:       # a box mid-change: plan on the last one seen
            log.exception("planner: cannot read the live partition")
            return
        if box == self.box:
            return
        old, self.box = self.box, box
        if (box.prefill_gpu, box.decode_gpu, box.tp, box.model) == \
                (old.prefill_gpu, old.decode_gpu, old.tp, old.model):
            return
        self.prefill_profile = profile_for(box, box.prefill_gpu, self.profile_dir, self.engine)
        self.decode_profile = profile_for(box, box.decode_gpu, self.profile_dir, self.engine)
        # The per-request estimates are cached per operating point of the old profiles.
        self._prefill_cost = None
        self._decode_costs.clear()

    def plan(self, horizon_s: float | None = None, whatif: WhatIf | None = None,
             now: float | None = None, use_statsmodels: bool = True) -> dict:
        self.trends.flush()
        self.follow_box()
        now = self.clock() if now is None else now
        horizon_s = horizon_s or parse_duration(self.cfg.horizon)
        whatif = whatif or WhatIf()
        box, pp, dp = self._whatif_box(whatif)
        slo = Slo(whatif.ttft_slo or self.cfg.ttft_slo_s, whatif.itl_slo or self.cfg.itl_slo_s)
        q = self.cfg.quantile

        span = self.trends.span(self.model_name)
        history_s = (now - span[0]) if span else 0.0
        bucket_s = 3600.0 if history_s >= 2 * 86400 else (300.0 if horizon_s > 6 * 3600 else 60.0)
        lookback = min(history_s, 28 * 86400 if bucket_s == 3600 else 2 * 86400)
        buckets = self.trends.buckets(self.model_name, bucket_s, now - lookback, now) if span else []
        # The bucket under way is partial: leave it out of the fit (rate would read low).
        if buckets and buckets[-1].start + bucket_s > now:
            buckets = buckets[:-1]
        steps = max(1, min(int(math.ceil(horizon_s / bucket_s)), 2016))
        next_t = (buckets[-1].start + bucket_s) if buckets else math.floor(now / bucket_s) * bucket_s

        # Now: the last 15 minutes (or what there is), at one-minute resolution.
        recent = (self.trends.buckets(self.model_name, 60.0, now - NOW_WINDOW_S, now) if span else [])
        burst = self._burstiness(recent, buckets)
        now_w = replace(self._workload(recent, whatif), arrival_scv=burst["arrival_scv"],
                        prompt_scv=burst["prompt_scv"])

        level = 2 * q - 1
        out_fc: dict[str, fc.Forecast] = {}
        for name, field_, fill in (("rate", "rate", 0.0), ("prompt_tokens", "prompt_mean", None),
                                   ("output_tokens", "output_mean", None),
                                   ("prefix_hit", "prefix_hit", 0.0)):
            y = series(buckets, field_, fill) if buckets else np.zeros(0)
            if field_ in ("prompt_mean", "output_mean") and buckets:
                known = [getattr(b, field_) for b in buckets if getattr(b, field_) is not None]
                y = series(buckets, field_, known[0] if known else 0.0)
            f = fc.forecast(y, steps, bucket_s, level=level, use_statsmodels=use_statsmodels)
            out_fc[name] = f
        rate_fc = out_fc["rate"]
        scale = whatif.traffic_x

        def workload_at(i: int, which: str) -> Workload:
            rate = getattr(rate_fc, which)[i] * scale
            # Without history the token forecasts are zeros: use the last 15 minutes. With
            # it, a trend run down to the forecaster's floor of 0 is still one token, not
            # a jump back to today's mix.
            pt = whatif.prompt_tokens or (max(1.0, out_fc["prompt_tokens"].mean[i]) if have_history
                                          else now_w.prompt_tokens)
            ot = whatif.output_tokens or (max(1.0, out_fc["output_tokens"].mean[i]) if have_history
                                          else now_w.output_tokens)
            hit = min(0.99, max(0.0, out_fc["prefix_hit"].mean[i]))
            # Plain floats: numpy scalars are not JSON (the plan is served as JSON).
            return Workload(float(rate), float(pt), float(ot), float(hit),
                            now_w.arrival_scv, now_w.prompt_scv)

        have_history = bool(buckets) and any(b.requests for b in buckets)
        # Recommended now: the upper quantile of the next bucket (or, with no history
        # worth a forecast, the last 15 minutes).
        upper_now = workload_at(0, "upper") if have_history else now_w
        upper_now = replace(upper_now, rate=max(upper_now.rate, now_w.rate))
        peak_i = int(np.argmax(rate_fc.upper)) if have_history else 0
        upper_peak = workload_at(peak_i, "upper") if have_history else now_w
        upper_peak = replace(upper_peak, rate=max(upper_peak.rate, upper_now.rate))
        current = box.current
        sz_now = size(upper_now, slo, pp, dp, current, box.total_workers, self.engine.max_seqs)
        sz_peak = size(upper_peak, slo, pp, dp, current, box.total_workers, self.engine.max_seqs)
        sz_obs = size(now_w, slo, pp, dp, current, box.total_workers, self.engine.max_seqs)

        rho_series = []
        for i in range(steps):
            w = workload_at(i, "mean")
            s = size(w if w.rate > 0 else replace(w, rate=1.0), slo, pp, dp, current,
                     box.total_workers, self.engine.max_seqs)
            rho_series.append(s.rho)
        if not whatif.applied():        # a what-if is a question, not the box's plan
            self.last_recommended = sz_now.recommended
        times = [next_t + i * bucket_s for i in range(steps)]

        def fseries(f: fc.Forecast, k: float = 1.0) -> list[dict]:
            return [{"t": t, "mean": round(m * k, 6), "lower": round(lo * k, 6),
                     "upper": round(hi * k, 6)} for t, m, lo, hi in zip(times, f.mean, f.lower, f.upper)]

        mean_day = [workload_at(i, "mean") for i in range(min(steps, int(86400 / bucket_s)) or 1)]
        cost = self._cost_per_day(box, pp, dp, sz_now.recommended, mean_day, slo)
        knee = pp.prefill_knee_tokens()
        rec, peak = sz_now.recommended, sz_peak.recommended
        return _plain({
            "model": self.model_name, "simulated": box.simulated, "generated_at": now,
            "horizon_s": horizon_s, "bucket_s": bucket_s, "quantile": q,
            "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
            "whatif": whatif.applied(),
            "profile_source": {phase: {"source": p.source, "device": p.device, "tp": p.tp,
                                       "created": p.created, "note": p.note}
                               for phase, p in (("prefill", pp), ("decode", dp))},
            "current": self._split_json(current, box, sz_obs),
            "recommended": {**self._split_json(rec, box, sz_now),
                            "at_peak": {**self._split_json(peak, box, sz_peak),
                                        "t": times[peak_i] if have_history else now}},
            "headroom": {"current": sz_now.headroom_current,
                         "recommended": sz_now.headroom_recommended},
            "fits": sz_now.fits,
            "rho": {"now": sz_obs.rho if now_w.rate > 0 else None,
                    "at_peak": sz_peak.rho if upper_peak.rate > 0 else None,
                    # GPU-seconds per second behind ρ: what a fleet view adds up
                    "demand": {k: {"prefill_gpu_s_per_s": z.prefill.gpu_seconds_per_s,
                                   "decode_gpu_s_per_s": z.decode.gpu_seconds_per_s}
                               for k, z in (("now", sz_obs), ("peak", sz_peak))},
                    "history": [{"t": b.start, "value": b.rho} for b in buckets[-RHO_HISTORY:]],
                    "forecast": [{"t": t, "value": r} for t, r in zip(times, rho_series)],
                    "source": self.gpu_source},
            "workload": {"now": now_w.__dict__, "upper_now": upper_now.__dict__,
                         "upper_peak": upper_peak.__dict__},
            "forecast": {"method": rate_fc.method, "season_buckets": rate_fc.season,
                         "interval": [round(1 - q, 4), q], "history_buckets": len(buckets),
                         "rate": fseries(rate_fc, scale),
                         "prompt_tokens": fseries(out_fc["prompt_tokens"]),
                         "output_tokens": fseries(out_fc["output_tokens"])},
            "bottleneck": {"phase": sz_now.bottleneck, "why": sz_now.why},
            "burstiness": {**burst, "service_scv": sz_now.burstiness["service_scv"],
                           "drives": sz_now.burstiness["drives"],
                           "poisson_split": sz_now.burstiness["poisson_split"],
                           "ttft_bound": sz_now.ttft},
            "sizing": {"now": sz_now.to_json(), "peak": sz_peak.to_json()},
            "cost": cost,
            "tuning": {"prefill_token_budget": knee,
                       "configured_max_batch_tokens": self.engine.max_batch_tokens,
                       "max_batch_tokens": self.batch_tokens or {
                           "configured": self.engine.max_batch_tokens,
                           "value": self.engine.max_batch_tokens, "source": "configured"},
                       "why": (f"the smallest prefill batch reaching 90% of the best prefill "
                               f"throughput in the {pp.source} profile "
                               f"({pp.prefill_tokens_per_s(knee):.0f} tok/s at {knee} tokens); "
                               "larger batches only lengthen TTFT")},
            "placement": self._placement(box),
            "box": self._box_json(box, pp),
            "auto_apply": {"enabled": self.cfg.auto_apply,
                           "after_s": self.cfg.auto_apply_after_s,
                           "differs_since": self.differs_since, "applied": self.applied[-5:]},
        })

    @staticmethod
    def _burstiness(recent, history) -> dict:
        """c_a² (inter-arrival) and c_L² (prompt length) measured over the last 15
        minutes, else over the forecast's history, else assumed Poisson with equal
        prompts (the M/D/1 case), and which it was. Not forecast: a service's
        burstiness is taken to be what it has been."""
        for label, bs in (("the last 15 minutes", recent), ("the history", history)):
            gaps = sum(b.arrival_gaps for b in bs)
            if gaps >= MIN_GAPS:
                ca2 = sum(b.arrival_scv * b.arrival_gaps for b in bs if b.arrival_gaps) / gaps
                req = [(b.prompt_scv, b.requests) for b in bs if b.prompt_scv is not None]
                cl2 = sum(c * n for c, n in req) / sum(n for _, n in req) if req else 0.0
                return {"arrival_scv": round(ca2, 4), "prompt_scv": round(cl2, 4),
                        "gaps": gaps, "source": f"measured over {label} (c_a² per minute, "
                                                 "weighted by inter-arrival gaps)"}
        return {"arrival_scv": 1.0, "prompt_scv": 0.0, "gaps": 0,
                "source": f"assumed Poisson arrivals, equal prompts (M/D/1): fewer than "
                          f"{MIN_GAPS} inter-arrival gaps measured"}

    def _workload(self, recent, whatif: WhatIf) -> Workload:
        n = sum(b.requests for b in recent)
        width = sum(b.width_s for b in recent) or NOW_WINDOW_S
        # The window may start before the first request: count from the first bucket with
        # traffic, so a daemon up for 2 minutes does not read as 2/15 of its rate.
        first = next((i for i, b in enumerate(recent) if b.requests), None)
        if first is not None:
            width = sum(b.width_s for b in recent[first:])
        ps = sum((b.prompt_mean or 0) * b.requests for b in recent)
        os_ = sum((b.output_mean or 0) * b.requests for b in recent)
        hits = [b.prefix_hit for b in recent if b.prefix_hit is not None]
        pt = whatif.prompt_tokens or (ps / n if n else 512.0)
        ot = whatif.output_tokens or (os_ / n if n else 128.0)
        return Workload(n / width * whatif.traffic_x if width else 0.0, pt, ot,
                        min(0.99, float(np.mean(hits))) if hits else 0.0)

    def _whatif_box(self, whatif: WhatIf):
        if not whatif.gpu:
            return self.box, self.prefill_profile, self.decode_profile
        from appliance.partitions.catalogue import lookup_gpu
        gpu = lookup_gpu(whatif.gpu)
        box = replace(self.box, prefill_gpu=gpu, decode_gpu=gpu, simulated=True)
        p = profile_for(box, gpu, self.profile_dir, self.engine)
        return box, p, p

    @staticmethod
    def _split_json(split: tuple[int, int], box: BoxShape, sz) -> dict:
        def phase(n: int, need, gpu) -> dict:
            return {"workers": n, "gpus": n * box.tp,
                    "device": gpu.name if gpu is not None else "cpu",
                    "workers_needed": need.workers_needed if need.workers_needed >= 0 else None,
                    "gpus_needed": need.gpus_needed if need.workers_needed >= 0 else None,
                    "headroom": headroom(n, need.workers)}
        out = {"split": f"{split[0]}+{split[1]}",
               "prefill": phase(split[0], sz.prefill, box.prefill_gpu),
               "decode": phase(split[1], sz.decode, box.decode_gpu)}
        out["fits"] = all(out[ph]["headroom"] is None or out[ph]["headroom"] >= 1.0
                          for ph in ("prefill", "decode"))
        return out

    def _box_json(self, box: BoxShape, pp: Profile) -> dict:
        """What the box is, for a fleet's role planning (`fleet_roles`): its model shape,
        its workers per GPU kind and what their profiles are built from."""
        name = lambda gpu: gpu.name if gpu is not None else "cpu"  # noqa: E731
        spare = max(0, box.total_workers - box.prefill_workers - box.decode_workers)
        groups: dict[str, int] = {}
        for gpu, n in ((box.prefill_gpu, box.prefill_workers),
                       (box.decode_gpu, box.decode_workers + spare)):
            if n:
                groups[name(gpu)] = groups.get(name(gpu), 0) + n
        return {"model_spec": box.model.name, "tp": box.tp, "gpus": box.total_gpus,
                "workers": [{"device": d, "count": n} for d, n in groups.items()],
                "max_seqs": self.engine.max_seqs, "gpu_mem_fraction": self.engine.gpu_mem_fraction,
                "kv_cache_bytes": box.kv_cache_bytes, "profile_source": pp.source}

    def _cost_per_day(self, box: BoxShape, pp: Profile, dp: Profile, split, day, slo) -> dict:
        """All the box's GPUs are paid for (allocation basis); energy = idle power plus the
        busy share of (TDP - idle) at the mean forecast load. Estimated, not metered."""
        gpus_p, gpus_d = split[0] * box.tp, split[1] * box.tp
        usd = (gpus_p * pp.usd_per_hour + gpus_d * dp.usd_per_hour) * 24
        busy_p = busy_d = 0.0
        for w in day:
            s = size(w, slo, pp, dp, split, sum(split), self.engine.max_seqs)
            busy_p += s.prefill.gpu_seconds_per_s
            busy_d += s.decode.gpu_seconds_per_s
        busy_p, busy_d = busy_p / len(day), busy_d / len(day)
        up = min(1.0, busy_p / gpus_p) if gpus_p else 0.0
        ud = min(1.0, busy_d / gpus_d) if gpus_d else 0.0
        watts = (gpus_p * (pp.idle_w + up * (pp.tdp_w - pp.idle_w))
                 + gpus_d * (dp.idle_w + ud * (dp.tdp_w - dp.idle_w)))
        return {"usd_per_day": round(usd, 2), "kwh_per_day": round(watts * 24 / 1000, 2),
                "utilization": {"prefill": round(up, 4), "decode": round(ud, 4)},
                "source": "estimated (catalogue prices and power, profile GPU-seconds)"}

    def _placement(self, box: BoxShape) -> dict | None:
        if box.prefill_gpu is None or box.decode_gpu is None or box.prefill_gpu is box.decode_gpu:
            return None
        from appliance.partitions.plan import rank_for_prefill
        _, why = rank_for_prefill([box.prefill_gpu, box.decode_gpu])
        return {"prefill": box.prefill_gpu.name, "decode": box.decode_gpu.name, "why": why}

    # -- auto-apply -------------------------------------------------------------------
    async def auto_apply_tick(self, now: float | None = None) -> dict | None:
        """Call periodically: plans, and when the recommendation has differed from the
        box for `auto_apply_after_s`, starts the repartition (once per difference)."""
        import asyncio
        import functools
        now = self.clock() if now is None else now
        # Forecasts take a while on long history: off the event loop.
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.plan, now=now, use_statsmodels=False))
        rec = self.last_recommended
        if rec is None or rec == self.box.current:
            self.differs_since = None
            return None
        if self.workers_changing is not None and self.workers_changing():
            # A repartition (ours or an operator's) or a model swap is under way: the
            # box is in flux, and a second one would be refused anyway.
            self.differs_since = None
            return None
        if self.differs_since is None:
            self.differs_since = now
            return None
        if not self.cfg.auto_apply or self.start_repartition is None:
            return None
        if now - self.differs_since < self.cfg.auto_apply_after_s:
            return None
        split = f"{rec[0]}+{rec[1]}"
        self.differs_since = None
        try:
            result = await self.start_repartition(split)
        except Exception as exc:      # the workflow refused (one running already ...)
            entry = {"t": now, "split": split, "error": str(exc)}
        else:
            entry = {"t": now, "split": split, "workflow": result}
        self.applied.append(entry)
        log.info("planner auto-apply: %s", entry)
        return entry

    def close(self) -> None:
        self.trends.close()


def box_from_setup(setup, cfg_engine: EngineConfig, plan=None, model=None) -> BoxShape:
    """The BoxShape of a daemon's Setup (inventory + partition plan + model); `plan`
    (default: the start-up one) is the live partition when a workflow changed it."""
    from appliance.models.specs import lookup_model_spec, spec_from_hf_config
    if model is None:
        model = (lookup_model_spec(cfg_engine.model_spec) if cfg_engine.model_spec
                 else spec_from_hf_config(setup.model_dir / "config.json"))
    devices = {d.id: d for d in setup.inventory.devices}
    plan = plan if plan is not None else setup.plan

    def gpu_of(slots):
        if not slots:
            return None
        return devices[slots[0].devices[0]].spec
    gpus = [d for d in setup.inventory.devices if d.is_gpu and not d.lost]
    if plan.mode == "agg":
        prefill_gpu = decode_gpu = gpu_of(plan.agg)
        current = (len(plan.agg), 0)
    else:
        prefill_gpu, decode_gpu = gpu_of(plan.prefill), gpu_of(plan.decode)
        current = (len(plan.prefill), len(plan.decode))
    cpu = not gpus
    return BoxShape(model=model, prefill_gpu=prefill_gpu, decode_gpu=decode_gpu,
                    prefill_workers=current[0], decode_workers=current[1], tp=plan.tp,
                    total_gpus=2 if cpu else len(gpus), simulated=setup.simulated,
                    mode=plan.mode, kv_cache_bytes=cfg_engine.kv_cache_bytes if cpu else 0)
