"""Sizing formulas against hand-computed cases, profiles, and the planner's answer when
the workload's mix moves from prefill-heavy to decode-heavy."""
from __future__ import annotations

import asyncio
import math
import random

import pytest

from appliance.accounting.records import RequestRecord
from appliance.config import PlannerConfig
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import lookup_gpu
from appliance.planner.planner import BoxShape, Planner, WhatIf, parse_whatif
from appliance.planner.profiles import Profile, load_profile, save_profile, simulated_profile
from appliance.planner.sizing import (
    Slo, Workload, best_split, decode_batch, kingman_max_rate, kingman_ttft, mdl1_max_rate,
    prefill_ttft, service_scv, size, workers_for,
)


def hand_profile(kv_tokens: int = 10_000) -> Profile:
    """Prefill: 1 ms per token + 10 ms per step; decode: 10 ms + 1 ms per sequence."""
    return Profile(
        model="m", device="X", tp=2, source="measured", created=0.0,
        prefill=[[t, 0.010 + 0.001 * t] for t in (100, 200, 400, 800, 1600)],
        decode=[[b, c, 0.010 + 0.001 * b] for b in (1, 8, 64, 256) for c in (100, 10_000)],
        kv_capacity_tokens=kv_tokens)


def test_mdl1_bound_hand_computed():
    # S = 1 s, D = 0.25 s: R_max = 2(0.75) / (0.25 * 1.75) = 1.5 / 0.4375
    assert mdl1_max_rate(1.0, 0.25) == pytest.approx(1.5 / 0.4375)
    # At R_max the M/D/1 mean time in system D + λD²/(2(1-λD)) equals S exactly.
    lam, D = mdl1_max_rate(2.0, 0.5), 0.5
    assert D + lam * D * D / (2 * (1 - lam * D)) == pytest.approx(2.0)
    assert mdl1_max_rate(1.0, 1.0) == 0.0 and mdl1_max_rate(1.0, 1.5) == 0.0
    # N_p = ceil(λ / R_max): 7 req/s at 3.43 req/s per worker -> 3 workers
    assert workers_for(7.0, 1.5 / 0.4375) == 3
    assert workers_for(6.0, 3.0) == 2 and workers_for(0.0, 3.0) == 0
    with pytest.raises(ValueError):
        workers_for(1.0, 0.0)


