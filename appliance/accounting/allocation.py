"""The allocation basis, computed at query time over the asked window (OpenCost's model).

The ledger stores quantities: per device window the device-seconds and joules that were
attributed, idle and unattributed; per request its GPU-seconds and joules per phase. A
report over `[since, until)` prices them then:

- the **pots** (`window_pots`) come from the device windows, each clipped to the query
  window (a window that straddles an edge counts with the part inside; whole hours
  come from the window rollups, which hold the same windows clipped to the hour,
  rollups.py): capacity cost
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

from appliance.accounting import rollups
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
    # tenant -> its API keys' tags (team, project, cost_center), read from the config at
    # query time: the ledger stores the tenant only (see docs/operations/chargeback.md#tags)
    tenant_tags: dict = field(default_factory=dict)

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


# Within one interval of constant prices and intensity, whole device windows are
# summed in SQL per model (the bulk of a long report: no Python per window, which would
# hold the GIL for seconds on the daemon's process); only windows that straddle an
# interval's edge are clipped one by one. `start` bounds every query (its index): a
# window ends at most `longest` seconds after it starts (meta `max_window_s`).
_INSIDE = """SELECT model, count(*), sum(measured_gpu_s), sum(attributed_gpu_s),
    sum(idle_gpu_s), sum(unattributed_gpu_s), sum(measured_j), sum(attributed_j), sum(idle_j),
    sum(unattributed_j), sum(measured_j IS NULL), sum("end" - start),
    sum(("end" - start) * CASE WHEN measured_gpu_s > 0
        THEN attributed_gpu_s / measured_gpu_s ELSE 0 END)
FROM device_windows WHERE start >= ? AND start < ? AND "end" <= ? GROUP BY model"""
_INSIDE_SPANS = """SELECT sum("end" - start) FROM (SELECT DISTINCT start, "end" FROM device_windows
    WHERE start >= ? AND start < ? AND "end" <= ?)"""
_STRADDLING = """SELECT start, "end", model, measured_gpu_s, attributed_gpu_s, idle_gpu_s,
    unattributed_gpu_s, measured_j, attributed_j, idle_j, unattributed_j
FROM device_windows WHERE start >= ? AND start < ? AND "end" > ? AND (start < ? OR "end" > ?)"""
LONGEST = "SELECT value FROM meta WHERE key = 'max_window_s'"


class _Acc:
    """Adds quantities to the pots at one interval's prices and intensity."""

    def __init__(self, p: Pots, m: Method, t0: float, t1: float):
        self.p, self.m = p, m
        pue = m.pue
        self.kwh = m.prices.per_kwh(t0) / J_PER_KWH * pue
        self.g, self.estimated = m.intensity.mean(t0, t1)
        self.gi = self.g / J_PER_KWH * pue
        self.mi = None if m.market_g_per_kwh is None else m.market_g_per_kwh / J_PER_KWH * pue
        self.t0 = t0
        self.used = False

    def add(self, model: str, n: int, meas_s, att_s, idle_s, unatt_s, meas_j, att_j, idle_j,
            unatt_j, j_null: int, wall: float, used_wall: float, emb: float) -> None:
        p = self.p
        self.used = True
        p.models.add(model)
        p.windows += n
        p.unmeasured_windows += j_null
        rate = self.m.prices.usd_per_hour(model, self.t0) / 3600.0
        spare_j = idle_j + unatt_j
        p.capacity_cost += meas_s * rate + meas_j * self.kwh
        p.used_cost += att_s * rate + att_j * self.kwh
        p.device_seconds += meas_s
        p.attributed_s += att_s
        p.idle_s += idle_s
        p.unattributed_s += unatt_s
        p.measured_j += meas_j
        p.attributed_j += att_j
        p.idle_j += idle_j
        p.unattributed_j += unatt_j
        p.op_active_g += att_j * self.gi
        p.op_static_g += spare_j * self.gi
        if self.mi is not None:
            p.market_active_g += att_j * self.mi
            p.market_static_g += spare_j * self.mi
        p.wall_device_seconds += wall
        p.emb_used_g += used_wall * emb
        p.emb_idle_g += (wall - used_wall) * emb
        if meas_j > 0:
            p.intensity_weighted += self.g * meas_j * self.m.pue

    def node(self, covered_s: float) -> None:
        p, m = self.p, self.m
        node_j = m.node_overhead_w * covered_s
        p.covered_s += covered_s
        p.node_overhead_j += node_j
        p.capacity_cost += node_j * self.kwh
        p.op_node_g += node_j * self.gi
        if self.mi is not None:
            p.market_node_g += node_j * self.mi
        if node_j > 0:
            p.intensity_weighted += self.g * node_j * m.pue

    def close(self) -> None:
        if self.used:
            p = self.p
            p.intensity_min = self.g if p.intensity_min is None else min(p.intensity_min, self.g)
            p.intensity_max = self.g if p.intensity_max is None else max(p.intensity_max, self.g)
            p.intensity_estimated |= self.estimated


