"""Reconciliation: the ledger against counters it did not compute.

`attributed + idle + unattributed = measured` holds in every device window by
construction (idle is the rest), so it cannot catch a window that never reached the
ledger. What can is a second, independent count of the same quantities, kept by the
daemon itself (not the accounting process):

- device time inside engine iterations: the engines' busy-seconds counters
  (`applianced_engine_busy_seconds_total`, per worker) × the worker's devices, against
  the ledger's attributed + unattributed device-seconds;
- energy: the energy meter's cumulative counters per device
  (`applianced_device_energy_joules_total`), against the ledger's measured joules.

Both sides are taken over the same span, and `gap = (ledger − telemetry) / telemetry`
is a signed fraction: negative when the ledger misses what the counters saw (a lost
window, a crashed accounting process, a window without an energy reading), positive
when it holds more (a clock step, a double count). The span stops `lag_s` before now:
the ledger closes a window only once its records are in (window + grace + one tick +
one commit), so the newest seconds are not yet there in a healthy run either.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

RETAIN_S = 26 * 3600.0          # a day's reports and then some
SAMPLE_S = 1.0                  # how often the daemon samples its counters


class CounterSeries:
    """Timestamped readings of one cumulative counter, interpolated between readings.

    A reading that goes backwards (a counter reset: the daemon restarted, a device was
    re-added) starts a new segment: deltas never span it."""

    __slots__ = ("t", "v", "retain_s")

    def __init__(self, retain_s: float = RETAIN_S):
        self.t: deque[float] = deque()
        self.v: deque[float] = deque()
        self.retain_s = retain_s

    def add(self, t: float, v: float) -> None:
        if self.t and t <= self.t[-1]:
            return
        self.t.append(t)
        self.v.append(v)
        while len(self.t) > 2 and t - self.t[0] > self.retain_s:
            self.t.popleft()
            self.v.popleft()

    @property
    def first(self) -> float | None:
        return self.t[0] if self.t else None

    def at(self, t: float) -> float | None:
        ts, vs = self.t, self.v
        if not ts or t < ts[0] or t > ts[-1]:
            return None
        i = bisect.bisect_left(ts, t)
        if ts[i] == t or i == 0:
            return vs[i]
        ta, tb, va, vb = ts[i - 1], ts[i], vs[i - 1], vs[i]
        if vb < va:                         # reset between the two readings
            return vb
        return va + (vb - va) * (t - ta) / (tb - ta)

    def delta(self, t0: float, t1: float) -> float | None:
        """Counter increase over [t0, t1], summed over segments; None outside the readings."""
        a, b = self.at(t0), self.at(t1)
        if a is None or b is None:
            return None
        ts, vs = self.t, self.v
        i0 = bisect.bisect_right(ts, t0)
        i1 = bisect.bisect_left(ts, t1)
        total, prev = 0.0, a
        for i in range(i0, i1):
            if vs[i] < prev:                # reset: the counter began again from 0
                total += vs[i]
            else:
                total += vs[i] - prev
            prev = vs[i]
        return total + (b - prev if b >= prev else b)


class Counters:
    """The daemon's own record of the two counters, sampled every SAMPLE_S: total busy
    device-seconds (one series) and each device's cumulative energy (one per device,
    stamped with the time of the reading, not of the sampling)."""

    def __init__(self, retain_s: float = RETAIN_S):
        self.retain_s = retain_s
        self.busy = CounterSeries(retain_s)
        self.energy: dict[str, CounterSeries] = {}

    def sample_busy(self, t: float, device_seconds: float) -> None:
        self.busy.add(t, device_seconds)

    def sample_energy(self, device: str, t: float, joules: float) -> None:
        s = self.energy.get(device)
        if s is None:
            s = self.energy[device] = CounterSeries(self.retain_s)
        s.add(t, joules)

    def busy_s(self, t0: float, t1: float) -> float | None:
        return self.busy.delta(t0, t1)

    def energy_j(self, t0: float, t1: float, devices) -> float | None:
        """Σ over `devices` of their counters' increase; None if any has no reading
        covering the span (the comparison would not be like for like)."""
        total = 0.0
        for d in devices:
            s = self.energy.get(d)
            x = s.delta(t0, t1) if s is not None else None
            if x is None:
                return None
            total += x
        return total

    def covered_from(self, devices=()) -> float | None:
        """From when every counter has readings (the energy ones of `devices` that
        have any; a device never read leaves energy unanswered instead)."""
        firsts = [self.busy.first] + [s.first for d in devices
                                      if (s := self.energy.get(d)) is not None]
        if firsts[0] is None:
            return None
        return max(firsts)


LEDGER_SQL = (
    'SELECT device, start, "end", attributed_gpu_s + unattributed_gpu_s, measured_j '
    'FROM device_windows WHERE "end" > ? AND start < ?')


FIRST_WINDOW_SQL = "SELECT min(start) FROM device_windows WHERE start >= ? AND start < ?"


def ledger_side(rows, t0: float, t1: float) -> tuple[float, float | None, set[str]]:
    """(device-seconds in iterations, measured joules or None if no window had a
    reading, devices) of the ledger's
    device windows over [t0, t1), each window prorated by its overlap (a window's
    iterations are spread evenly over it; an idle stretch has none)."""
    busy = 0.0
    joules = 0.0
    energy_known = False
    devices = set()
    for device, start, end, used, measured_j in rows:
        span = end - start
        if span <= 0:
            continue
        f = max(0.0, min(end, t1) - max(start, t0)) / span
        if f <= 0:
            continue
        devices.add(device)
        busy += (used or 0.0) * f
        if measured_j is not None:      # a window without a reading adds nothing: a gap
            energy_known = True
            joules += measured_j * f
    return busy, (joules if energy_known else None), devices


def gap(ledger: float | None, telemetry: float | None) -> float | None:
    """Signed fraction (ledger − telemetry) / telemetry; 0 when both are 0, ±1 when only
    one side saw anything, None when a side has no figure."""
    if ledger is None or telemetry is None:
        return None
    if telemetry <= 0:
        return 0.0 if ledger <= 0 else 1.0
    return (ledger - telemetry) / telemetry


@dataclass(slots=True)
class Reconciliation:
    since: float
    until: float
    gpu_ledger: float
    gpu_telemetry: float | None
    energy_ledger: float | None
    energy_telemetry: float | None
    note: str = ""

    def as_json(self) -> dict:
        out = {"since": self.since, "until": self.until,
               "gpu_seconds": {"ledger": self.gpu_ledger, "telemetry": self.gpu_telemetry,
                               "gap": gap(self.gpu_ledger, self.gpu_telemetry)},
               "energy_joules": {"ledger": self.energy_ledger,
                                 "telemetry": self.energy_telemetry,
                                 "gap": gap(self.energy_ledger, self.energy_telemetry)}}
        if self.note:
            out["note"] = self.note
        return out


def reconcile(query, counters: Counters, devices, since: float, until: float, now: float,
              lag_s: float) -> Reconciliation:
    """Both sides over [since, until) cut to what both can answer: not before the
    daemon's first counter sample, not after now − lag_s. `query` runs SQL on the ledger;
    `devices`: the accounted devices (their energy counters are summed)."""
    lo = since
    first = counters.covered_from(devices)
    notes = []
    hi = min(until, now - lag_s)
    if first is not None and first > lo:
        # The counters start inside a ledger window: the ledger side of that window
        # would be prorated over its overlap as if its busy time were spread evenly,
        # and a run that starts busy (the engine busy from mid-window on) then shows
        # a gap that is only that edge. Both sides start at the next window boundary.
        lo = first
        ((start,),) = query(FIRST_WINDOW_SQL, (first, hi))
        if start is not None:
            lo = float(start)
        notes.append("the daemon's counters start later")
    if hi < until:
        notes.append(f"the last {lag_s:g} s are not closed in the ledger yet")
    if first is None or hi <= lo:
        return Reconciliation(since, max(since, min(until, now - lag_s)), 0.0, None, None, None,
                              "no span both sides cover yet")
    rows = query(LEDGER_SQL, (lo, hi))
    busy, joules, _ = ledger_side(rows, lo, hi)
    return Reconciliation(lo, hi, busy, counters.busy_s(lo, hi), joules,
                          counters.energy_j(lo, hi, devices), "; ".join(notes))
