"""The allocation basis, computed at query time over the asked window (OpenCost's model).

The ledger stores quantities: per device window the device-seconds and joules that were
attributed, idle and unattributed; per request its GPU-seconds and joules per phase. A
report over `[since, until)` prices them then:

- the **pots** (`window_pots`) come from the device windows, each clipped to the query
  window (a window that straddles an edge counts with the part inside): capacity cost
  = every device-second × the device model's rate + facility energy (IT energy × PUE,
  plus the stated node overhead) × the energy price, each piece at the rate card in
  force then; operational carbon = that facility energy × the grid intensity then;
  embodied carbon = every planned device's wall-clock time × embodied ÷ lifetime. Each
  pot is split into what requests ran (attributed) and the rest (idle, static,
  unattributed, node overhead).
- the **weights** come from the request rows that finished in the window: each row's
  stored usage (cost, operational and embodied grams at the rates of when it ran) says
  what share of the window's work was its.
- a row gets its weight's share of the pots: with `idle_policy = "share"` of the whole
  pot (so Σ allocation = capacity cost of the window, whatever the window), with
  `"idle"` of the attributed part, the rest being an `(idle)` row. A window with no
  request in it has nobody to share with: its whole pot is the `(idle)` row under both
  policies (say so, never drop it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon
from appliance.accounting.cost import PriceBook

J_PER_KWH = 3.6e6


@dataclass
class Method:
    """What a report prices and counts with: the daemon builds it from the config."""

    prices: PriceBook
    embodied: EmbodiedCarbon
    pue: float = 1.56
    intensity: CarbonIntensity = field(default_factory=lambda: CarbonIntensity(480.0))
    market_g_per_kwh: float | None = None       # None: no market-based column
    node_overhead_w: float = 0.0

    @property
    def idle_policy(self) -> str:
        return self.prices.idle_policy

    @property
    def currency(self) -> str:
        return self.prices.currency


@dataclass
class Pots:
    """The query window's capacity as money and carbon, split by what requests ran."""

    capacity_cost: float = 0.0
    used_cost: float = 0.0              # attributed device-seconds and their energy
    device_seconds: float = 0.0
    wall_device_seconds: float = 0.0    # devices × wall-clock time (embodied carbon)
    attributed_s: float = 0.0
    idle_s: float = 0.0
    unattributed_s: float = 0.0
    measured_j: float = 0.0
    attributed_j: float = 0.0
    idle_j: float = 0.0
    unattributed_j: float = 0.0
    node_overhead_j: float = 0.0
    covered_s: float = 0.0              # wall-clock time the windows cover
    op_active_g: float = 0.0            # location-based, attributed energy
    op_static_g: float = 0.0            # idle + unattributed energy
    op_node_g: float = 0.0              # node overhead
    market_active_g: float = 0.0
    market_static_g: float = 0.0
    market_node_g: float = 0.0
    emb_used_g: float = 0.0
    emb_idle_g: float = 0.0
    windows: int = 0
    unmeasured_windows: int = 0
    intensity_min: float | None = None
    intensity_max: float | None = None
    intensity_weighted: float = 0.0     # Σ I × facility J (÷ facility J = energy-weighted mean)
    intensity_estimated: bool = False
    models: set = field(default_factory=set)

    @property
    def idle_cost(self) -> float:
        return self.capacity_cost - self.used_cost

    @property
    def op_g(self) -> float:
        return self.op_active_g + self.op_static_g + self.op_node_g

    @property
    def market_g(self) -> float:
        return self.market_active_g + self.market_static_g + self.market_node_g

    @property
    def emb_g(self) -> float:
        return self.emb_used_g + self.emb_idle_g

    @property
    def facility_j(self) -> float:
        return self.measured_j + self.node_overhead_j