def test_kingman_bound_reduces_to_mdl1_and_hand_computed():
    # c_a² = 1, c_s² = 0: exactly the M/D/1 cases above.
    assert kingman_max_rate(1.0, 0.25, 1.0, 0.0) == pytest.approx(1.5 / 0.4375)
    assert kingman_max_rate(2.0, 0.5) == pytest.approx(mdl1_max_rate(2.0, 0.5))
    # S = 1, D = 0.25, c_a² = 3, c_s² = 1: k = 2, R = 0.75 / (0.25 (0.5 + 0.75)) = 2.4
    assert kingman_max_rate(1.0, 0.25, 3.0, 1.0) == pytest.approx(2.4)
    # ... where the mean time in system D + k·ρ/(1-ρ)·D is the SLO: ρ = 0.6
    assert kingman_ttft(2.4, 0.25, 3.0, 1.0) == pytest.approx(0.25 + 2 * 0.6 / 0.4 * 0.25)
    assert kingman_ttft(2.4, 0.25, 3.0, 1.0) == pytest.approx(1.0)
    assert kingman_ttft(4.0, 0.25) == math.inf                    # saturated
    # Evenly spaced arrivals and equal prompts never queue: R = 1/D.
    assert kingman_max_rate(1.0, 0.25, 0.0, 0.0) == pytest.approx(4.0)
    assert kingman_max_rate(1.0, 1.0, 5.0, 1.0) == 0.0
    # c_s² from the prompt spread: 10 ms + 1 ms per token at 400 tokens has elasticity
    # 400·0.001 / 0.41; c_L² = 0.5 -> c_s² = e²·0.5
    p = hand_profile()
    assert service_scv(p, 400, 0.5) == pytest.approx((0.4 / 0.41) ** 2 * 0.5, rel=1e-6)
    assert service_scv(p, 400, 0.0) == 0.0
    # N_p at the hand profile, 10 req/s of 400-token prompts, SLO 1 s, c_a² = 4, c_L² = 0.5
    w = Workload(10.0, 400, 100, arrival_scv=4.0, prompt_scv=0.5)
    s = size(w, Slo(1.0, 0.030), p, p, current=(4, 4), total_workers=8)
    cs2 = (0.4 / 0.41) ** 2 * 0.5
    r = (1.0 - 0.41) / (0.41 * ((4.0 + cs2) / 2 * 0.41 + 1.0 - 0.41))
    assert s.prefill.per_worker == pytest.approx(r, rel=1e-6)
    assert s.prefill.workers_needed == math.ceil(10.0 / r)
    assert s.ttft["current_s"] is None                 # 2.5 req/s x 0.41 s: saturated
    assert s.ttft["recommended_s"] == pytest.approx(
        kingman_ttft(10.0 / s.recommended[0], 0.41, 4.0, cs2))
    assert prefill_ttft(w, p, 0) is None
    # The same workload, Poisson and equal prompts: M/D/1, fewer workers.
    s0 = size(Workload(10.0, 400, 100), Slo(1.0, 0.030), p, p, current=(4, 4), total_workers=8)
    assert s0.prefill.per_worker == pytest.approx(mdl1_max_rate(1.0, 0.41))
    assert s0.prefill.workers < s.prefill.workers
    assert s0.burstiness["drives"] is False and s0.burstiness["arrival_scv"] == 1.0


def test_decode_batch_itl_and_kv_limits():
    p = hand_profile(kv_tokens=1_000_000)
    # ITL(B) = 10 ms + 1 ms * B <= 30 ms  ->  B* = 20
    b, itl, why = decode_batch(p, 0.030, 1000, 100, max_seqs=256)
    assert (b, why) == (20, "ITL") and itl == pytest.approx(0.030)
    # KV: 10,000 tokens at context 1000 + 100/2 = 1050 -> 9 sequences
    b, itl, why = decode_batch(hand_profile(10_000), 0.030, 1000, 100, max_seqs=256)
    assert (b, why) == (9, "KV pool") and itl == pytest.approx(0.019)
    b, _, why = decode_batch(p, 0.030, 1000, 100, max_seqs=4)
    assert (b, why) == (4, "max_seqs")
    assert decode_batch(p, 0.005, 1000, 100, 256)[0] == 0      # one sequence misses ITL


def test_size_hand_computed_case():
    p = hand_profile(10_000)
    w = Workload(rate=10.0, prompt_tokens=400, output_tokens=100)
    s = size(w, Slo(ttft_s=1.0, itl_s=0.030), p, p, current=(2, 2), total_workers=8)
    D = 0.010 + 0.001 * 400                                     # 0.41 s per prompt
    r_max = 2 * (1.0 - D) / (D * (2 * 1.0 - D))
    assert s.prefill.detail["service_time_s"] == pytest.approx(D)
    assert s.prefill.per_worker == pytest.approx(r_max)
    assert s.prefill.workers_needed == math.ceil(10.0 / r_max)
    # Decode: KV 10,000 / (400 + 50) = 22 sequences; ITL(22) = 32 ms > 30 ms -> B* = 20
    t_d = 20 / 0.030
    assert s.decode.detail["batch"] == 20
    assert s.decode.per_worker == pytest.approx(t_d)
    assert s.decode.workers_needed == math.ceil(10.0 * 100 / t_d)
    assert s.prefill.gpus_needed == 2 * s.prefill.workers_needed     # tp = 2
    # rho = prefill GPU-s per s / decode GPU-s per s, from the knee throughput and B*
    knee = p.prefill_knee_tokens()
    pre = 10.0 * 400 / (knee / p.prefill_s(knee)) * 2
    dec = 10.0 * 100 / t_d * 2
    assert s.rho == pytest.approx(pre / dec)
    # The split of 8 workers maximises the smaller headroom.
    need_p, need_d = 10.0 / r_max, 10.0 * 100 / t_d
    best = max(range(1, 8), key=lambda k: min(k / need_p, (8 - k) / need_d))
    assert s.recommended == (best, 8 - best)
    assert s.fits and s.bottleneck in ("prefill", "decode") and s.bottleneck in s.why


