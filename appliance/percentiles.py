"""One percentile for every latency figure the appliance shows: the live p50/p99 of the
telemetry hub (status, /metrics, the TUI) and the replayed p50/p90/p99 of the capacity
planner's trace replay. Two definitions would make a replayed p90 and a live one differ
on the same latencies; this is the one both use."""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least a `q` share of the
    values at or below it (`q` in [0, 1]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