# device windows grouped by span and model: the devices of one model share every span
_SPANS = """SELECT start, "end", model, count(*), sum(measured_gpu_s), sum(attributed_gpu_s),
    sum(idle_gpu_s), sum(unattributed_gpu_s), sum(measured_j), sum(attributed_j), sum(idle_j),
    sum(unattributed_j), sum(measured_j IS NULL)
FROM device_windows WHERE start < ? AND "end" > ? GROUP BY start, "end", model ORDER BY start"""


def window_pots(query, since: float, until: float, m: Method) -> Pots:
    """Sum the device windows overlapping [since, until) into pots, each piece of each
    window priced and carbon-counted at the rate card and intensity of its time."""
    p = Pots()
    pue, node_w = m.pue, m.node_overhead_w
    market = m.market_g_per_kwh
    seen_spans: set[tuple[float, float]] = set()
    emb_rates: dict[str, float] = {}
    for (start, end, model, n, meas_s, att_s, idle_s, unatt_s, meas_j, att_j, idle_j, unatt_j,
         j_null) in query(_SPANS, (until, since)):
        a, b = max(start, since), min(end, until)
        if b <= a or end <= start:
            continue
        p.models.add(model)
        p.windows += n
        p.unmeasured_windows += j_null or 0
        meas_j, att_j = meas_j or 0.0, att_j or 0.0
        spare_j = (idle_j or 0.0) + (unatt_j or 0.0)
        emb = emb_rates.get(model)
        if emb is None:
            emb = emb_rates[model] = m.embodied.grams_per_second(model)
        used_frac = att_s / meas_s if meas_s > 0 else 0.0
        new_span = (start, end) not in seen_spans
        seen_spans.add((start, end))
        for p0, p1 in m.prices.pieces(a, b):
            f = (p1 - p0) / (end - start)
            rate = m.prices.usd_per_hour(model, p0) / 3600.0
            kwh = m.prices.per_kwh(p0) / J_PER_KWH * pue
            g, estimated = m.intensity.mean(p0, p1)
            gi = g / J_PER_KWH * pue
            p.capacity_cost += meas_s * f * rate + meas_j * f * kwh
            p.used_cost += att_s * f * rate + att_j * f * kwh
            p.device_seconds += meas_s * f
            p.attributed_s += att_s * f
            p.idle_s += idle_s * f
            p.unattributed_s += unatt_s * f
            p.measured_j += meas_j * f
            p.attributed_j += att_j * f
            p.idle_j += (idle_j or 0.0) * f
            p.unattributed_j += (unatt_j or 0.0) * f
            p.op_active_g += att_j * f * gi
            p.op_static_g += spare_j * f * gi
            if market is not None:
                mi = market / J_PER_KWH * pue
                p.market_active_g += att_j * f * mi
                p.market_static_g += spare_j * f * mi
            wall = n * (p1 - p0)
            p.wall_device_seconds += wall
            p.emb_used_g += wall * emb * used_frac
            p.emb_idle_g += wall * emb * (1.0 - used_frac)
            facility = meas_j * f * pue
            if new_span:
                node_j = node_w * (p1 - p0)
                p.covered_s += p1 - p0
                p.node_overhead_j += node_j
                p.capacity_cost += node_j * kwh
                p.op_node_g += node_j * gi
                if market is not None:
                    p.market_node_g += node_j * market / J_PER_KWH * pue
                facility += node_j * pue
            if facility > 0:
                p.intensity_weighted += g * facility
            p.intensity_min = g if p.intensity_min is None else min(p.intensity_min, g)
            p.intensity_max = g if p.intensity_max is None else max(p.intensity_max, g)
            p.intensity_estimated |= estimated
    return p


def fractions(weights: list[float], fallback: list[float], counts: list[float]) -> list[float]:
    """Each row's share of a pot: by its weight; rows with no weight at all (nothing
    priced, no energy read) by GPU-seconds, then by request count."""
    for w in (weights, fallback, counts):
        total = sum(w)
        if total > 0:
            return [x / total for x in w]
    return [0.0] * len(weights)
