"""The Capacity screen's view model (`/admin/v1/plan` read defensively): any JSON renders
n/a without raising, the numbers of a real planner's answer are kept, and resampling
keeps the interval's envelope. (The screen itself: tests/integration/test_tui_capacity.py
and its snapshot in test_tui_snapshots.py.)"""
from __future__ import annotations

import pytest

from helpers.plans import synthetic_plan  # noqa: F401 (a fixture)

pytest.importorskip("textual")
from appliance.tui.views.capacity import (capacity_from_plan,  # noqa: E402
                                          render_capacity_lines, resample)


@pytest.mark.parametrize("junk", [None, [], "plan", {"forecast": 3, "rho": {"history": [1, None]}},
                                  {"recommended": {"at_peak": 5, "prefill": {"gpus": "x"}}},
                                  {"forecast": {"rate": [{"mean": None}, 7], "interval": [1]}},
                                  {"profile_source": {"prefill": 1}, "tuning": []}])
def test_any_plan_json_renders_na_without_raising(junk):
    lines = render_capacity_lines(capacity_from_plan(junk), width=80)
    assert any(ln.startswith("P+D") and ln.split()[1:] == ["n/a"] * 3 for ln in lines)
    assert "BOTTLENECK n/a" in lines


def test_plan_reading_keeps_the_numbers(synthetic_plan):
    plan = synthetic_plan
    v = capacity_from_plan(plan)
    assert v.recommended.split == plan["recommended"]["split"]
    assert v.recommended.prefill.gpus == plan["recommended"]["prefill"]["gpus"]
    assert v.at_peak.decode.gpus == plan["recommended"]["at_peak"]["decode"]["gpus"]
    assert v.rho_now == plan["rho"]["now"] and len(v.rho_forecast) == len(plan["rho"]["forecast"])
    assert v.rate_upper == tuple(p["upper"] for p in plan["forecast"]["rate"])
    assert v.rho_history == tuple(p["value"] for p in plan["rho"]["history"])
    assert v.rho_history[0] > 1 > v.rho_history[-1]          # the mix drifted to decode
    assert v.profile_badge == "SIMULATED"
    measured = {**plan, "profile_source": {ph: {**p, "source": "measured"}
                                           for ph, p in plan["profile_source"].items()}}
    assert capacity_from_plan(measured).profile_badge == "MEASURED"


def test_resample_keeps_the_interval_envelope():
    upper = [float(i % 7) for i in range(1440)]
    lower = [-x for x in upper]
    assert resample(upper, 60, "max") == [6.0] * 60
    assert resample(lower, 60, "min") == [-6.0] * 60
    assert resample([1.0, None, 3.0, 5.0], 2) == [1.0, 4.0]
    assert resample([1.0, 2.0], 60) == [1.0, 2.0]