def test_bursty_arrivals_get_more_prefill_than_poisson(tmp_path):
    """Two planners, the same mean rate and mix: Poisson arrivals vs on/off bursts (every
    20 s, 2 s of arrivals at ten times the rate). The trends measure c_a² from the
    arrival times; the bursty one gets more prefill GPUs, and the plan says why."""
    from test_planner_trends import _onoff
    rng = random.Random(11)
    t0 = 1_700_000_000 // 60 * 60
    now = t0 + 900
    poisson, t = [], float(t0)
    while (t := t + rng.expovariate(2.0)) < now:
        poisson.append(t)
    bursty = _onoff(rng, t0, 900, 2.0)
    plans = {}
    for name, times in (("poisson", poisson), ("bursty", bursty)):
        pl = _planner(tmp_path / name)
        for i, t in enumerate(times):
            pl.observe(_record(i, t, 2048, 400, pl.model_name))
        plans[name] = pl.plan(now=now, use_statsmodels=False)
        pl.close()
    p, b = plans["poisson"], plans["bursty"]
    assert p["workload"]["now"]["rate"] == pytest.approx(b["workload"]["now"]["rate"], rel=0.1)
    assert 0.8 < p["burstiness"]["arrival_scv"] < 1.2 and b["burstiness"]["arrival_scv"] > 4
    assert "measured" in b["burstiness"]["source"]
    gpus = lambda d: d["recommended"]["prefill"]["gpus"]  # noqa: E731
    need = lambda d: d["recommended"]["prefill"]["gpus_needed"]  # noqa: E731
    assert need(b) > need(p) and gpus(b) > gpus(p)
    assert b["burstiness"]["drives"] is True
    assert b["burstiness"]["poisson_split"] == p["recommended"]["split"]
    assert "Burstiness drives this" in b["bottleneck"]["why"]
    assert "Burstiness" not in p["bottleneck"]["why"]
    tb = b["burstiness"]["ttft_bound"]
    assert tb["recommended_s"] < tb["current_s"] or tb["current_s"] is None


def test_best_split_hysteresis_and_no_traffic():
    assert best_split(8, 3.0, 1.0, (4, 4)) == (6, 2)
    assert best_split(8, 0.0, 0.0, (4, 4)) == (4, 4)          # no demand: keep
    assert best_split(8, 1.05, 1.0, (4, 4)) == (4, 4)         # within 10%: keep
    assert best_split(2, 5.0, 1.0, (1, 1)) == (1, 1)


def test_profile_knee_and_interpolation(tmp_path):
    # Throughput t / (0.02 + t/1000): 90% of the best (at 1600: 987.7) first reached at 200
    p = Profile(model="m", device="X", tp=1, source="measured", created=1.0,
                prefill=[[t, 0.002 + t / 1000] for t in (10, 20, 50, 100, 200, 400, 1600)],
                decode=[[1, 100, 0.01], [1, 1000, 0.02], [4, 100, 0.03], [4, 1000, 0.05]],
                kv_capacity_tokens=1000)
    assert p.prefill_knee_tokens() == 20
    assert p.prefill_s(150) == pytest.approx((0.102 + 0.202) / 2)
    assert p.decode_s(1, 550) == pytest.approx(0.015)
    assert p.decode_s(2.5, 100) == pytest.approx(0.02)
    path = save_profile(p, tmp_path)
    assert load_profile(tmp_path, "m", "X", 1).prefill == p.prefill and path.exists()
    assert load_profile(tmp_path, "m", "Y", 1) is None