def window_pots(query, since: float, until: float, m: Method) -> Pots:
    """Sum the device windows overlapping [since, until) into pots, each part of each
    window priced and carbon-counted at the rate card and intensity of its time."""
    p = Pots()
    row = query(LONGEST)
    longest = float(row[0][0]) if row and row[0][0] is not None else None
    lo = since - longest if longest is not None else float("-inf")
    emb_rates: dict[str, float] = {}

    def emb(model: str) -> float:
        e = emb_rates.get(model)
        if e is None:
            e = emb_rates[model] = m.embodied.grams_per_second(model)
        return e

    cards = [a for a, _ in m.prices.pieces(since, until)][1:]
    cuts = sorted(set(cards) | set(m.intensity.cuts(since, until)))
    edges = [since, *cuts, until]
    node = m.node_overhead_w > 0
    for b0, b1 in zip(edges, edges[1:]):
        acc = _Acc(p, m, b0, b1)
        covered = 0.0
        # whole rolled hours from the window rollups, the rest from the windows
        for kind, a, b in rollups.window_segments(query, b0, b1):
            if kind == "hour":
                for (model, n, meas_s, att_s, idle_s, unatt_s, meas_j, att_j, idle_j, unatt_j,
                     j_null, wall, used_wall) in query(rollups.WINDOW_HOURS_SQL, (a, b)):
                    acc.add(model, n or 0, meas_s or 0.0, att_s or 0.0, idle_s or 0.0,
                            unatt_s or 0.0, meas_j or 0.0, att_j or 0.0, idle_j or 0.0,
                            unatt_j or 0.0, j_null or 0, wall or 0.0, used_wall or 0.0, emb(model))
                if a == since:
                    for model, carried, unmeasured in query(rollups.CARRIED_SQL, (a,)):
                        acc.add(model, carried, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                unmeasured, 0.0, 0.0, 0.0)
                if node:
                    ((c,),) = query(rollups.COVER_SQL, (a, b))
                    covered += c or 0.0
            else:
                covered += _raw(query, acc, a, b, since, lo, longest, emb, node)
        acc.node(covered)
        acc.close()
    return p


def _raw(query, acc: _Acc, b0: float, b1: float, since: float, lo: float,
         longest: float | None, emb, node: bool) -> float:
    """Add the device windows of [b0, b1) to `acc`, each clipped to it; the wall-clock
    time they cover."""
    for (model, n, meas_s, att_s, idle_s, unatt_s, meas_j, att_j, idle_j, unatt_j, j_null,
         wall, used_wall) in query(_INSIDE, (b0, b1, b1)):
        acc.add(model, n, meas_s or 0.0, att_s or 0.0, idle_s or 0.0, unatt_s or 0.0,
                meas_j or 0.0, att_j or 0.0, idle_j or 0.0, unatt_j or 0.0, j_null or 0,
                wall or 0.0, used_wall or 0.0, emb(model))
    covered = 0.0
    if node:
        ((covered,),) = query(_INSIDE_SPANS, (b0, b1, b1))
        covered = covered or 0.0
    spans: set[tuple[float, float]] = set()
    for (start, end, model, meas_s, att_s, idle_s, unatt_s, meas_j, att_j, idle_j,
         unatt_j) in query(_STRADDLING, (max(lo, b0 - longest) if longest is not None
                                         else lo, b1, b0, b0, b1)):
        a, b = max(start, b0), min(end, b1)
        if b <= a or end <= start:
            continue
        f = (b - a) / (end - start)
        used = att_s / meas_s if meas_s > 0 else 0.0
        first = start >= b0 or b0 == since     # count a window once, where it begins
        acc.add(model, int(first), meas_s * f, att_s * f, idle_s * f, unatt_s * f,
                (meas_j or 0.0) * f, (att_j or 0.0) * f, (idle_j or 0.0) * f,
                (unatt_j or 0.0) * f, int(first and meas_j is None), b - a, (b - a) * used,
                emb(model))
        spans.add((a, b))
    return covered + sum(b - a for a, b in spans)


def fractions(weights: list[float], fallback: list[float], counts: list[float]) -> list[float]:
    """Each row's share of a pot: by its weight; rows with no weight at all (nothing
    priced, no energy read) by GPU-seconds, then by request count."""
    for w in (weights, fallback, counts):
        total = sum(w)
        if total > 0:
            return [x / total for x in w]
    return [0.0] * len(weights)
