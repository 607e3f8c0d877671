"""Fleet roles (issue 29): which whole boxes take prefill and which decode, sized with
the planner's own model on each GPU kind's profile at the fleet's forecast peak."""
from __future__ import annotations

import math

import pytest

from appliance.planner.fleet_roles import (
    BoxCapacity, FleetNeed, assign, box_capacity, config_snippets, fleet_need, plan_roles,
)
from appliance.planner.sizing import Slo, Workload, decode_need, prefill_need

MODEL = "llama-3.1-8b"
SLO = {"ttft_s": 2.0, "itl_s": 0.05}
DECODE_HEAVY = {"prompt_tokens": 300.0, "output_tokens": 600.0}     # chat with long answers
PREFILL_HEAVY = {"prompt_tokens": 2000.0, "output_tokens": 25.0}    # code completion


def plan_of(name: str, gpu: str, gpus: int, rate: float, mix: dict, role: str = "both",
            tp: int = 1) -> dict:
    """The parts of a box's `GET /admin/v1/plan` the role planner reads."""
    return {"site": {"name": "s", "appliance": name}, "model": MODEL, "simulated": True,
            "slo": dict(SLO), "horizon_s": 7 * 86400,
            "box": {"model_spec": MODEL, "tp": tp, "gpus": gpus,
                    "workers": [{"device": gpu, "count": gpus // tp}], "max_seqs": 256,
                    "gpu_mem_fraction": 0.9, "kv_cache_bytes": 0, "profile_source": "simulated"},
            "workload": {"upper_peak": {"rate": rate, **mix, "prefix_hit": 0.0,
                                        "arrival_scv": 1.0, "prompt_scv": 0.0}},
            "cluster": {"role": role, "peers": []}}


def test_decode_heavy_trend_over_three_8xh100_boxes_picks_one_prefill_two_decode():
    plans = [plan_of(f"box{i}", "H100", 8, 40.0, DECODE_HEAVY) for i in range(3)]
    r = plan_roles([(f"http://b{i}:8000", p) for i, p in enumerate(plans)])
    roles = [b["role"] for b in r["roles"]]
    assert sorted(roles) == ["decode", "decode", "prefill"]
    # The numbers behind it are the sizing model's, on the H100 profile, at the fleet's mix.
    need = fleet_need(plans)
    assert need.rate == 120.0 and need.decode_tps == pytest.approx(120.0 * 600)
    box = r["roles"][0]
    assert r["capacity"]["prefill"] == pytest.approx(box["prefill_rps"], rel=1e-3)
    assert r["capacity"]["decode"] == pytest.approx(2 * box["decode_tps"], rel=1e-3)
    assert r["headroom"]["decode"] < r["headroom"]["prefill"]
    assert "1 prefill + 2 decode" in r["why"] and "decode binds" in r["why"]
    # Two prefill boxes would leave decode with half: a smaller smallest headroom.
    two_p = r["capacity"]["decode"] / 2 / need.decode_tps
    assert r["headroom"]["decode"] == pytest.approx(2 * two_p, rel=1e-3)


def test_prefill_heavy_trend_flips_the_majority_to_prefill():
    plans = [plan_of(f"box{i}", "H100", 8, 300.0, PREFILL_HEAVY) for i in range(3)]
    r = plan_roles([(f"http://b{i}:8000", p) for i, p in enumerate(plans)])
    assert sorted(b["role"] for b in r["roles"]) == ["decode", "prefill", "prefill"]


def test_heterogeneous_boxes_prefill_goes_to_the_kind_relatively_better_at_it():
    # L40S: more FLOP/s per byte/s of bandwidth than H100 (Splitwise's comparative
    # advantage): it takes prefill when decode is what the fleet needs most ...
    h100, l40s = plan_of("h100-box", "H100", 8, 6.0, DECODE_HEAVY), \
        plan_of("l40s-box", "L40S", 4, 6.0, DECODE_HEAVY)
    r = plan_roles([("http://h:1", h100), ("http://l:1", l40s)])
    by = {b["appliance"]: b for b in r["roles"]}
    assert by["l40s-box"]["role"] == "prefill" and by["h100-box"]["role"] == "decode"
    bias = {n: b["prefill_rps"] / b["decode_tps"] for n, b in by.items()}
    assert bias["l40s-box"] > bias["h100-box"]
    assert r["fits"]
    # ... and the need, not the label, decides: prompts of 2000 tokens at 100 req/s
    # need more prefill than 4 L40S make, so the H100 box prefills.
    h100, l40s = plan_of("h100-box", "H100", 8, 50.0, PREFILL_HEAVY), \
        plan_of("l40s-box", "L40S", 4, 50.0, PREFILL_HEAVY)
    r = plan_roles([("http://h:1", h100), ("http://l:1", l40s)])
    by = {b["appliance"]: b["role"] for b in r["roles"]}
    assert by == {"h100-box": "prefill", "l40s-box": "decode"}


def test_capacity_is_the_sizing_model_at_the_fleet_workload():
    plans = [plan_of("a", "H100", 8, 2.0, DECODE_HEAVY), plan_of("b", "H100", 8, 6.0, PREFILL_HEAVY)]
    need = fleet_need(plans)
    # Rate-weighted mix: (2*300 + 6*2000) / 8 prompt tokens.
    assert need.workload["prompt_tokens"] == pytest.approx((2 * 300 + 6 * 2000) / 8)
    assert need.workload["output_tokens"] == pytest.approx((2 * 600 + 6 * 25) / 8)
    from appliance.planner.fleet_roles import _profiles
    (prof,) = _profiles(plans[0]["box"], plans[0]["box"]["workers"])
    cap = box_capacity("http://a", plans[0], need)
    w, slo = Workload(**need.workload), Slo(**need.slo)
    assert cap.prefill_rps == pytest.approx(8 * prefill_need(w, slo, prof).per_worker)
    assert cap.decode_tps == pytest.approx(8 * decode_need(w, slo, prof, 256).per_worker)
    assert cap.shape == "8xH100 tp1" and cap.gpus == 8 and "simulated profile" in cap.basis


def test_a_measured_or_unknown_model_falls_back_to_the_box_own_figures():
    p = plan_of("cpu-box", "cpu", 2, 1.0, DECODE_HEAVY)
    p["box"]["model_spec"] = "my-finetune"          # not a catalogue shape
    p["sizing"] = {"peak": {"prefill": {"per_worker": 0.5}, "decode": {"per_worker": 40.0}}}
    cap = box_capacity("http://c", p, fleet_need([p]))
    assert (cap.prefill_rps, cap.decode_tps) == (1.0, 80.0)
    assert "own plan" in cap.basis


def test_one_box_keeps_both_and_adding_one_shows_the_split():
    r = plan_roles([("http://a:1", plan_of("a", "H100", 8, 40.0, DECODE_HEAVY))])
    assert [b["role"] for b in r["roles"]] == ["both"]
    assert "one box" in r["why"]
    assert r["config"] == {"a": '[cluster]\nrole = "both"\n'}
    (added,) = r["if_added"]
    assert added["shape"] == "8xH100 tp1" and added["roles"] == {"a": "prefill"}
    assert added["role"] == "decode"


def test_what_if_added_puts_the_new_box_where_the_fleet_binds():
    plans = [plan_of(f"box{i}", "H100", 8, 60.0, DECODE_HEAVY) for i in range(3)]
    r = plan_roles([(f"http://b{i}:8000", p) for i, p in enumerate(plans)])
    (added,) = r["if_added"]
    assert added["role"] == "decode"                    # decode binds: the 4th box decodes
    assert min(added["headroom"].values()) > min(r["headroom"].values())


def test_ties_follow_prefill_bias_then_current_roles():
    fast_p = BoxCapacity("u1", "l40s", "4xL40S", 4, 20.0, 5000.0, "t")
    fast_d = BoxCapacity("u2", "h100", "8xH100", 8, 20.0, 60000.0, "t")
    idle = FleetNeed(0.0, 0.0, {}, SLO)
    a = assign([fast_d, fast_p], idle)                  # no traffic: every split ties
    assert a.roles == {"l40s": "prefill", "h100": "decode"}
    same = [BoxCapacity(f"u{i}", f"b{i}", "8xH100", 8, 10.0, 100.0, "t",
                        role_now="decode" if i == 0 else "prefill") for i in range(2)]
    a = assign(same, FleetNeed(5.0, 50.0, {}, SLO))
    assert a.roles == {"b0": "decode", "b1": "prefill"}  # equal boxes: nothing moves


def test_a_short_fleet_says_so_and_large_fleets_stay_fast():
    boxes = [BoxCapacity(f"u{i}", f"b{i}", "8xH100", 8, 10.0, 1000.0, "t") for i in range(20)]
    a = assign(boxes, FleetNeed(500.0, 50000.0, {}, SLO))   # 20 boxes: ranked cuts only
    assert not a.fits and a.score < 1
    n_p = sum(r == "prefill" for r in a.roles.values())
    # max-min of 10*n_p/500 and 1000*(20-n_p)/50000: n_p = 10 balances them
    assert n_p == 10 and a.score == pytest.approx(0.2)
    with pytest.raises(ValueError, match="same name"):
        assign(boxes[:1] * 2, FleetNeed(1.0, 1.0, {}, SLO))


def test_config_snippets_peer_each_role_with_the_other():
    boxes = [BoxCapacity("https://p1:8443", "p1", "s", 8, 1.0, 1.0, "t"),
             BoxCapacity("https://d1:8443", "d1", "s", 8, 1.0, 1.0, "t"),
             BoxCapacity("https://d2:8443", "d2", "s", 8, 1.0, 1.0, "t")]
    a = assign(boxes, FleetNeed(0.0, 0.0, {}, SLO))
    a.roles = {"p1": "prefill", "d1": "decode", "d2": "decode"}
    snip = config_snippets(boxes, a)
    assert 'role = "prefill"\npeers = ["https://d1:8443", "https://d2:8443"]' in snip["p1"]
    assert 'role = "decode"\npeers = ["https://p1:8443"]' in snip["d2"]
    # Each snippet (with a real key) is a valid [cluster] table.
    import tomllib

    from appliance.config import ClusterConfig, _validate_cluster
    for text in snip.values():
        table = tomllib.loads(text.replace("<the same cluster key on every box, 16+ characters>",
                                           "k" * 16))["cluster"]
        _validate_cluster(ClusterConfig(**table))


def test_unservable_phase_is_zero_capacity_not_a_crash():
    # 4 GPUs of L40S cannot hold the ITL SLO for a 70B model: decode capacity 0.
    p = plan_of("l", "L40S", 4, 5.0, DECODE_HEAVY, tp=2)
    p["box"]["model_spec"] = "llama-3.1-70b-fp8"
    q = plan_of("h", "H100", 8, 5.0, DECODE_HEAVY)
    q["box"]["model_spec"] = "llama-3.1-70b-fp8"
    r = plan_roles([("http://l:1", p), ("http://h:1", q)])
    by = {b["appliance"]: b for b in r["roles"]}
    assert by["l"]["decode_tps"] == 0.0 and by["l"]["role"] == "prefill"
    assert all(math.isfinite(v) for v in r["capacity"].values())


def test_boxes_under_one_name_are_told_apart_by_url():
    a, b = plan_of("same", "H100", 8, 10.0, DECODE_HEAVY), plan_of("same", "H100", 8, 10.0,
                                                                     DECODE_HEAVY)
    r = plan_roles([("http://a:1", a), ("http://b:1", b)])
    assert [x["appliance"] for x in r["roles"]] == ["http://a:1", "http://b:1"]
    assert sorted(x["role"] for x in r["roles"]) == ["decode", "prefill"]


def test_a_phase_with_zero_capacity_binds():
    boxes = [BoxCapacity("u1", "p", "s", 8, 0.0, 10.0, "t"), BoxCapacity("u2", "d", "s", 8, 0.0, 10.0, "t")]
    need = FleetNeed(1.0, 10.0, {}, SLO)
    from appliance.planner.fleet_roles import explain
    a = assign(boxes, need)
    assert a.headroom["prefill"] == 0.0 and not a.fits
    assert explain(boxes, a, need).endswith("prefill binds")


def test_a_plan_without_its_box_uses_its_own_figures_and_current_workers():
    p = plan_of("old", "H100", 8, 1.0, DECODE_HEAVY)
    del p["box"]                                        # an appliance from before `box`
    p["current"] = {"prefill": {"workers": 2}, "decode": {"workers": 6}}
    p["sizing"] = {"peak": {"prefill": {"per_worker": 3.0}, "decode": {"per_worker": 500.0}}}
    cap = box_capacity("http://old", p, fleet_need([p]))
    assert (cap.prefill_rps, cap.decode_tps, cap.shape) == (24.0, 4000.0, "?")