def test_simulated_profile_is_roofline_shaped():
    m, h100 = lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100")
    p = simulated_profile(m, h100, 1)
    assert p.source == "simulated" and p.device == "H100-SXM" and p.kv_capacity_tokens > 0
    # Prefill compute-bound past the knee: throughput flat; decode step grows with batch.
    knee = p.prefill_knee_tokens()
    assert 16 < knee < 8192
    assert p.prefill_tokens_per_s(16) < 0.5 * p.prefill_tokens_per_s(knee)
    assert p.decode_s(64, 2048) > p.decode_s(1, 2048)
    # H200: same compute, more bandwidth -> faster decode, more KV
    p200 = simulated_profile(m, lookup_gpu("H200"), 1)
    assert p200.decode_s(8, 2048) < p.decode_s(8, 2048)
    assert p200.kv_capacity_tokens > p.kv_capacity_tokens


def _record(i: int, t: float, prompt: int, output: int, model: str) -> RequestRecord:
    return RequestRecord(f"r{i}", "t", model, "completions", prompt, output, 0, t, t + 0.2,
                         t + 0.2 + 0.03 * output, "prefill0", "decode0", "ok", "length",
                         simulated=True)


def _planner(tmp_path, **cfg) -> Planner:
    m, h100 = lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100")
    box = BoxShape(m, h100, h100, 4, 4, 1, 8, True)
    return Planner(PlannerConfig(**cfg), box, tmp_path / "ledger.db")


