"""What a device-second costs: `$/GPU-hour` per device model plus an optional energy price.

Two bases, as OpenCost has them:
- usage: only what a request ran (its GPU-seconds × price + its joules × energy price);
- allocation: the bill. Each window's idle and unattributed device time (and energy) is
  either shared back to that window's requests in proportion to their usage
  (`idle_policy = "share"`) or kept as an "(idle)" line of its own (`"idle"`). A window
  with no request at all has nobody to share with: its cost stays idle under both
  policies. usage ÷ allocation is then the device's utilization.
"""
from __future__ import annotations

from dataclasses import dataclass

from appliance.partitions.catalogue import CPU_USD_PER_HOUR, lookup_gpu


def catalogue_price(model: str) -> float:
    if model == "cpu":
        return CPU_USD_PER_HOUR
    try:
        return lookup_gpu(model).usd_per_hour
    except ValueError:
        return 0.0


@dataclass
class PriceBook:
    overrides: dict[str, float]         # device model -> $/device-hour
    usd_per_kwh: float = 0.0
    idle_policy: str = "share"          # share | idle

    def usd_per_hour(self, model: str) -> float:
        if model in self.overrides:
            return self.overrides[model]
        return catalogue_price(model)

    def cost(self, model: str, gpu_s: float, joules: float | None) -> float:
        usd = gpu_s * self.usd_per_hour(model) / 3600.0
        if joules and self.usd_per_kwh:
            usd += joules / 3.6e6 * self.usd_per_kwh
        return usd
