"""How many prefill and decode workers a workload needs at the SLOs (DOMAIN.md,
"Capacity planning"), and the best split of a fixed box between the two phases.

Prefill: a worker serving one prompt at a time is an M/D/1 queue with service time D
(the profile's prefill time for one mean uncached prompt); its mean TTFT D + λD²/(2(1-λD))
stays within the SLO S up to R_max = 2(S-D) / (D(2S-D)) requests/s (DistServe).
Decode: the largest batch B* whose step time meets the ITL SLO and whose KV fits the
pool at the mean context L_in + L_out/2; a worker then makes T_d = B*/ITL(B*) tokens/s.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from appliance.planner.profiles import Profile


@dataclass(frozen=True)
class Workload:
    rate: float                 # requests/s (λ)
    prompt_tokens: float        # mean L_in
    output_tokens: float        # mean L_out
    prefix_hit: float = 0.0     # share of prompt tokens served from the prefix cache (h)

    @property
    def uncached_prompt(self) -> float:
        return self.prompt_tokens * (1.0 - self.prefix_hit)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


def mdl1_max_rate(slo_s: float, service_s: float) -> float:
    """R_max = 2(S-D) / (D(2S-D)): the arrival rate at which an M/D/1 queue's mean
    time in system reaches S. 0 when one request alone already takes S or more."""
    S, D = slo_s, service_s
    if D <= 0:
        return math.inf
    if D >= S:
        return 0.0
    return 2.0 * (S - D) / (D * (2.0 * S - D))


def workers_for(demand: float, per_worker: float) -> int:
    """⌈demand / per_worker⌉, 0 for no demand; a worker that can serve nothing makes
    any demand unservable (ValueError is for the caller to word)."""
    if demand <= 0:
        return 0
    if per_worker <= 0:
        raise ValueError("unservable")
    return math.ceil(demand / per_worker - 1e-9)


def decode_batch(profile: Profile, itl_s: float, prompt_tokens: float, output_tokens: float,
                 max_seqs: int) -> tuple[int, float, str]:
    """(B*, ITL(B*), what limits B*): the largest batch meeting the ITL SLO and the KV pool
    at context L_in + L_out/2. B* = 0 when even one sequence misses the SLO or the pool."""
    context = prompt_tokens + output_tokens / 2.0
    kv_limit = int(profile.kv_capacity_tokens // max(1.0, context))
    limit = min(max_seqs, kv_limit)
    best, best_itl = 0, profile.decode_s(1, context)
    lo, hi = 1, limit
    while lo <= hi:                       # step time grows with the batch: bisect
        mid = (lo + hi) // 2
        t = profile.decode_s(mid, context)
        if t <= itl_s:
            best, best_itl, lo = mid, t, mid + 1
        else:
            hi = mid - 1
    if best == 0:
        why = "KV pool" if kv_limit < 1 else "ITL"
    elif best == limit:
        why = "KV pool" if kv_limit <= max_seqs else "max_seqs"
    else:
        why = "ITL"
    return best, best_itl, why


@dataclass
class PhaseNeed:
    per_worker: float           # prefill: requests/s (R_max); decode: tokens/s (T_d)
    demand: float               # prefill: requests/s; decode: tokens/s
    workers: float              # demand / per_worker (fractional)
    workers_needed: int         # ⌈…⌉
    tp: int
    gpu_seconds_per_s: float    # busy GPU demand at the profile's best throughput
    detail: dict

    @property
    def gpus_needed(self) -> int:
        return self.workers_needed * self.tp


def prefill_need(w: Workload, slo: Slo, profile: Profile) -> PhaseNeed:
    D = profile.prefill_s(w.uncached_prompt)
    r_max = mdl1_max_rate(slo.ttft_s, D)
    frac = math.inf if (r_max == 0 and w.rate > 0) else (w.rate / r_max if r_max else 0.0)
    knee = profile.prefill_knee_tokens()
    tput = profile.prefill_tokens_per_s(knee)
    gpu_s = w.rate * w.uncached_prompt / tput * profile.tp if tput else 0.0
    return PhaseNeed(r_max, w.rate, frac, math.ceil(frac - 1e-9) if math.isfinite(frac) else -1,
                     profile.tp, gpu_s,
                     {"service_time_s": D, "r_max_per_worker": r_max,
                      "knee_tokens": knee, "knee_tokens_per_s": tput})


def decode_need(w: Workload, slo: Slo, profile: Profile, max_seqs: int) -> PhaseNeed:
    b, itl, why = decode_batch(profile, slo.itl_s, w.prompt_tokens, w.output_tokens, max_seqs)
    t_d = b / itl if b else 0.0
    demand = w.rate * w.output_tokens
    frac = math.inf if (t_d == 0 and demand > 0) else (demand / t_d if t_d else 0.0)
    gpu_s = demand / t_d * profile.tp if t_d else 0.0
    return PhaseNeed(t_d, demand, frac, math.ceil(frac - 1e-9) if math.isfinite(frac) else -1,
                     profile.tp, gpu_s,
                     {"batch": b, "itl_at_batch_s": itl, "batch_limited_by": why,
                      "context_tokens": w.prompt_tokens + w.output_tokens / 2.0})


def rho(pn: PhaseNeed, dn: PhaseNeed) -> float | None:
    """Phase-mix index: prefill GPU demand / decode GPU demand (None without decode)."""
    return pn.gpu_seconds_per_s / dn.gpu_seconds_per_s if dn.gpu_seconds_per_s > 0 else None


def headroom(workers: int, need: float) -> float | None:
    """Capacity over demand (None when there is no demand)."""
    if need <= 0:
        return None
    if not math.isfinite(need):
        return 0.0
    return workers / need


def best_split(total: int, need_p: float, need_d: float, current: tuple[int, int]) -> tuple[int, int]:
    """The split of `total` workers (each phase ≥ 1) with the largest smallest headroom;
    with no demand at all, keep the current split (moving workers costs a repartition)."""
    if total < 2:
        return current
    if need_p <= 0 and need_d <= 0:
        return current

    def score(p: int) -> tuple:
        hp = math.inf if need_p <= 0 else p / need_p
        hd = math.inf if need_d <= 0 else (total - p) / need_d
        # ties: stay closest to the current split
        return (min(hp, hd), -abs(p - current[0]))

    p = max(range(1, total), key=score)
    # Hysteresis: a repartition drains workers, so keep the current split when it is
    # within 10% of the best one's smallest headroom.
    if 1 <= current[0] < total and sum(current) == total and \
            score(current[0])[0] >= 0.9 * score(p)[0]:
        return current
    return p, total - p


@dataclass
class Sizing:
    workload: dict
    slo: dict
    prefill: PhaseNeed
    decode: PhaseNeed
    rho: float | None
    current: tuple[int, int]
    recommended: tuple[int, int]
    headroom_current: dict
    headroom_recommended: dict
    fits: bool                  # the recommended split covers both needs
    bottleneck: str             # "prefill" | "decode" | "none"
    why: str

    def to_json(self) -> dict:
        def phase(n: PhaseNeed) -> dict:
            d = asdict(n)
            d["gpus_needed"] = n.gpus_needed
            for k, v in list(d.items()):
                if isinstance(v, float) and not math.isfinite(v):
                    d[k] = None
            return d
        return {"workload": self.workload, "slo": self.slo, "prefill": phase(self.prefill),
                "decode": phase(self.decode), "rho": self.rho,
                "current": {"prefill": self.current[0], "decode": self.current[1]},
                "recommended": {"prefill": self.recommended[0], "decode": self.recommended[1]},
                "headroom_current": self.headroom_current,
                "headroom_recommended": self.headroom_recommended,
                "fits": self.fits, "bottleneck": self.bottleneck, "why": self.why}


def size(w: Workload, slo: Slo, prefill_profile: Profile, decode_profile: Profile,
         current: tuple[int, int], total_workers: int | None = None, max_seqs: int = 256) -> Sizing:
    """Needs per phase, the best split of `total_workers` (default: the current total)
    and which phase binds, in words."""
    total = total_workers if total_workers is not None else sum(current)
    pn = prefill_need(w, slo, prefill_profile)
    dn = decode_need(w, slo, decode_profile, max_seqs)
    rec = best_split(total, pn.workers, dn.workers, current)
    hc = {"prefill": headroom(current[0], pn.workers), "decode": headroom(current[1], dn.workers)}
    hr = {"prefill": headroom(rec[0], pn.workers), "decode": headroom(rec[1], dn.workers)}
    fits = all(h is None or h >= 1.0 for h in hr.values())
    bottleneck, why = _explain(w, slo, pn, dn, rec, hr)
    return Sizing(asdict(w), asdict(slo), pn, dn, rho(pn, dn), current, rec, hc, hr, fits,
                  bottleneck, why)


def _explain(w: Workload, slo: Slo, pn: PhaseNeed, dn: PhaseNeed, rec: tuple[int, int],
             hr: dict) -> tuple[str, str]:
    p, d = pn.detail, dn.detail
    if pn.workers <= 0 and dn.workers <= 0:
        return "none", "no traffic in the window: nothing binds, the split stays as it is"
    if p["r_max_per_worker"] == 0:
        return "prefill", (f"prefill: one mean prompt ({w.uncached_prompt:.0f} uncached tokens) "
                           f"takes {p['service_time_s']:.3f} s alone, at or over the TTFT SLO "
                           f"{slo.ttft_s:g} s: no number of workers meets it")
    if d["batch"] == 0:
        return "decode", (f"decode: one sequence at context {d['context_tokens']:.0f} misses the "
                          f"{'KV pool' if d['batch_limited_by'] == 'KV pool' else 'ITL SLO'}: "
                          "no number of workers meets it")
    hp = hr["prefill"] if hr["prefill"] is not None else math.inf
    hd = hr["decode"] if hr["decode"] is not None else math.inf
    phase = "prefill" if hp <= hd else "decode"
    pre = (f"prefill: a worker takes {p['service_time_s']:.3f} s per mean prompt of "
           f"{w.uncached_prompt:.0f} uncached tokens, so at TTFT ≤ {slo.ttft_s:g} s (M/D/1) it "
           f"serves {p['r_max_per_worker']:.2f} req/s; {w.rate:.2f} req/s need "
           f"{pn.workers:.2f} workers")
    dec = (f"decode: batch B* = {d['batch']} (limited by {d['batch_limited_by']}) at "
           f"{d['itl_at_batch_s'] * 1000:.1f} ms/token makes {dn.per_worker:.0f} tok/s per "
           f"worker; {dn.demand:.0f} tok/s need {dn.workers:.2f} workers")
    head = hp if phase == "prefill" else hd
    lead = (f"{phase} binds (headroom {head:.2f}x at {rec[0]}+{rec[1]})" if math.isfinite(head)
            else "no demand")
    return phase, f"{lead}. {pre}. {dec}."
