"""A Capacity plan to draw: what the real planner answers for a fixed history."""
from __future__ import annotations

import json
import math

import pytest


@pytest.fixture(scope="module")
def synthetic_plan(tmp_path_factory) -> dict:
    """What the real planner answers after three hours of traffic whose rate swells
    and whose mix drifts from long prompts to long answers (one request every 2-10 s),
    on a simulated 8xH100 at a fixed clock, with the built-in forecaster."""
    from appliance.config import PlannerConfig
    from appliance.models.specs import lookup_model_spec
    from appliance.partitions.catalogue import lookup_gpu
    from appliance.planner.planner import Planner
    from appliance.planner.planner import BoxShape
    from appliance.accounting.records import RequestRecord
    m, h100 = lookup_model_spec("llama-3.1-70b-fp8"), lookup_gpu("H100")
    pl = Planner(PlannerConfig(horizon="3h"), BoxShape(m, h100, h100, 4, 4, 1, 8, True),
                 tmp_path_factory.mktemp("plan") / "ledger.db")
    t0 = 1_700_000_000 // 3600 * 3600
    t, i = float(t0), 0
    while t < t0 + 3 * 3600:
        x = (t - t0) / (3 * 3600)
        prompt, output = int(4000 - 3500 * x), int(20 + 600 * x)
        pl.observe(RequestRecord(f"r{i}", "t", pl.model_name, "completions", prompt, output, 0,
                                 t, t + 0.2, t + 0.2 + 0.03 * output, "prefill0", "decode0",
                                 "ok", "length", simulated=True))
        t += 10 - 8 * math.sin(math.pi * x) ** 2
        i += 1
    try:
        return json.loads(json.dumps(pl.plan(now=t0 + 3 * 3600, use_statsmodels=False)))
    finally:
        pl.close()
