"""Step-time profiles per (model, device type, tp): what sizing and tuning read.

A profile is a table, not a formula, so a measured one (`applianced profile`, a sweep of
the real engine) and a simulated one (the roofline of `engines/roofline.py` over the
catalogue's datasheet figures) are used the same way. Each says where it came from and
when, and everything derived from it carries that `source`.
"""
from __future__ import annotations

import bisect
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# Prefill sweep: batched tokens, made of prompts of at most this many tokens each (so
# the curve measures batching, not one ever-longer prompt's quadratic attention).
PREFILL_PROMPT_TOKENS = 512
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192, 16384)
# "Saturates": the smallest batch reaching this share of the best prefill throughput.
KNEE_SHARE = 0.9


@dataclass
class Profile:
    model: str
    device: str                 # catalogue GPU name, or "cpu"
    tp: int
    source: str                 # "simulated" (roofline) | "measured"
    created: float              # unix seconds
    prefill: list[list[float]]  # [[batched tokens, seconds], ...] ascending
    decode: list[list[float]]   # [[batch, context, seconds], ...] on a batch x context grid
    kv_capacity_tokens: int     # KV pool of one worker
    usd_per_hour: float = 0.0   # per device (catalogue), 0 = unknown
    tdp_w: float = 0.0
    idle_w: float = 0.0
    note: str = ""
    _grid: tuple | None = field(default=None, repr=False, compare=False)

    # -- lookups ----------------------------------------------------------------------
    def prefill_s(self, tokens: float) -> float:
        """Seconds for one prefill step of `tokens` batched tokens (linear between
        points, proportional beyond the last: compute-bound there)."""
        pts = np.asarray(self.prefill, dtype=float)
        if tokens <= 0:
            return 0.0
        if tokens > pts[-1, 0]:
            return float(pts[-1, 1] * tokens / pts[-1, 0])
        return float(np.interp(tokens, pts[:, 0], pts[:, 1]))

    def prefill_tokens_per_s(self, tokens: float) -> float:
        return tokens / self.prefill_s(tokens) if tokens > 0 else 0.0

    def _decode_grid(self):
        """(batches, contexts, rows) as plain lists: `decode_s` runs for every request
        the trends see, and scalar lookups on lists cost a tenth of numpy's."""
        if self._grid is None:
            pts = np.asarray(self.decode, dtype=float)
            batches = np.unique(pts[:, 0])
            ctxs = np.unique(pts[:, 1])
            grid = np.full((len(batches), len(ctxs)), np.nan)
            for b, c, s in pts:
                grid[np.searchsorted(batches, b), np.searchsorted(ctxs, c)] = s
            self._grid = (batches.tolist(), ctxs.tolist(), grid.tolist(),
                          float(np.nanmax(grid)) if grid.size else 0.0)
        return self._grid

    def decode_s(self, batch: float, context: float) -> float:
        """Seconds for one decode step of `batch` sequences at mean context `context`
        (bilinear on the grid; linear extrapolation past its edges)."""
        batches, ctxs, grid, worst = self._decode_grid()

        def along(axis_vals, x):
            i = min(max(bisect.bisect_left(axis_vals, x) - 1, 0), len(axis_vals) - 2)
            x0, x1 = axis_vals[i], axis_vals[i + 1]
            return i, (x - x0) / (x1 - x0)

        if len(batches) < 2 or len(ctxs) < 2:
            return worst
        i, fb = along(batches, batch)
        j, fc = along(ctxs, context)
        g0, g1 = grid[i], grid[i + 1]
        top = g0[j] + fc * (g0[j + 1] - g0[j])
        bottom = g1[j] + fc * (g1[j + 1] - g1[j])
        return float(max(1e-6, top + fb * (bottom - top)))

    def prefill_knee_tokens(self) -> int:
        """Prefill token budget: the smallest batch whose throughput reaches KNEE_SHARE
        of the best in the sweep — more tokens per step only lengthen TTFT."""
        tput = [(t, t / s) for t, s in self.prefill]
        best = max(v for _, v in tput)
        return int(next(t for t, v in tput if v >= KNEE_SHARE * best))

    # -- storage ----------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("_grid", None)
        return d

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "_grid"}
        return cls(**known)

    def filename(self) -> str:
        return profile_filename(self.model, self.device, self.tp)


def profile_filename(model: str, device: str, tp: int) -> str:
    safe = lambda s: "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in s)  # noqa: E731
    return f"{safe(model)}__{safe(device)}__tp{tp}.json"


def save_profile(profile: Profile, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / profile.filename()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    tmp.replace(path)
    return path


def load_profile(directory: Path | None, model: str, device: str, tp: int) -> Profile | None:
    if directory is None:
        return None
    path = directory / profile_filename(model, device, tp)
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _batch_prompts(tokens: int) -> list[int]:
    full, rest = divmod(tokens, PREFILL_PROMPT_TOKENS)
    return [PREFILL_PROMPT_TOKENS] * full + ([rest] if rest else [])


def simulated_profile(model, gpu, tp: int, mem_fraction: float = 0.9) -> Profile:
    """The roofline's step times for `model` (ModelSpec) on `tp` of `gpu` (GpuSpec, or
    None for the simulator's CPU shape)."""
    from appliance.engines.roofline import CPU_SHAPE, DeviceShape, StepTimeModel
    shape = DeviceShape.from_gpu(gpu, model.weight_bytes) if gpu is not None else CPU_SHAPE
    timing = StepTimeModel(shape, tp, model)
    prefill = []
    for t in PREFILL_TOKENS:
        prompts = _batch_prompts(t)
        prefill.append([t, timing.prefill_s(prompts, [0] * len(prompts))])
    decode = [[b, c, timing.decode_s([c] * b)] for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    return Profile(
        model=model.name, device=gpu.name if gpu is not None else "cpu", tp=tp,
        source="simulated", created=time.time(), prefill=prefill, decode=decode,
        kv_capacity_tokens=timing.kv_capacity_tokens(mem_fraction),
        usd_per_hour=gpu.usd_per_hour if gpu is not None else 0.0,
        tdp_w=gpu.tdp_w if gpu is not None else 0.0, idle_w=gpu.idle_w if gpu is not None else 0.0,
        note="roofline of engines/roofline.py over the catalogue's datasheet figures")
