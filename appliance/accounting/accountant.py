"""The chargeback pipeline as one `RecordSink`: iterations and finished requests in,
ledger rows, tenant counters and budget alerts out.

On the daemon's event loop `iteration` and `request` only file what they get; `tick`
(once a second) closes the device windows that have ended, turns each window's shares
into per-request GPU-seconds, joules, cost and carbon, and writes the rows of requests
that are now final: finished, and every window that could hold one of their iterations
closed. `stop` closes the last, partial window and commits everything.
"""
from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass
from typing import Callable

from appliance.accounting.attribution import (
    Attributor, Calibration, DeviceInfo, DeviceWindow, EnergyReader,
)
from appliance.accounting.budgets import Budgets, period_start
from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon, operational_grams
from appliance.accounting.cost import PriceBook
from appliance.accounting.ledger import Ledger, WindowRow, co2e_of
from appliance.accounting.records import RequestRecord
from appliance.engines.messages import IterationRecord

log = logging.getLogger("applianced.accounting")

# Iteration records reach the daemon a little after their step ends (one socket hop);
# a window is closed this long after its end so they are in it.
GRACE_S = 1.5
# A request id that ran iterations but never finished (its record never came) is written
# as an orphan row after this long, so the rows still add up to the attributed total.
ORPHAN_AFTER_S = 600.0


@dataclass
class Site:
    name: str
    appliance: str
    region: str
    pue: float
    intensity: CarbonIntensity


class Charge:
    """What one request has accrued from closed windows. One is made per request inside
    the tick, so its figures are one flat list (one allocation, not five):
    v = [gpu_s, joules, cost_usage, cost_allocation, embodied_g], each × [prefill, decode]
    (index 2·figure + phase)."""

    __slots__ = ("v", "energy_known", "energy_source", "approximate", "simulated",
                 "last_seen")

    def __init__(self) -> None:
        self.v = [0.0] * 10
        self.energy_known = True
        self.energy_source = ""
        self.approximate = False
        self.simulated = False
        self.last_seen = 0.0


@dataclass(slots=True)
class FinalRow:
    """A request's final figures, as the metrics and budgets see them."""

    record: RequestRecord
    gpu_s: tuple[float, float]
    joules: tuple[float | None, float | None]
    cost_usage: float
    cost_allocation: float
    co2e_g: float


