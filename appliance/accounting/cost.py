"""What a device-second costs: versioned rate cards of a price per device-hour (by device
model) and per kWh of facility energy.

Why versioned: the ledger stores quantities (GPU-seconds, joules) and a report prices
them when it is asked, so a price must be known for every moment in the past. A rate
card holds from its `effective` time until the next card; a report prices each device
window at the card in force then (`pieces` cuts a span at card boundaries). A price
change is a new card and reprices nothing before it; a wrong card can be corrected and
the report re-run.

The base card (in force before every dated card) is the catalogue's `usd_per_hour`
(when the currency is USD: the catalogue's prices are dollars) with the
`[accounting] usd_per_gpu_hour` overrides and `usd_per_kwh`. A dated card names the
prices that change from then on; models and the energy price it does not name keep
the previous card's.

The energy price applies to facility energy (IT energy × PUE): the utility bills the
building, not the boards.

Two bases, as OpenCost has them, computed at query time (`allocation.py`): usage (what
the requests ran) and allocation (the bill: the devices' whole capacity cost of the
query window, idle shared over the tenants by usage or kept as an `(idle)` row).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime, timezone

from appliance.partitions.catalogue import CPU_USD_PER_HOUR, lookup_gpu

DEFAULT_CURRENCY = "USD"


def catalogue_price(model: str) -> float:
    """The catalogue's $/device-hour (0 for a model it does not know)."""
    if model == "cpu":
        return CPU_USD_PER_HOUR
    try:
        return lookup_gpu(model).usd_per_hour
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class RateCard:
    """Prices from `effective` (unix seconds) until the next card. `per_device_hour`
    names only what changes; `per_kwh` None keeps the previous card's."""

    effective: float
    per_device_hour: dict[str, float] = field(default_factory=dict)
    per_kwh: float | None = None


@dataclass
class PriceBook:
    overrides: dict[str, float]         # device model -> price per device-hour (base card)
    usd_per_kwh: float = 0.0            # base card's energy price (per kWh of facility energy)
    idle_policy: str = "share"          # share | idle
    currency: str = DEFAULT_CURRENCY
    cards: list[RateCard] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cards = sorted(self.cards, key=lambda c: c.effective)
        self._starts = [c.effective for c in self.cards]

    def _card_index(self, t: float | None) -> int:
        """-1: the base card; i: cards[i]."""
        if t is None or not self.cards:
            return -1
        return bisect.bisect_right(self._starts, t) - 1

    def usd_per_hour(self, model: str, t: float | None = None) -> float:
        """Price per device-hour of `model` at time `t` (None: the base card), in the
        book's currency (the name is historical)."""
        for card in reversed(self.cards[:self._card_index(t) + 1]):
            if model in card.per_device_hour:
                return card.per_device_hour[model]
        if model in self.overrides:
            return self.overrides[model]
        return catalogue_price(model) if self.currency == DEFAULT_CURRENCY else 0.0

    def per_kwh(self, t: float | None = None) -> float:
        for card in reversed(self.cards[:self._card_index(t) + 1]):
            if card.per_kwh is not None:
                return card.per_kwh
        return self.usd_per_kwh

    def priced(self, model: str) -> bool:
        """Whether some card or the catalogue names a price for `model`."""
        return (model in self.overrides or any(model in c.per_device_hour for c in self.cards)
                or (self.currency == DEFAULT_CURRENCY and catalogue_price(model) > 0))

    def pieces(self, t0: float, t1: float) -> list[tuple[float, float]]:
        """[t0, t1) cut at the cards' effective times inside it."""
        cuts = [t for t in self._starts if t0 < t < t1]
        edges = [t0, *cuts, t1]
        return list(zip(edges, edges[1:]))

    def cost(self, model: str, gpu_s: float, joules: float | None, t: float | None = None,
             pue: float = 1.0) -> float:
        usd = gpu_s * self.usd_per_hour(model, t) / 3600.0
        kwh = self.per_kwh(t)
        if joules and kwh:
            usd += joules * pue / 3.6e6 * kwh
        return usd

    def describe(self, models: list[str]) -> dict:
        """The cards as `GET /admin/v1/rates` shows them: each resolved for `models`."""
        out = [{"effective": None, "per_device_hour": {m: self.usd_per_hour(m, None) for m in models},
                "per_kwh": self.per_kwh(None),
                "note": "base: [accounting] usd_per_gpu_hour / usd_per_kwh over the catalogue"
                        + ("" if self.currency == DEFAULT_CURRENCY else
                           " (catalogue prices are USD: not used in " + self.currency + ")")}]
        for c in self.cards:
            out.append({"effective": datetime.fromtimestamp(c.effective, timezone.utc)
                        .isoformat().replace("+00:00", "Z"),
                        "per_device_hour": {m: self.usd_per_hour(m, c.effective) for m in models},
                        "per_kwh": self.per_kwh(c.effective),
                        "named": {"per_device_hour": dict(c.per_device_hour),
                                  "per_kwh": c.per_kwh}})
        return {"currency": self.currency, "energy_basis": "facility energy (IT energy x PUE)",
                "cards": out, "unpriced_models": [m for m in models if not self.priced(m)]}
