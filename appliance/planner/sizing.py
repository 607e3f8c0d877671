"""How many prefill and decode workers a workload needs at the SLOs (DOMAIN.md,
"Capacity planning"), and the best split of a fixed box between the two phases.

Prefill: a worker serving one prompt at a time is a G/G/1 queue with mean service time
D (the profile's prefill time for one mean uncached prompt). Kingman's bound on its
mean wait, Wq ≈ (c_a² + c_s²)/2 · ρ/(1-ρ) · D with ρ = λD, keeps the mean TTFT D + Wq
within the SLO S up to R_max = (S-D) / (D(k·D + S - D)) requests/s, k = (c_a²+c_s²)/2.
c_a² is the squared coefficient of variation of inter-arrival times (measured per
minute in the trends), c_s² that of the service time (from the prompt-length spread).
Poisson arrivals and equal prompts (c_a² = 1, c_s² = 0) make it the M/D/1 bound
R_max = 2(S-D) / (D(2S-D)) of DistServe; a bursty service (the Azure code trace:
c_a² ≈ 22 per minute) needs several times the workers M/D/1 says.

Why per worker and not M/G/c (Allen–Cunneen on Erlang-C): the router spreads a burst
over all prefill workers at once, so every worker sees the burst; pooled M/G/c at the
trace's p90 minute predicts a 4-worker pool almost never waits (mean TTFT ≈ 0.45 s),
while the replay's p90 TTFT is 4.1 s. Each worker as its own G/G/1 with the whole
stream's c_a² agrees with the replay (see docs/operations/capacity-planning.md).
Decode: the largest batch B* whose step time meets the ITL SLO and whose KV fits the
pool at the mean context L_in + L_out/2; a worker then makes T_d = B*/ITL(B*) tokens/s.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from appliance.planner.profiles import Profile


@dataclass(frozen=True)
class Workload:
    rate: float                 # requests/s (λ)
    prompt_tokens: float        # mean L_in
    output_tokens: float        # mean L_out
    prefix_hit: float = 0.0     # share of prompt tokens served from the prefix cache (h)
    arrival_scv: float = 1.0    # c_a² of inter-arrival times (1 = Poisson)
    prompt_scv: float = 0.0     # c_L² of prompt lengths (0 = all prompts alike)

    @property
    def uncached_prompt(self) -> float:
        return self.prompt_tokens * (1.0 - self.prefix_hit)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


def kingman_max_rate(slo_s: float, service_s: float, ca2: float = 1.0, cs2: float = 0.0) -> float:
    """R_max = (S-D) / (D(k·D + S-D)), k = (c_a²+c_s²)/2: the arrival rate at which a
    G/G/1 queue's mean time in system D + k·ρ/(1-ρ)·D (Kingman) reaches S. 0 when one
    request alone already takes S or more."""
    S, D = slo_s, service_s
    if D <= 0:
        return math.inf
    if D >= S:
        return 0.0
    k = max(0.0, (ca2 + cs2) / 2.0)
    return (S - D) / (D * (k * D + S - D))


def mdl1_max_rate(slo_s: float, service_s: float) -> float:
    """R_max = 2(S-D) / (D(2S-D)): the M/D/1 case (c_a² = 1, c_s² = 0) of Kingman."""
    return kingman_max_rate(slo_s, service_s, 1.0, 0.0)


def kingman_ttft(rate: float, service_s: float, ca2: float = 1.0, cs2: float = 0.0) -> float:
    """Mean time in system D + (c_a²+c_s²)/2 · ρ/(1-ρ) · D of one worker at `rate`;
    inf at or past saturation."""
    rho_ = rate * service_s
    if rho_ >= 1.0:
        return math.inf
    return service_s + (ca2 + cs2) / 2.0 * rho_ / (1.0 - rho_) * service_s


def service_scv(profile: Profile, prompt_tokens: float, prompt_scv: float) -> float:
    """c_s² of the prefill time from the prompt-length spread c_L²: to first order,
    c_s = e·c_L with e = L·D'(L)/D(L) the profile's elasticity at the mean prompt (1
    when compute-bound, near 0 when one step's fixed cost dominates)."""
    if prompt_scv <= 0 or prompt_tokens <= 0:
        return 0.0
    d = profile.prefill_s(prompt_tokens)
    if d <= 0:
        return 0.0
    h = max(1.0, 0.05 * prompt_tokens)
    slope = (profile.prefill_s(prompt_tokens + h) - profile.prefill_s(max(0.0, prompt_tokens - h))) \
        / (prompt_tokens + h - max(0.0, prompt_tokens - h))
    e = prompt_tokens * slope / d
    return e * e * prompt_scv


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
    cs2 = service_scv(profile, w.uncached_prompt, w.prompt_scv)
    r_max = kingman_max_rate(slo.ttft_s, D, w.arrival_scv, cs2)
    frac = math.inf if (r_max == 0 and w.rate > 0) else (w.rate / r_max if r_max else 0.0)
    knee = profile.prefill_knee_tokens()
    tput = profile.prefill_tokens_per_s(knee)
    gpu_s = w.rate * w.uncached_prompt / tput * profile.tp if tput else 0.0
    return PhaseNeed(r_max, w.rate, frac, math.ceil(frac - 1e-9) if math.isfinite(frac) else -1,
                     profile.tp, gpu_s,
                     {"service_time_s": D, "r_max_per_worker": r_max,
                      "arrival_scv": w.arrival_scv, "service_scv": cs2,
                      "r_max_poisson_per_worker": mdl1_max_rate(slo.ttft_s, D),
                      "knee_tokens": knee, "knee_tokens_per_s": tput})


def prefill_ttft(w: Workload, profile: Profile, workers: int) -> float | None:
    """The bound's mean TTFT with `workers` prefill workers sharing the rate evenly
    (None without traffic or workers; inf when they saturate)."""
    if workers <= 0 or w.rate <= 0:
        return None
    D = profile.prefill_s(w.uncached_prompt)
    cs2 = service_scv(profile, w.uncached_prompt, w.prompt_scv)
    return kingman_ttft(w.rate / workers, D, w.arrival_scv, cs2)


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
    ttft: dict | None = None    # the bound's mean TTFT at the current / recommended split
    burstiness: dict | None = None  # c_a², c_s², and the split Poisson arrivals would get

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
                "fits": self.fits, "bottleneck": self.bottleneck, "why": self.why,
                "ttft": self.ttft, "burstiness": self.burstiness}


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
    # The same workload with Poisson arrivals and equal prompts (M/D/1): when its split
    # differs, burstiness is what moved the recommendation, and the plan says so.
    poisson = replace(w, arrival_scv=1.0, prompt_scv=0.0)
    pn0 = prefill_need(poisson, slo, prefill_profile)
    rec0 = best_split(total, pn0.workers, dn.workers, current)
    h_now, h_poisson = headroom(current[0], pn.workers), headroom(current[0], pn0.workers)
    burst = {"arrival_scv": w.arrival_scv, "service_scv": pn.detail["service_scv"],
             "prompt_scv": w.prompt_scv, "prefill_workers": _finite(pn.workers),
             "poisson_prefill_workers": _finite(pn0.workers),
             "poisson_split": f"{rec0[0]}+{rec0[1]}", "drives": rec0 != rec,
             # the current split's prefill falls short only because of burstiness
             "current_short": (h_now is not None and h_now < 1.0
                               and h_poisson is not None and h_poisson >= 1.0)}
    cause = (f"arrivals with c_a² = {w.arrival_scv:.1f} (Poisson = 1) and prompt-time spread "
             f"c_s² = {pn.detail['service_scv']:.2f} cut a prefill worker's rate at the TTFT "
             f"SLO from {pn0.per_worker:.2f} (M/D/1) to {pn.per_worker:.2f} req/s (Kingman)")
    if burst["drives"]:
        why += (f" Burstiness drives this: {cause}; Poisson arrivals would get "
                f"{rec0[0]}+{rec0[1]}.")
    elif burst["current_short"]:
        why += (f" Burstiness is why the current {current[0]}+{current[1]} falls short: {cause}, "
                f"so its prefill headroom is {h_now:.2f}x, not the {h_poisson:.2f}x of M/D/1.")
    ttft = {"current_s": _finite(prefill_ttft(w, prefill_profile, current[0])),
            "recommended_s": _finite(prefill_ttft(w, prefill_profile, rec[0])),
            "basis": "mean TTFT, Kingman G/G/1 per prefill worker"}
    return Sizing(asdict(w), asdict(slo), pn, dn, rho(pn, dn), current, rec, hc, hr, fits,
                  bottleneck, why, ttft, burst)


