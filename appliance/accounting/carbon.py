"""Grid intensity and embodied carbon: the inputs of the SCI specification (ISO/IEC 21031)

    SCI = (E × I + M) per R

E is all energy of the provisioned devices (idle and static included) × PUE, I the
grid's intensity at the time, M the devices' embodied carbon × wall-clock time ÷
lifetime. The query-time sums and their allocation to requests are in `allocation.py`;
this module says what I and M are at a given time. Every figure carries where its
intensity came from (`Provenance`): an air-gapped box reads files, so the operator must
be able to tell a measured grid mix from a yearly average, and a location-based figure
(the grid) from a market-based one (contracts, certificates: GHG Protocol Scope 2).
"""
from __future__ import annotations

import bisect
import csv
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from appliance.partitions.catalogue import CPU_EMBODIED_KGCO2E, CPU_LIFETIME_YEARS, lookup_gpu

log = logging.getLogger("applianced.carbon")

YEAR_S = 365.25 * 24 * 3600


@dataclass(frozen=True, slots=True)
class Provenance:
    source: str             # "static" | "file:<name>"
    kind: str               # average | marginal
    estimated: bool         # the value itself is a forecast or estimate
    factor: str = ""        # emissionFactorType from the file (lifecycle, direct), if given
    basis: str = "location"  # location (the grid: SCI) | market (contracts, certificates)


@dataclass(frozen=True, slots=True)
class Intensity:
    g_per_kwh: float
    provenance: Provenance


def parse_time(text: str) -> float:
    """ISO 8601 (with Z or an offset; naive = UTC) -> unix seconds."""
    t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def _truthy(value) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("true", "1", "yes")


STALE_MIN_S = 3600.0


class CarbonIntensity:
    """I(site, t): a static value, or a step function over a time series (each point holds
    until the next, as Electricity Maps' hourly history reads). Before the first point the
    first holds, after the last the last: a file that has run out is still the best guess,
    and the figure says `estimated`.

    Staleness is judged at every point, not only after the last: a point used more than
    max(1 h, 2 × the series' median step) after its own time is `estimated` (a gap of a
    day in the middle of a file is as much a guess as the day after its end)."""

    def __init__(self, static_g_per_kwh: float, kind: str = "average",
                 series: list[tuple[float, float, bool, str]] | None = None, source: str = "static"):
        self.static = static_g_per_kwh
        self.kind = kind
        self.source = source
        self._times = [p[0] for p in series] if series else []
        self._points = series or []
        self.stale_after_s = _stale_after(self._times)
        self.path: Path | None = None
        self._mtime = 0.0
        self._checked = 0.0

    @classmethod
    def from_file(cls, path: str | Path, kind: str = "average") -> "CarbonIntensity":
        """Electricity Maps-style CSV or JSON: `datetime`, `carbonIntensity` (gCO2eq/kWh),
        `isEstimated`, `emissionFactorType`. JSON may be a list of points or an object with
        a `history` or `data` list. Raises ValueError with one line on a bad file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"carbon intensity file {path}: cannot read: {exc.strerror}") from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
                if isinstance(data, dict):
                    data = data.get("history") or data.get("data") or []
                rows = list(data)
            else:
                rows = list(csv.DictReader(text.splitlines()))
        except ValueError as exc:
            raise ValueError(f"carbon intensity file {path}: not valid: {exc}") from None
        points = []
        for i, row in enumerate(rows, 1):
            try:
                t = parse_time(str(row["datetime"]))
                value = float(row["carbonIntensity"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"carbon intensity file {path}: entry {i} needs datetime and "
                                 f"carbonIntensity (gCO2eq/kWh)") from None
            if value < 0:
                raise ValueError(f"carbon intensity file {path}: entry {i} is negative")
            points.append((t, value, _truthy(row.get("isEstimated", False)),
                           str(row.get("emissionFactorType") or "")))
        if not points:
            raise ValueError(f"carbon intensity file {path}: no data points")
        points.sort()
        ci = cls(points[0][1], kind, points, f"file:{path.name}")
        ci.path, ci._mtime = path, path.stat().st_mtime
        return ci

    def _reload(self) -> None:
        """An air-gapped box gets its grid data as files dropped in place: a changed file
        is read again (checked at most once a second); a broken one keeps the old data."""
        now = time.monotonic()
        if self.path is None or now - self._checked < 1.0:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            fresh = CarbonIntensity.from_file(self.path, self.kind)
        except ValueError as exc:
            log.warning("%s; keeping the previous intensity data", exc)
            return
        self._times, self._points = fresh._times, fresh._points
        self.stale_after_s = fresh.stale_after_s

    def at(self, t: float) -> Intensity:
        self._reload()
        if not self._points:
            return Intensity(self.static, Provenance("static", self.kind, False))
        i = bisect.bisect_right(self._times, t) - 1
        # before the series, or used too long after its point: a guess
        outside = i < 0 or t - self._times[i] > self.stale_after_s
        _, value, estimated, factor = self._points[max(i, 0)]
        return Intensity(value, Provenance(self.source, self.kind, estimated or outside, factor))

    def cuts(self, t0: float, t1: float) -> list[float]:
        """The series' point times inside (t0, t1): where the intensity may change."""
        self._reload()
        times = self._times
        return times[bisect.bisect_right(times, t0):bisect.bisect_left(times, t1)]

    def mean(self, t0: float, t1: float) -> tuple[float, bool]:
        """Time-weighted mean intensity over [t0, t1) and whether any part of it was
        estimated (stale, or marked so in the file). A device window's energy is taken
        as spread evenly over the window."""
        if not self._points or t1 <= t0:
            i = self.at(t0)
            return i.g_per_kwh, i.provenance.estimated
        self._reload()
        times = self._times
        lo = max(bisect.bisect_right(times, t0) - 1, 0)
        hi = bisect.bisect_left(times, t1)
        edges = [t0, *[t for t in times[lo + 1:hi] if t0 < t < t1], t1]
        acc = 0.0
        estimated = False
        for a, b in zip(edges, edges[1:]):
            # a piece is stale from its point's time + stale_after_s on
            i = self.at(a)
            acc += i.g_per_kwh * (b - a)
            estimated |= i.provenance.estimated
            j = bisect.bisect_right(times, a) - 1
            if j >= 0 and b - times[j] > self.stale_after_s:
                estimated = True
        return acc / (t1 - t0), estimated


def _stale_after(times: list[float]) -> float:
    """max(1 h, 2 × the median step) of a series (1 h for a single point)."""
    steps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    if not steps:
        return STALE_MIN_S
    n = len(steps)
    median = steps[n // 2] if n % 2 else (steps[n // 2 - 1] + steps[n // 2]) / 2
    return max(STALE_MIN_S, 2.0 * median)




@dataclass
class EmbodiedCarbon:
    """Device embodied kgCO2e spread over its lifetime: grams per device-second."""

    overrides_kg: dict[str, float]
    overrides_years: dict[str, float]

    def grams_per_second(self, model: str) -> float:
        if model == "cpu":
            kg, years = CPU_EMBODIED_KGCO2E, CPU_LIFETIME_YEARS
        else:
            try:
                spec = lookup_gpu(model)
                kg, years = spec.embodied_kgco2e, spec.lifetime_years
            except ValueError:
                kg, years = 0.0, 5.0
        kg = self.overrides_kg.get(model, kg)
        years = self.overrides_years.get(model, years)
        return kg * 1000.0 / (years * YEAR_S)


def operational_grams(joules: float | None, pue: float, intensity: Intensity) -> float | None:
    if joules is None:
        return None
    return joules / 3.6e6 * pue * intensity.g_per_kwh
