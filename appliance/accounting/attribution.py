"""Who used the device: per-request, phase-aware GPU-seconds and joules inside batches.

A continuous batch runs many requests in one iteration, so a device-second belongs to
nobody in particular until we say how to split it. We split each iteration's wall time
τ over its requests by weight w (`gpu_s[r] += τ·w[r]/Σw` per device), with weights that
follow what the work costs: a prompt chunk costs per token plus an attention term that
grows with the context, a decoding sequence costs a fixed share plus its context. The
weights are fitted per model × device from the iteration records themselves
(`Calibration`), so a long prompt is not billed like a thousand decode steps.

Time is cut into aligned windows per device. When a window closes, every device-second
in it is one of three things, and they add up to what was there (the invariant the
ledger and every report keep):

    attributed (requests) + idle (no iteration ran) + unattributed = measured

and the same for energy: idle = calibrated idle power × Δt (capped at the reading),
active = the rest, spread over the window's iterations by wall time, then over each
iteration's requests by weight; active energy in a window with no iteration (or with
iterations that carried no request) is unattributed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Protocol

import numpy as np

from appliance.engines.messages import IterationRecord

PREFILL, DECODE = "prefill", "decode"
PHASES = (PREFILL, DECODE)


class EnergyReader(Protocol):
    """What accounting reads energy through: the telemetry hub in the daemon (its
    `telemetry.EnergyMeter`), `Readings` in the accounting process."""

    def energy_j(self, device: str, t0: float, t1: float) -> tuple[float | None, str]: ...
    def idle_power_w(self, device: str) -> float | None: ...


class Readings:
    """An EnergyReader over readings taken in one go: the accounting process runs apart
    from the daemon's telemetry and asks it once per tick for every window it closes."""

    __slots__ = ("energy", "idle")

    def __init__(self, energy: dict[tuple[str, float, float], tuple[float | None, str]],
                 idle: dict[str, float | None]):
        self.energy = energy
        self.idle = idle

    def energy_j(self, device: str, t0: float, t1: float) -> tuple[float | None, str]:
        return self.energy.get((device, t0, t1), (None, "none"))

    def idle_power_w(self, device: str) -> float | None:
        return self.idle.get(device)


def take_readings(meter: EnergyReader | None, devices: list[str],
                  spans: list[tuple[float, float]]) -> Readings:
    """Read `meter` for every device over every span (a meter that fails gives "not
    measured" for that reading, never an exception)."""
    energy: dict[tuple[str, float, float], tuple[float | None, str]] = {}
    idle: dict[str, float | None] = {}
    if meter is None:
        return Readings(energy, idle)
    for d in devices:
        for t0, t1 in spans:
            try:
                energy[(d, t0, t1)] = meter.energy_j(d, t0, t1)
            except Exception:
                energy[(d, t0, t1)] = (None, "none")
        try:
            idle[d] = meter.idle_power_w(d)
        except Exception:
            idle[d] = None
    return Readings(energy, idle)


_CONTEXT = itemgetter(2)            # an entry's context length


def request_of(engine_id: str) -> str:
    """Choice ids `R.1`, `R.2` run as engine requests of their own; they bill to `R`."""
    return engine_id.partition(".")[0]


def entry_phase(rec_phase: str, new_tokens: int) -> str:
    """The phase an entry is billed to. `kv_import` (copying a prompt's KV into the decode
    pool) is part of decoding it. In a `mixed` step the prompt chunks carry their chunk's
    tokens and the decoding sequences one each, so an entry with more than one new token
    is a prefill (a 1-token prompt chunk is billed as decode: the same cost, near enough)."""
    if rec_phase == PREFILL:
        return PREFILL
    if rec_phase == "mixed":
        return PREFILL if new_tokens > 1 else DECODE
    return DECODE


@dataclass(slots=True)
class PhaseWeights:
    """Seconds of device time each entry costs at the margin, in one unit for both phases
    (so a mixed step can weigh a prompt chunk against a decoding sequence):
    prefill w = new × (p_tok + p_ctx·context) = new × p_tok × (1 + a·context), a = p_ctx/p_tok;
    decode  w = d_seq + d_ctx·context."""

    p_tok: float = 1.0
    p_ctx: float = 0.0
    d_seq: float = 1.0
    d_ctx: float = 0.0
    calibrated: bool = False
    samples: int = 0

    def weight(self, phase: str, new_tokens: int, context: int) -> float:
        if phase == PREFILL:
            return new_tokens * (self.p_tok + self.p_ctx * context)
        return self.d_seq + self.d_ctx * context


DEFAULT_WEIGHTS = PhaseWeights()