class Accountant:
    def __init__(self, devices: list[DeviceInfo], model: str, site: Site, ledger: Ledger,
                 prices: PriceBook, embodied: EmbodiedCarbon, budgets: Budgets | None = None,
                 meter: Callable[[], EnergyReader | None] = lambda: None,
                 read_meter: Callable[[list[str], list[tuple[float, float]]],
                                      EnergyReader | None] | None = None,
                 window_s: float = 10.0, calibration_min_iterations: int = 50,
                 on_final: Callable[[FinalRow], None] | None = None,
                 on_budget: Callable[[list], None] | None = None, grace_s: float = GRACE_S,
                 start: float | None = None, resumed: bool = False):
        self.site = site
        self.ledger = ledger
        self.prices = prices
        self.embodied = embodied
        self.budgets = budgets
        self._budget_tenants = budgets.tenants() if budgets is not None else set()
        self.meter = meter
        # In the accounting process the meter is the daemon's, a round trip away: it is
        # read once per tick for every window about to close (`read_meter`).
        self.read_meter = read_meter
        self.grace_s = grace_s
        # What the daemon has sent so far (`received`): None = no such bound (a caller
        # that hands every record over before it ticks).
        self.received_until: float | None = None
        self.on_final = on_final
        self.on_budget = on_budget
        self.calibration = Calibration(calibration_min_iterations)
        self.attributor = Attributor(devices, model, window_s, self.calibration, start, resumed)
        self._charges: dict[str, Charge] = {}
        self._finished: dict[str, RequestRecord] = {}
        self._by_finish: list[tuple[float, str]] = []        # heap: which to complete next
        self._intensity = (None, None, ())       # (second, Intensity, its ledger columns)
        self.windows_closed = 0
        self.cpu_s = 0.0            # CPU time of tick (the per-window arithmetic)
        self.requests_final = 0
        self.stopped = False

    # ---- RecordSink (event loop, hot path) -------------------------------------
    def iteration(self, rec: IterationRecord) -> None:
        self.attributor.add(rec)

    def request(self, rec: RequestRecord) -> None:
        """A request finished: it is committed at the next flush (a provisional row, with
        the figures it has so far), and its row written once its windows close."""
        self._finished[rec.request_id] = rec
        heapq.heappush(self._by_finish, (rec.finish, rec.request_id))
        self.ledger.put_provisional(self._row(rec, self._charges.get(rec.request_id), final=False))

    def received(self, sent_at: float) -> None:
        """Every record the daemon had by `sent_at` has been handed over. A window is
        closed only once records sent after its end (+ grace) are in: closing by the
        clock alone, a process behind on its inbox (nice 19 on a loaded box) closes
        windows whose records are still queued; they then come late, are all billed to
        the first open window, and what exceeds its capacity is cut off (a ledger short
        of the daemon's own busy-seconds by 10% and more under load)."""
        self.received_until = sent_at

    # ---- periodic ------------------------------------------------------------------
    def tick(self, now: float | None = None, final: bool = False) -> int:
        """Close ended windows and complete the requests they finish. Returns the number
        of request rows completed."""
        cpu0 = time.thread_time()
        try:
            return self._tick(now, final)
        finally:
            self.cpu_s += time.thread_time() - cpu0

    def _tick(self, now: float | None, final: bool) -> int:
        now = time.time() if now is None else now
        if final:
            cut = now
        elif self.received_until is None:
            cut = now - self.grace_s
        else:
            cut = min(now, self.received_until) - self.grace_s
        if self.read_meter is None:
            meter = self.meter()
        else:
            spans = [(t0, t1) for _, t0, t1 in self.attributor.spans_until(cut, final)]
            meter = self.read_meter(list(self.attributor.devices), spans) if spans else None
        windows = self.attributor.close_until(cut, meter, final=final)
        for w in windows:
            self._apply(w)
        self.windows_closed += len(windows)
        closed = self.attributor.closed_until
        done = 0
        heap = self._by_finish
        while heap and (final or heap[0][0] <= closed):
            _, rid = heapq.heappop(heap)
            rec = self._finished.pop(rid, None)
            if rec is not None:
                self._complete(rec, self._charges.pop(rid, None))
                done += 1
        if windows or final:
            self._orphans(now, final)
        return done

    def stop(self, now: float | None = None) -> None:
        """Close the last partial window, complete every finished request, commit."""
        if self.stopped:
            return
        self.stopped = True
        self.tick(now, final=True)
        self.ledger.stop()

    # ---- window -> requests ------------------------------------------------------
    def _apply(self, w: DeviceWindow) -> None:
        prices = self.prices
        # the rate card in force at the window; energy priced as facility energy (× PUE)
        rate = prices.usd_per_hour(w.model, w.start) / 3600.0
        emb_rate = self.embodied.grams_per_second(w.model)
        kwh_price = prices.per_kwh(w.start) / 3.6e6 * self.site.pue
        spare_s = w.idle_gpu_s + w.unattributed_gpu_s
        spare_j = ((w.idle_j or 0.0) + (w.unattributed_j or 0.0)) if w.measured_j is not None else 0.0
        idle_cost = spare_s * rate + spare_j * kwh_price
        share = prices.idle_policy == "share" and w.attributed_gpu_s > 0
        idle_per_s = idle_cost / w.attributed_gpu_s if share else 0.0
        j_per_s = w.j_per_s
        source, approximate, simulated, end = (w.energy_source, w.approximate, w.simulated,
                                               w.end)
        charges = self._charges
        for i, acc in ((0, w.prefill), (1, w.decode)):
            for rid, gpu_s in acc.items():
                c = charges.get(rid)
                if c is None:
                    c = charges[rid] = Charge()
                v = c.v
                v[i] += gpu_s
                usage = gpu_s * rate
                if j_per_s is None:
                    c.energy_known = False
                else:
                    joules = gpu_s * j_per_s
                    usage += joules * kwh_price
                    v[2 + i] += joules
                v[4 + i] += usage
                v[6 + i] += usage + gpu_s * idle_per_s
                v[8 + i] += gpu_s * emb_rate
                if c.energy_source != source:
                    c.energy_source = _worse(c.energy_source, source)
                c.approximate |= approximate
                c.simulated |= simulated
                c.last_seen = end
        self.ledger.put_window(WindowRow(
            w.device, w.start, w.end, self.site.name, self.site.appliance, w.model,
            w.measured_gpu_s, w.attributed_gpu_s, w.idle_gpu_s, w.unattributed_gpu_s,
            w.measured_j, w.attributed_j, w.idle_j, w.unattributed_j, w.energy_source,
            w.iterations, int(w.simulated), int(w.approximate),
            0.0 if share else idle_cost, (0.0 if share else spare_s * emb_rate)))

    def _orphans(self, now: float, final: bool) -> None:
        stale = [rid for rid, c in self._charges.items()
                 if rid not in self._finished and (final or now - c.last_seen > ORPHAN_AFTER_S)]
        for rid in stale:
            c = self._charges.pop(rid)
            t = c.last_seen or now
            rec = RequestRecord(rid, "unknown", self.attributor.model, "unknown", 0, 0, 0, t,
                                None, t, None, None, "orphan" if not final else "unfinished",
                                None, "iterations without a finished request",
                                simulated=c.simulated)
            self._complete(rec, c)

    def _complete(self, rec: RequestRecord, c: Charge | None) -> None:
        row = self._row(rec, c, final=True)
        self.ledger.put_request(row)
        self.requests_final += 1
        if c is None:
            c = Charge()
        co2e = co2e_of(row)
        v = c.v
        final = FinalRow(rec, (v[0], v[1]), (v[2], v[3]) if c.energy_known else (None, None),
                         v[4] + v[5], v[6] + v[7], co2e)
        if self.on_final is not None:
            try:
                self.on_final(final)
            except Exception:
                log.exception("accounting: on_final hook failed")
        if self.budgets is not None and rec.tenant in self._budget_tenants:
            changed = self.budgets.add(rec.tenant, rec.finish, {
                "gpu_hours": (v[0] + v[1]) / 3600.0, "usd": final.cost_allocation,
                "kgco2e": co2e / 1000.0})
            if changed and self.on_budget is not None:
                self.on_budget(changed)

    def _row(self, rec: RequestRecord, c: Charge | None, final: bool) -> tuple:
        """The request's row: `ledger.RequestRow`'s columns as a plain tuple (cheaper by
        ~3 µs a request than the NamedTuple itself; see RequestRow)."""
        second = int(rec.arrival)
        if self._intensity[0] != second:
            i = self.site.intensity.at(rec.arrival)
            self._intensity = (second, i, (i.g_per_kwh, i.provenance.source, i.provenance.kind,
                                           int(i.provenance.estimated), i.provenance.factor,
                                           self.site.pue))
        _, intensity, carbon_cols = self._intensity
        head = (rec.request_id, rec.tenant, rec.model, self.site.name, self.site.appliance,
                rec.endpoint, rec.status, rec.finish_reason, rec.arrival, rec.first_token,
                rec.finish, rec.prompt_tokens, rec.output_tokens, rec.cached_tokens,
                rec.choices, rec.prefill_worker, rec.decode_worker)
        if c is None:           # no window has reached this request yet
            return head + (0.0, 0.0, None, None, 0.0, 0.0, 0.0, 0.0, None, None, 0.0, 0.0) \
                + carbon_cols + ("none", int(rec.simulated), 0, int(final), 0,
                                 int(rec.structured))
        v = c.v
        if c.energy_known and c.energy_source not in ("", "none"):
            j0, j1 = v[2], v[3]
            op0 = operational_grams(j0, self.site.pue, intensity)
            op1 = operational_grams(j1, self.site.pue, intensity)
        else:
            j0 = j1 = op0 = op1 = None
        return head + (
            v[0], v[1], j0, j1, v[4], v[5], v[6], v[7], op0, op1, v[8], v[9]) + carbon_cols + (
            c.energy_source or "none", int(rec.simulated or c.simulated), int(c.approximate),
            int(final), 0, int(rec.structured))

    def set_budgets(self, budgets: Budgets) -> None:
        """New limits (a reload): this period's usage is read back from the ledger, and
        what this process counted for a budget it already had is kept (rows not yet
        committed are in it)."""
        old = self.budgets
        self.budgets = budgets
        self._budget_tenants = budgets.tenants()
        self.load_budgets()
        if old is None or old.period != budgets.period:
            return
        for key, s in budgets.states.items():
            prev = old.states.get(key)
            if prev is not None:
                s.used = max(s.used, prev.used)
                s.alerts = list(prev.alerts)
                s.crossed = [th for th in prev.crossed if s.ratio >= th]

    # ---- start-up -------------------------------------------------------------------
    def load_budgets(self) -> None:
        """Read the current period's usage back from the ledger (after a restart)."""
        if self.budgets is None or not self.budgets.states:
            return
        start = period_start(self.budgets.period, time.time())
        used: dict[str, dict[str, float]] = {}
        for tenant, gpu_s, usd, co2e in self.ledger.query(
                "SELECT tenant, sum(prefill_gpu_s + decode_gpu_s), "
                "sum(prefill_cost_allocation + decode_cost_allocation), "
                "sum(coalesce(prefill_co2e_op_g, 0) + coalesce(decode_co2e_op_g, 0) "
                "+ prefill_co2e_emb_g + decode_co2e_emb_g) "
                "FROM requests WHERE finish >= ? GROUP BY tenant", (start,)):
            used[tenant] = {"gpu_hours": (gpu_s or 0.0) / 3600.0, "usd": usd or 0.0,
                            "kgco2e": (co2e or 0.0) / 1000.0}
        self.budgets.load(used)

    def status(self) -> dict:
        return {"window_s": self.attributor.window_s, "windows_closed": self.windows_closed,
                "cpu_s": {"windows": self.cpu_s, "ledger_writer": self.ledger.cpu_s},
                "requests_final": self.requests_final, "pending": len(self._finished),
                "late_iterations": self.attributor.late,
                "resumed_at": self.attributor.resumed_at,
                "replayed_iterations": self.attributor.replayed, "ledger": str(self.ledger.path),
                "ledger_error": self.ledger.error, "calibration": self.calibration.describe()}


_RANK = {"": 0, "measured": 1, "estimated": 2, "simulated": 3, "none": 4}


def _worse(a: str, b: str) -> str:
    """A request's energy is as good as its least measured part."""
    return a if _RANK.get(a, 2) >= _RANK.get(b, 2) else b