def _finite(x):
    """JSON has no infinity: a saturated queue's figure is null."""
    return None if x is None or not math.isfinite(x) else x


def _queue(p: dict) -> str:
    if p["arrival_scv"] == 1.0 and p["service_scv"] == 0.0:
        return "M/D/1"
    return f"G/G/1, c_a² {p['arrival_scv']:.1f}, c_s² {p['service_scv']:.2f}"


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
           f"{w.uncached_prompt:.0f} uncached tokens, so at mean TTFT ≤ {slo.ttft_s:g} s "
           f"({_queue(p)}) it serves {p['r_max_per_worker']:.2f} req/s; {w.rate:.2f} req/s need "
           f"{pn.workers:.2f} workers")
    dec = (f"decode: batch B* = {d['batch']} (limited by {d['batch_limited_by']}) at "
           f"{d['itl_at_batch_s'] * 1000:.1f} ms/token makes {dn.per_worker:.0f} tok/s per "
           f"worker; {dn.demand:.0f} tok/s need {dn.workers:.2f} workers")
    head = hp if phase == "prefill" else hd
    lead = (f"{phase} binds (headroom {head:.2f}x at {rec[0]}+{rec[1]})" if math.isfinite(head)
            else "no demand")
    return phase, f"{lead}. {pre}. {dec}."