class Calibration:
    """Least squares of iteration time on batch composition, per model × device × phase.

    prefill: τ ≈ c0 + p_tok·Σnew + p_ctx·Σ(new·context)
    decode:  τ ≈ c0 + d_seq·n     + d_ctx·Σcontext
    The intercept (per-step overhead) is not a weight: it is spread with the rest. Only
    pure prefill and decode steps are fitted (mixed steps reuse both fits; kv_import is a
    copy, not a model step). Until both phases have `min_iterations` steps, or when a fit
    gives a non-positive per-token or per-sequence cost, the defaults hold (one prompt
    token weighs like one decoding sequence, no context term).
    """

    def __init__(self, min_iterations: int = 50):
        self.min_iterations = min_iterations
        # (key, phase) -> [n, Σx1, Σx2, Σx1², Σx1x2, Σx2², Σy, Σx1y, Σx2y]
        self._sums: dict[tuple[str, str], list[float]] = {}
        self._fits: dict[str, PhaseWeights] = {}
        self._dirty: set[str] = set()

    def observe(self, key: str, rec: IterationRecord) -> None:
        if rec.phase == PREFILL:
            x1 = x2 = 0.0
            for _, new, ctx in rec.entries:
                x1 += new
                x2 += new * ctx
        elif rec.phase == DECODE:
            x1 = float(len(rec.entries))
            x2 = float(sum(map(_CONTEXT, rec.entries)))
        else:
            return
        if not rec.entries or rec.wall_s <= 0:
            return
        s = self._sums.get((key, rec.phase))
        if s is None:
            s = self._sums[(key, rec.phase)] = [0.0] * 9
        y = rec.wall_s
        s[0] += 1; s[1] += x1; s[2] += x2; s[3] += x1 * x1; s[4] += x1 * x2
        s[5] += x2 * x2; s[6] += y; s[7] += x1 * y; s[8] += x2 * y
        self._dirty.add(key)

    def _solve(self, s: list[float]) -> tuple[float, float] | None:
        n, x1, x2, x11, x12, x22, y, x1y, x2y = s
        if n < max(self.min_iterations, 3):
            return None
        a = np.array([[n, x1, x2], [x1, x11, x12], [x2, x12, x22]], dtype=float)
        b = np.array([y, x1y, x2y], dtype=float)
        # a touch of ridge: a feature that never varies (every decode batch of one
        # sequence) must not make the system singular
        a += np.diag([0.0, 1e-9 * max(a[1, 1], 1.0), 1e-9 * max(a[2, 2], 1.0)])
        try:
            _, k1, k2 = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            return None
        if not (math.isfinite(k1) and math.isfinite(k2)):
            return None
        return float(k1), max(float(k2), 0.0)

    def weights(self, key: str) -> PhaseWeights:
        if key in self._dirty:
            self._dirty.discard(key)
            self._fits[key] = self._fit(key)
        return self._fits.get(key, DEFAULT_WEIGHTS)

    def _fit(self, key: str) -> PhaseWeights:
        pre, dec = self._sums.get((key, PREFILL)), self._sums.get((key, DECODE))
        fp = self._solve(pre) if pre else None
        fd = self._solve(dec) if dec else None
        if fp is None or fd is None or fp[0] <= 0:
            return DEFAULT_WEIGHTS
        d_seq, d_ctx = fd
        if d_seq <= 0 and d_ctx <= 0:
            return DEFAULT_WEIGHTS
        # A decoding sequence must always weigh something: a negative per-sequence cost
        # (the intercept took it) is floored at a tenth of the context-1 cost.
        d_seq = max(d_seq, 0.1 * (d_seq + d_ctx) if d_seq + d_ctx > 0 else 1e-9, 1e-12)
        return PhaseWeights(fp[0], fp[1], d_seq, d_ctx, True, int(pre[0] + dec[0]))

    def describe(self) -> dict[str, dict]:
        out = {}
        for key in {k for k, _ in self._sums}:
            w = self.weights(key)
            out[key] = {"calibrated": w.calibrated, "samples": w.samples,
                        "prefill_s_per_token": w.p_tok, "prefill_s_per_token_context": w.p_ctx,
                        "decode_s_per_seq": w.d_seq, "decode_s_per_context": w.d_ctx,
                        "a": w.p_ctx / w.p_tok if w.p_tok else 0.0,
                        "b": w.d_seq, "c": w.d_ctx}
        return out


@dataclass(slots=True)
class DeviceInfo:
    """One accounted device. `capacity` = worker slots on it: 1 for a GPU; on the CPU each
    worker runs on its own pinned cores, so a CPU device shared by a prefill and a decode
    worker offers 2 device-seconds per second."""

    id: str
    model: str                  # catalogue name ("H100-SXM") or "cpu": price, carbon, calibration
    kind: str                   # gpu | cpu | sim
    simulated: bool
    capacity: int = 1
    idle_w: float | None = None   # catalogue fallback when the meter has no calibration


