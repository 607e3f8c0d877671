"""Who used the device: per-request, phase-aware GPU-seconds and joules inside batches.

A continuous batch runs many requests in one iteration, so a device-second belongs to
nobody in particular until we say how to split it. A step's time τ is a shared part c0
(the weight read, the launches: every entry in the step causes it alike) plus each
entry's own marginal part m[r] (its tokens, its context), both fitted per served model ×
device kind from the iteration records themselves (`Calibration`). Each entry gets

    share[r] = (c0/n + m[r]) · τ / (c0 + Σm)

the Shapley value of a fixed-plus-additive cost, scaled so the shares sum to τ exactly.
Spreading c0 in proportion to m instead would bill a long-context sequence for weight
reads it did not cause (measured: 4.7× per output token where the device's own cost
differs by ~1.1×). docs/operations/chargeback-method.md has the method and its why.

Time is cut into aligned windows per device. When a window closes, every device-second
in it is one of three things, and they add up to what was there (the invariant the
ledger and every report keep):

    attributed (requests) + idle (no iteration ran) + unattributed = measured

and the same for energy: idle = calibrated idle power × Δt (capped at the reading),
active = the rest, spread over the window's iterations by wall time, then over each
iteration's requests by the same shares; active energy in a window with no iteration (or with
iterations that carried no request) is unattributed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Callable, Protocol

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
class PhaseFit:
    """One phase's fitted step-time model: τ ≈ c0 + k_tok·x1 + k_ctx·x2 (see Calibration).
    `status` says how it was reached: "fit", "constrained" (the free fit had a negative
    term, named in `note`; the least-squares fit without it is used), or "default"."""

    c0: float = 0.0
    k_tok: float = 1.0
    k_ctx: float = 0.0
    status: str = "default"
    note: str = ""
    samples: int = 0
    rmse_s: float | None = None         # root-mean-square residual of the fit, seconds
    mean_s: float | None = None         # mean step time of the fitted steps

    @property
    def calibrated(self) -> bool:
        return self.status != "default"


@dataclass(slots=True)
class PhaseWeights:
    """What a step costs, per phase, in seconds: the shared part `c0` of a step and each
    entry's own (marginal) part:
    prefill m = new × (p_tok + p_ctx·(context − new/2))   (a chunk's own attention triangle)
    decode  m = d_seq + d_ctx·context.
    The defaults (nothing fitted yet): no shared part, one prompt token weighs like one
    decoding sequence, no context term."""

    p_tok: float = 1.0
    p_ctx: float = 0.0
    d_seq: float = 1.0
    d_ctx: float = 0.0
    calibrated: bool = False
    samples: int = 0
    p_c0: float = 0.0
    d_c0: float = 0.0

    def weight(self, phase: str, new_tokens: int, context: int) -> float:
        """An entry's marginal cost (its own part of a step)."""
        if phase == PREFILL:
            return new_tokens * (self.p_tok + self.p_ctx * (context - new_tokens / 2))
        return self.d_seq + self.d_ctx * context


DEFAULT_WEIGHTS = PhaseWeights()


def prefill_features(entries) -> tuple[float, float]:
    """(Σnew, Σ new·(context − new/2)): a chunk of `new` tokens after `context − new`
    cached ones attends to the cached ones and to its own earlier tokens, a triangle."""
    x1 = x2 = 0.0
    for _, new, ctx in entries:
        x1 += new
        x2 += new * (ctx - new / 2)
    return x1, x2


OUTLIER_FACTOR = 3.0    # a step this many times slower than the fit predicts is not fitted
OUTLIER_SHARE = 0.1     # ... while such steps are fewer than this share of those fitted


class Calibration:
    """Least squares of iteration time on batch composition, per model × device kind ×
    phase, intercept kept:

    prefill: τ ≈ c0 + p_tok·Σnew + p_ctx·Σ new·(context − new/2)
    decode:  τ ≈ c0 + d_seq·n    + d_ctx·Σcontext

    c0 is the part of a step no entry causes more than another (the weight read, the
    launches): the split gives each entry c0/n of it (the Shapley value of a
    fixed-plus-additive cost). A mixed step (prompt chunks and one-token decodes) runs
    one prefill pass, so it is fitted and priced with the prefill terms (a decoding
    entry as a 1-token chunk); kv_import is a copy, not a model step, and is not fitted. A phase keeps the defaults until it has `min_iterations` steps. A fit with a
    negative term never reaches the bill: the best least-squares fit without the
    negative terms is used instead (exact non-negative least squares over three terms),
    and `describe` says which term was dropped and why. A step more than
    OUTLIER_FACTOR times slower than the current fit predicts (the OS or another process
    held it up) is left out of the fit and counted, as long as such steps stay rare.
    """

    def __init__(self, min_iterations: int = 50):
        self.min_iterations = min_iterations
        # (key, phase) -> [n, Σx1, Σx2, Σx1², Σx1x2, Σx2², Σy, Σx1y, Σx2y, Σy²]
        self._sums: dict[tuple[str, str], list[float]] = {}
        self._fits: dict[str, PhaseWeights] = {}
        self._phase_fits: dict[tuple[str, str], PhaseFit] = {}
        self._outliers: dict[tuple[str, str], int] = {}
        self._dirty: set[str] = set()

    def observe(self, key: str, rec: IterationRecord) -> None:
        if not rec.entries or rec.wall_s <= 0:
            return
        phase = rec.phase
        if phase == PREFILL or phase == "mixed":    # one prefill pass either way
            phase = PREFILL
            x1, x2 = prefill_features(rec.entries)
        elif phase == DECODE:
            x1 = float(len(rec.entries))
            x2 = float(sum(map(_CONTEXT, rec.entries)))
        else:
            return
        y = rec.wall_s
        s = self._sums.get((key, phase))
        if s is None:
            s = self._sums[(key, phase)] = [0.0] * 10
        f = self._phase_fits.get((key, phase))
        if f is not None and f.calibrated and y > OUTLIER_FACTOR * (f.c0 + f.k_tok * x1 + f.k_ctx * x2):
            # a step the OS or another process held up is not the device's cost model;
            # unless so many are that the model itself has changed
            n_out = self._outliers.get((key, phase), 0)
            if n_out < OUTLIER_SHARE * s[0]:
                self._outliers[(key, phase)] = n_out + 1
                return
        s[0] += 1; s[1] += x1; s[2] += x2; s[3] += x1 * x1; s[4] += x1 * x2
        s[5] += x2 * x2; s[6] += y; s[7] += x1 * y; s[8] += x2 * y; s[9] += y * y
        self._dirty.add(key)

    def fit_phase(self, key: str, phase: str) -> PhaseFit:
        s = self._sums.get((key, phase))
        if s is None:
            return PhaseFit()
        n = int(s[0])
        if n < max(self.min_iterations, 3):
            return PhaseFit(samples=n, note=f"{n} of {max(self.min_iterations, 3)} steps")
        a = np.array([[s[0], s[1], s[2]], [s[1], s[3], s[4]], [s[2], s[4], s[5]]], dtype=float)
        b = np.array([s[6], s[7], s[8]], dtype=float)
        # Scale the columns so a touch of ridge means the same for each: a feature that
        # never varies (every decode batch of one sequence) must not make it singular.
        scale = np.sqrt(np.maximum(np.diag(a), 1e-300))
        an = a / np.outer(scale, scale)
        bn = b / scale
        names = ("c0", "per-token" if phase == PREFILL else "per-sequence", "per-context")
        best = None
        for subset in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            idx = list(subset)
            sub = an[np.ix_(idx, idx)] + np.eye(len(idx)) * 1e-10
            try:
                beta = np.linalg.solve(sub, bn[idx])
            except np.linalg.LinAlgError:
                continue
            if not np.all(np.isfinite(beta)) or np.any(beta < 0):
                continue
            full = np.zeros(3)
            full[idx] = beta / scale[idx]
            sse = float(s[9] - 2 * full @ b + full @ a @ full)
            if best is None or sse < best[0] - 1e-15 * max(s[9], 1e-300):
                best = (sse, full, subset)
            if subset == (0, 1, 2):
                break                   # the free fit is non-negative: it is the fit
        if best is None:
            return PhaseFit(samples=n, note="no fit with non-negative terms")
        sse, (c0, k1, k2), subset = best
        if k1 <= 0 and k2 <= 0:
            return PhaseFit(samples=n, note="no entry term left after dropping negative ones")
        rmse = math.sqrt(max(sse, 0.0) / n)
        if subset == (0, 1, 2):
            return PhaseFit(float(c0), float(k1), float(k2), "fit", "", n, rmse, s[6] / n)
        dropped = [names[i] for i in range(3) if i not in subset]
        return PhaseFit(float(c0), float(k1), float(k2), "constrained",
                        f"the free fit gave a negative {' and '.join(dropped)} term; "
                        f"fitted without it", n, rmse, s[6] / n)

    def weights(self, key: str) -> PhaseWeights:
        if key in self._dirty:
            self._dirty.discard(key)
            self._fits[key] = self._fit(key)
        return self._fits.get(key, DEFAULT_WEIGHTS)

    def _fit(self, key: str) -> PhaseWeights:
        fp = self._phase_fits[(key, PREFILL)] = self.fit_phase(key, PREFILL)
        fd = self._phase_fits[(key, DECODE)] = self.fit_phase(key, DECODE)
        if not fp.calibrated and not fd.calibrated:
            return DEFAULT_WEIGHTS
        if fp.calibrated and fd.calibrated:
            return PhaseWeights(fp.k_tok, fp.k_ctx, fd.k_tok, fd.k_ctx, True,
                                fp.samples + fd.samples, fp.c0, fd.c0)
        # One phase fitted: it prices its own steps, the other keeps the defaults (a
        # step is priced with one phase's terms only, so the units never meet).
        f = fp if fp.calibrated else fd
        if fp.calibrated:
            return PhaseWeights(fp.k_tok, fp.k_ctx, 1.0, 0.0, True, f.samples, fp.c0, 0.0)
        return PhaseWeights(1.0, 0.0, fd.k_tok, fd.k_ctx, True, f.samples, 0.0, fd.c0)

    def describe(self) -> dict[str, dict]:
        """Per model × device kind: each phase's c0, per-token (per-sequence) and
        per-context terms, how they were reached, and the fit's error."""
        out = {}
        for key in sorted({k for k, _ in self._sums}):
            w = self.weights(key)
            model, _, device = key.rpartition("|")
            entry = {"model": model, "device": device, "calibrated": w.calibrated,
                     "samples": w.samples}
            for phase, per in ((PREFILL, "s_per_token"), (DECODE, "s_per_seq")):
                f = self._phase_fits.get((key, phase)) or self.fit_phase(key, phase)
                entry[phase] = {"status": f.status, "note": f.note, "samples": f.samples,
                                "c0_s": f.c0 if f.calibrated else None,
                                per: f.k_tok if f.calibrated else None,
                                "s_per_context": f.k_ctx if f.calibrated else None,
                                "rmse_s": f.rmse_s, "mean_step_s": f.mean_s,
                                "outliers": self._outliers.get((key, phase), 0)}
            out[key] = entry
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
                 calibration: Calibration | None = None, start: float | None = None,
                 resumed: bool = False):
        import time
        self.devices = {d.id: d for d in devices}
        self.model = model
        self.window_s = window_s
        self.calibration = calibration or Calibration()
        self.started = time.time() if start is None else start
        self.closed_until = self.started          # every window before this is closed
        self._windows: dict[int, list[tuple[IterationRecord, float, str]]] = {}
        self.late = 0                             # records that came after their window closed
        # A restarted accounting process resumes where the ledger's windows end; the
        # daemon replays its recent records, and what was accounted before is dropped.
        self.resumed_at = self.started if resumed else None
        self.worker_models: dict[str, str] = {}   # worker -> served model (else `model`)
        self.replayed = 0                         # replayed records already accounted

    def _index(self, t: float) -> int:
        return int(t // self.window_s)

    def add(self, rec: IterationRecord) -> None:
        # The model the worker serves now, when its step arrives, not when its window
        # closes: a swap-model restarts workers under the same names, and the old
        # model's last steps must not be fitted and priced as the new one's.
        model = self.worker_models.get(rec.worker, self.model)
        start, end = rec.start, rec.start + rec.wall_s
        if start < self.closed_until:
            if self.resumed_at is not None and start < self.resumed_at:
                # replayed after a restart: the previous accounting process committed
                # the windows before `resumed_at`; only the part after it is new here
                if end <= self.resumed_at:
                    self.replayed += 1
                    return
                start = self.resumed_at
                self._file(rec, model, start, end, max(start, self.closed_until))
                return
            # its window already closed: bill it to the first open one (with all of its
            # time; close_until caps busy time at capacity, so conservation still holds)
            self.late += 1
            self._windows.setdefault(self._index(self.closed_until), []).append(
                (rec, rec.wall_s, model))
            return
        k0, k1 = self._index(start), self._index(end)
        if k0 == k1:
            self._windows.setdefault(k0, []).append((rec, rec.wall_s, model))
            return
        for k in range(k0, k1 + 1):
            lo, hi = max(start, k * self.window_s), min(end, (k + 1) * self.window_s)
            if hi > lo:
                self._windows.setdefault(k, []).append((rec, hi - lo, model))

    def _file(self, rec: IterationRecord, model: str, start: float, end: float,
              open_from: float) -> None:
        """File the part [start, end) of `rec`; a part before `open_from` (closed
        windows) goes to the first open window."""
        for k in range(self._index(start), self._index(end) + 1):
            lo, hi = max(start, k * self.window_s), min(end, (k + 1) * self.window_s)
            if hi > lo:
                self._windows.setdefault(max(k, self._index(open_from)), []).append(
                    (rec, hi - lo, model))

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

    def _close(self, t0: float, t1: float, records: list[tuple[IterationRecord, float, str]],
               meter: EnergyReader | None) -> list[DeviceWindow]:
        dt = t1 - t0
        cal = self.calibration
        per_device: dict[str, list[tuple[IterationRecord, float, str]]] = {d: [] for d in self.devices}
        for item in records:
            for dev in item[0].devices:
                if dev in per_device:
                    per_device[dev].append(item)
        for dev_id, its in per_device.items():
            # a step spread over several devices (tensor parallel) is one observation, of
            # its first device's model; a window's list holds each step once
            kind = self.devices[dev_id].model
            for rec, _, model in its:
                if rec.devices[0] == dev_id:
                    cal.observe(f"{model}|{kind}", rec)
        out = []
        for dev_id, its in per_device.items():
            info = self.devices[dev_id]
            kind = info.model
            out.append(self._device_window(
                info, t0, t1, dt, its, meter,
                lambda model, kind=kind: cal.weights(f"{model}|{kind}")))
        return out

    def serve(self, worker_models: dict[str, str], devices: list[DeviceInfo]) -> None:
        """The partition or the served model changed: from now on each worker's steps
        are fitted and priced under the model it serves (a swap starts new terms; the
        old model's stay under its name), and devices the new partition adds are
        accounted from the window they arrive in (the windows already closed did not
        have them). A device the partition no longer uses stays accounted (idle): it is
        still provisioned."""
        self.worker_models = dict(worker_models)
        for d in devices:
            self.devices[d.id] = d

    @staticmethod
    def _device_window(info: DeviceInfo, t0: float, t1: float, dt: float,
                       its: list[tuple[IterationRecord, float, str]], meter: EnergyReader | None,
                       weights_of: Callable[[str], PhaseWeights]) -> DeviceWindow:
        measured = info.capacity * dt
        busy = sum(item[1] for item in its)
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
        terms: dict[str, tuple] = {}            # served model -> its fitted terms
        # share[r] = (c0/n + m[r]) · τ / (c0 + Σm): every entry carries an equal part of
        # the step's shared cost and its own marginal part, scaled to the measured τ.
        for rec, tau, model in its:
            t = terms.get(model)
            if t is None:
                w = weights_of(model)
                t = terms[model] = (w.p_tok, w.p_ctx, w.d_seq, w.d_ctx, w.p_c0, w.d_c0)
            p_tok, p_ctx, d_seq, d_ctx, p_c0, d_c0 = t
            tau *= scale
            approximate |= rec.approximate
            entries = rec.entries
            phase = rec.phase
            n = len(entries)
            if phase == PREFILL:
                ms = [new * (p_tok + p_ctx * (ctx - new / 2)) for _, new, ctx in entries]
                total = p_c0 + sum(ms)
                if total <= 0 or not n:
                    unattributed += tau
                    continue
                k = tau / total
                fixed = p_c0 / n
                for (rid, _, _), m in zip(entries, ms):
                    if "." in rid:
                        rid = rid.partition(".")[0]
                    pre[rid] = pre.get(rid, 0.0) + (fixed + m) * k
            elif phase != "mixed":          # decode, kv_import: Σm = n·d_seq + d_ctx·Σcontext
                total = d_c0 + n * d_seq + d_ctx * sum(map(_CONTEXT, entries))
                if total <= 0 or not n:
                    unattributed += tau
                    continue
                k = tau / total
                k_seq, k_ctx = (d_c0 / n + d_seq) * k, d_ctx * k
                for rid, _, ctx in entries:
                    if "." in rid:
                        rid = rid.partition(".")[0]
                    dec[rid] = dec.get(rid, 0.0) + k_seq + k_ctx * ctx
            else:
                # a chunked-prefill pass: prompt chunks and one-token decodes run as one
                # prefill kernel, so every entry is priced with the prefill fit and billed
                # to its own phase
                ms = [new * (p_tok + p_ctx * (ctx - new / 2)) for _, new, ctx in entries]
                total = p_c0 + sum(ms)
                if total <= 0 or not n:
                    unattributed += tau
                    continue
                k = tau / total
                fixed = p_c0 / n
                for (rid, new, _), m in zip(entries, ms):
                    acc = pre if new > 1 else dec
                    rid = request_of(rid)
                    acc[rid] = acc.get(rid, 0.0) + (fixed + m) * k
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