def test_mix_moves_from_prefill_to_decode(tmp_path):
    """An hour of long prompts / short answers, then an hour of short prompts / long
    answers at the same rate: rho falls across 1 and GPUs move from prefill to decode."""
    pl = _planner(tmp_path)
    t0 = 1_700_000_000 // 3600 * 3600
    i = 0
    for k in range(2 * 3600 // 2):                       # one request every 2 s
        t = t0 + 2 * k
        first_half = t < t0 + 3600
        pl.observe(_record(i, t, 4000 if first_half else 200, 20 if first_half else 800,
                           pl.model_name))
        i += 1
    pl.trends.flush()
    hours = pl.trends.buckets(pl.model_name, 3600, t0, t0 + 7200)
    assert [b.requests for b in hours] == [1800, 1800]
    assert hours[0].rho > 1 > hours[1].rho
    assert hours[0].prompt_mean == 4000 and hours[1].output_mean == 800

    a = pl.plan(now=t0 + 3600, use_statsmodels=False)
    b = pl.plan(now=t0 + 7200, use_statsmodels=False)
    assert a["rho"]["now"] > 1 > b["rho"]["now"]
    ra, rb = a["recommended"], b["recommended"]
    assert ra["prefill"]["workers"] > rb["prefill"]["workers"]
    assert ra["decode"]["workers"] < rb["decode"]["workers"]
    assert ra["prefill"]["workers"] + ra["decode"]["workers"] == 8
    assert ra["fits"] is True and a["current"]["fits"] in (True, False)
    assert rb["decode"]["gpus"] > rb["prefill"]["gpus"]
    assert a["bottleneck"]["phase"] in ("prefill", "decode") and a["bottleneck"]["why"]
    assert a["profile_source"]["prefill"]["source"] == "simulated"
    assert a["cost"]["usd_per_day"] == pytest.approx(8 * 3.0 * 24)
    pl.close()


def test_whatif_changes_the_answer(tmp_path):
    pl = _planner(tmp_path)
    t0 = 1_700_000_000
    rng = random.Random(3)          # Poisson arrivals (evenly spaced ones never queue)
    t = float(t0)
    for k in range(600):
        pl.observe(_record(k, t, 2000, 100, pl.model_name))
        t = min(t0 + 599.0, t + rng.expovariate(1.0))
    base = pl.plan(now=t0 + 600, use_statsmodels=False)
    more = pl.plan(now=t0 + 600, whatif=WhatIf(traffic_x=20), use_statsmodels=False)
    need = lambda d: d["recommended"]["prefill"]["gpus_needed"]  # noqa: E731
    assert need(more) > need(base)
    assert more["workload"]["now"]["rate"] == pytest.approx(20 * base["workload"]["now"]["rate"])
    h200 = pl.plan(now=t0 + 600, whatif=WhatIf(gpu="H200"), use_statsmodels=False)
    assert h200["profile_source"]["decode"]["device"] == "H200"
    assert h200["cost"]["usd_per_day"] == pytest.approx(8 * 4.0 * 24)
    tight = pl.plan(now=t0 + 600, whatif=WhatIf(ttft_slo=0.28), use_statsmodels=False)
    assert tight["slo"]["ttft_s"] == 0.28 and need(tight) > need(base)
    mix = pl.plan(now=t0 + 600, whatif=WhatIf(prompt_tokens=100, output_tokens=2000),
                  use_statsmodels=False)
    assert mix["rho"]["now"] < 1 < base["rho"]["now"]
    with pytest.raises(ValueError, match="unknown GPU"):
        parse_whatif({"gpu": "V100"})
    with pytest.raises(ValueError, match="traffic_x must be a positive"):
        parse_whatif({"traffic_x": "-2"})
    with pytest.raises(ValueError, match="itl_slo must be a number"):
        parse_whatif({"itl_slo": "fast"})
    pl.close()


def test_auto_apply_after_the_configured_time(tmp_path):
    pl = _planner(tmp_path, auto_apply=True, auto_apply_after_s=600.0)
    calls = []

    async def start(split: str) -> dict:
        calls.append(split)
        return {"id": "wf1", "status": "pending"}

    pl.start_repartition = start
    t0 = 1_700_000_000
    for k in range(900):                                     # prefill-heavy: not 4+4
        pl.observe(_record(k, t0 + k, 6000, 10, pl.model_name))

    async def run():
        first = await pl.auto_apply_tick(now=t0 + 900)       # starts the clock
        mid = await pl.auto_apply_tick(now=t0 + 1200)        # 300 s < 600 s
        late = await pl.auto_apply_tick(now=t0 + 1600)       # 700 s: apply
        return first, mid, late

    first, mid, late = asyncio.run(run())
    assert first is None and mid is None and calls == [late["split"]]
    p, d = map(int, late["split"].split("+"))
    assert p > d and p + d == 8 and late["workflow"]["id"] == "wf1"

    off = _planner(tmp_path / "off", auto_apply=False, auto_apply_after_s=1.0)
    off.start_repartition = start
    for k in range(900):
        off.observe(_record(k, t0 + k, 6000, 10, off.model_name))
    asyncio.run(off.auto_apply_tick(now=t0 + 900))
    asyncio.run(off.auto_apply_tick(now=t0 + 2000))
    assert calls == [late["split"]]                          # off by default: never called
    pl.close()
    off.close()


def test_planner_follows_the_live_box(tmp_path):
    """After a repartition the planner plans on the split that runs; when a phase's GPU
    type changes its profile (and the cached per-request estimate) follows."""
    from dataclasses import replace as dc_replace
    pl = _planner(tmp_path)
    live = [pl.box]
    pl.box_source = lambda: live[0]
    rec = _record(1, 1_700_000_000, 2000, 100, pl.model_name)
    before = pl._estimate(rec)
    live[0] = dc_replace(pl.box, prefill_workers=6, decode_workers=2)
    out = pl.plan(now=1_700_000_100.0, use_statsmodels=False)
    assert out["current"]["split"] == "6+2" and pl._estimate(rec) == before
    h200 = lookup_gpu("H200")
    live[0] = dc_replace(pl.box, prefill_gpu=h200, decode_gpu=h200)
    out = pl.plan(now=1_700_000_100.0, use_statsmodels=False)
    assert out["profile_source"]["prefill"]["device"] == "H200"
    assert pl._estimate(rec) != before                    # H200 decodes faster
    # A model swap: the trends read are the new model's, its profiles are sized for it.
    on_h200 = pl._estimate(rec)
    served = ["llama-3.1-8b"]
    pl.served_name = lambda: served[0]
    live[0] = dc_replace(live[0], model=lookup_model_spec("llama-3.1-8b"))
    out = pl.plan(now=1_700_000_100.0, use_statsmodels=False)
    assert pl.model_name == out["model"] == "llama-3.1-8b"
    assert pl.prefill_profile.model == pl.decode_profile.model == live[0].model.name
    assert pl._estimate(rec) < on_h200                    # an 8B model costs less
    pl.close()


def test_planner_config_section():
    from appliance import config
    cfg = config.parse('[planner]\nttft_slo_s = 0.5\nitl_slo_s = 0.02\nhorizon = "7d"\n'
                       'auto_apply = true\nauto_apply_after_s = 60\n')
    assert (cfg.planner.ttft_slo_s, cfg.planner.horizon, cfg.planner.auto_apply) == (0.5, "7d", True)
    assert config.parse_duration("90m") == 5400 and config.parse_duration("2w") == 1209600
    for text, message in [
        ("[planner]\nttft_slo_s = 0", "planner.ttft_slo_s must be positive"),
        ("[planner]\nquantile = 1.5", "planner.quantile must be within"),
        ('[planner]\nhorizon = "soon"', "planner.horizon: malformed duration"),
        ('[planner]\nhorizon = "10w"', "planner.horizon: longer than 8 weeks"),
        ("[planner]\nauto_apply = 1", "planner.auto_apply must be true or false"),
        ("[planner]\nslo = 1", "unknown key planner.slo"),
    ]:
        with pytest.raises(config.ConfigError, match=message):
            config.parse(text)


def test_mixed_box_placement_is_explained(tmp_path):
    """sim:4xH100+4xL40S: the partition plan puts prefill on the L40S (most FLOP/s per $)
    and decode on the H100 (most bandwidth per $); the planner sizes each phase on its
    own GPU type and says why."""
    from types import SimpleNamespace

    from appliance.config import EngineConfig
    from appliance.partitions import discover, plan_partition
    from appliance.planner.planner import box_from_setup
    inv = discover("sim:4xH100+4xL40S")
    plan = plan_partition(inv)
    setup = SimpleNamespace(inventory=inv, plan=plan, simulated=True, model_dir=tmp_path)
    box = box_from_setup(setup, EngineConfig(model_spec="llama-3.1-8b"))
    assert (box.prefill_gpu.name, box.decode_gpu.name) == ("L40S", "H100-SXM")
    assert box.current == (4, 4) and box.total_gpus == 8
    pl = Planner(PlannerConfig(), box, tmp_path / "ledger.db")
    out = pl.plan(now=1_700_000_000.0, use_statsmodels=False)
    assert out["profile_source"]["prefill"]["device"] == "L40S"
    assert out["profile_source"]["decode"]["device"] == "H100-SXM"
    assert out["placement"]["prefill"] == "L40S" and "Splitwise" in out["placement"]["why"]
    assert out["cost"]["usd_per_day"] == pytest.approx((4 * 0.86 + 4 * 3.00) * 24)
    pl.close()


def test_a_closed_planner_is_freed(tmp_path):
    """Its per-request cost estimates are cached on the planner, not in a method cache
    of functools that would keep every planner ever built (and its profiles) alive."""
    import gc
    import weakref
    pl = _planner(tmp_path)
    rec = _record(1, 1_700_000_000, 2000, 100, pl.model_name)
    assert pl._estimate(rec) == pl._estimate(rec) != (0.0, 0.0)
    pl.close()
    gone = weakref.ref(pl)
    del pl
    gc.collect()
    assert gone() is None