@dataclass(slots=True)
class DeviceWindow:
    """One device over one window: the row the conservation check reads."""

    device: str
    model: str
    start: float
    end: float
    measured_gpu_s: float
    attributed_gpu_s: float
    idle_gpu_s: float
    unattributed_gpu_s: float
    measured_j: float | None
    attributed_j: float | None
    idle_j: float | None
    unattributed_j: float | None
    energy_source: str          # measured | estimated | simulated | none
    iterations: int
    simulated: bool
    approximate: bool
    # request id -> GPU-seconds, per phase; each request's joules are its GPU-seconds ×
    # `j_per_s` (active energy per busy second; None: energy not measured)
    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)
    j_per_s: float | None = None

    @property
    def shares(self) -> dict[tuple[str, str], list]:
        """(request id, phase) -> [gpu_s, joules or None]: the window's split, whole."""
        j = self.j_per_s
        return {(rid, ph): [g, g * j if j is not None else None]
                for ph, acc in ((PREFILL, self.prefill), (DECODE, self.decode))
                for rid, g in acc.items()}


class Attributor:
    """Collects iteration records into windows and splits each closed window.

    `add` is on the daemon's hot path (once per engine step): it only files the record.
    The arithmetic happens in `close_until`, once per window.
    """

    def __init__(self, devices: list[DeviceInfo], model: str, window_s: float = 10.0,
                 calibration: Calibration | None = None, start: float | None = None):
        import time
        self.devices = {d.id: d for d in devices}
        self.model = model
        self.window_s = window_s
        self.calibration = calibration or Calibration()
        self.started = time.time() if start is None else start
        self.closed_until = self.started          # every window before this is closed
        self._windows: dict[int, list[tuple[IterationRecord, float]]] = {}
        self.late = 0                             # records that came after their window closed

    def _index(self, t: float) -> int:
        return int(t // self.window_s)

    def add(self, rec: IterationRecord) -> None:
        start, end = rec.start, rec.start + rec.wall_s
        if start < self.closed_until:
            # its window already closed: bill it to the first open one (with all of its
            # time; close_until caps busy time at capacity, so conservation still holds)
            self.late += 1
            self._windows.setdefault(self._index(self.closed_until), []).append((rec, rec.wall_s))
            return
        k0, k1 = self._index(start), self._index(end)
        if k0 == k1:
            self._windows.setdefault(k0, []).append((rec, rec.wall_s))
            return
        for k in range(k0, k1 + 1):
            lo, hi = max(start, k * self.window_s), min(end, (k + 1) * self.window_s)
            if hi > lo:
                self._windows.setdefault(k, []).append((rec, hi - lo))

    def spans_until(self, t: float, final: bool = False) -> list[tuple[int, float, float]]:
        """The windows `close_until(t, final)` would close, as (index, start, end), without
        closing them: the accounting process asks the daemon's meter for all of them in
        one round trip before it closes any."""
        out = []
        closed = self.closed_until
        while closed < t:
            k = self._index(closed)
            end = (k + 1) * self.window_s
            if end <= closed:                  # float rounding at a boundary
                k += 1
                end = (k + 1) * self.window_s
            if k not in self._windows:
                # no iteration until the next filed window: one row for the whole idle
                # stretch (a night, or the VM's clock jumping), not one per window
                nxt = min((j for j in self._windows if j > k), default=None)
                last = self._index(t) * self.window_s
                stretch = min(nxt * self.window_s, last) if nxt is not None else last
                end = max(end, stretch)
            if end > t:
                if not final:
                    break
                end = t
            out.append((k, closed, end))
            closed = end
        return out

    def close_until(self, t: float, meter: EnergyReader | None,
                    final: bool = False) -> list[DeviceWindow]:
        """Close every window that ends at or before `t`; with `final` (shutdown) also the
        one `t` falls in, cut at `t`. Returns one DeviceWindow per device per window."""
        out: list[DeviceWindow] = []
        for k, start, end in self.spans_until(t, final):
            records = self._windows.pop(k, [])
            out.extend(self._close(start, end, records, meter))
            self.closed_until = end
        if final:   # anything filed beyond t (clock skew) is dropped with the last window
            self._windows.clear()
        return out

    def _close(self, t0: float, t1: float, records: list[tuple[IterationRecord, float]],
               meter: EnergyReader | None) -> list[DeviceWindow]:
        dt = t1 - t0
        cal = self.calibration
        per_device: dict[str, list[tuple[IterationRecord, float]]] = {d: [] for d in self.devices}
        for rec, tau in records:
            for dev in rec.devices:
                if dev in per_device:
                    per_device[dev].append((rec, tau))
        for dev_id, its in per_device.items():
            # a step spread over several devices (tensor parallel) is one observation, of
            # its first device's model; a window's list holds each step once
            key = f"{self.model}|{self.devices[dev_id].model}"
            for rec, _ in its:
                if rec.devices[0] == dev_id:
                    cal.observe(key, rec)
        out = []
        for dev_id, its in per_device.items():
            info = self.devices[dev_id]
            out.append(self._device_window(info, t0, t1, dt, its, meter,
                                           cal.weights(f"{self.model}|{info.model}")))
        return out

    @staticmethod
    def _device_window(info: DeviceInfo, t0: float, t1: float, dt: float,
                       its: list[tuple[IterationRecord, float]], meter: EnergyReader | None,
                       weights: PhaseWeights) -> DeviceWindow:
        measured = info.capacity * dt
        busy = sum(tau for _, tau in its)
        scale = measured / busy if busy > measured else 1.0   # clock jitter, late records
        energy, source = (None, "none")
        if meter is not None:
            try:
                energy, source = meter.energy_j(info.id, t0, t1)
            except Exception:       # a meter that fails is "not measured", not a crash
                energy, source = None, "none"
        idle_e = active_e = None
        if energy is not None:
            energy = max(float(energy), 0.0)
            idle_w = None
            if meter is not None:
                try:
                    idle_w = meter.idle_power_w(info.id)
                except Exception:
                    idle_w = None
            if idle_w is None:
                idle_w = info.idle_w or 0.0
            idle_e = min(idle_w * dt, energy)
            active_e = energy - idle_e
        busy_scaled = busy * scale
        # Every iteration gets active energy in proportion to its time, so within one
        # device window a request's joules are its GPU-seconds × (active / busy): only
        # the GPU-seconds are split entry by entry (the one per-token loop of accounting).
        pre: dict[str, float] = {}
        dec: dict[str, float] = {}
        attributed = unattributed = 0.0
        approximate = False
        p_tok, p_ctx, d_seq, d_ctx = weights.p_tok, weights.p_ctx, weights.d_seq, weights.d_ctx
        for rec, tau in its:
            tau *= scale
            approximate |= rec.approximate
            entries = rec.entries
            phase = rec.phase
            if phase == PREFILL:
                ws = [new * (p_tok + p_ctx * ctx) for _, new, ctx in entries]
                total = sum(ws)
                if total <= 0:
                    unattributed += tau
                    continue
                k = tau / total
                for (rid, _, _), w in zip(entries, ws):
                    if "." in rid:
                        rid = rid.partition(".")[0]
                    pre[rid] = pre.get(rid, 0.0) + w * k
            elif phase != "mixed":          # decode, kv_import: Σw = n·d_seq + d_ctx·Σcontext
                total = len(entries) * d_seq + d_ctx * sum(map(_CONTEXT, entries))
                if total <= 0:
                    unattributed += tau
                    continue
                k = tau / total
                k_seq, k_ctx = d_seq * k, d_ctx * k
                for rid, _, ctx in entries:
                    if "." in rid:
                        rid = rid.partition(".")[0]
                    dec[rid] = dec.get(rid, 0.0) + k_seq + k_ctx * ctx
            else:
                kinds = [entry_phase(phase, new) for _, new, _ in entries]
                ws = [weights.weight(ph, new, ctx) for ph, (_, new, ctx) in zip(kinds, entries)]
                total = sum(ws)
                if total <= 0:
                    unattributed += tau
                    continue
                k = tau / total
                for (rid, _, _), ph, w in zip(entries, kinds, ws):
                    rid = request_of(rid)
                    acc = pre if ph == PREFILL else dec
                    acc[rid] = acc.get(rid, 0.0) + w * k
            attributed += tau
        j_per_s = None
        if energy is not None:
            j_per_s = active_e / busy_scaled if busy_scaled > 0 else 0.0
        att_e = unatt_e = None
        if energy is not None:
            att_e = attributed * j_per_s
            unatt_e = unattributed * j_per_s if busy_scaled > 0 else active_e
        return DeviceWindow(
            device=info.id, model=info.model, start=t0, end=t1, measured_gpu_s=measured,
            attributed_gpu_s=attributed, idle_gpu_s=max(measured - busy_scaled, 0.0),
            unattributed_gpu_s=unattributed, measured_j=energy,
            attributed_j=att_e, idle_j=idle_e,
            unattributed_j=unatt_e, energy_source=source, iterations=len(its),
            simulated=info.simulated, approximate=approximate, prefill=pre, decode=dec,
            j_per_s=j_per_s)
