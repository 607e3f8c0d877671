"""The capacity screen's model: the planner's answer from `/admin/v1/plan`, its
splits and trends, resampled to the terminal's width.

Computed from the daemon's JSON and nothing else; no Textual, no HTTP."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from appliance.tui.format import NA, as_dict, as_int, as_list, fmt_num, num, sparkline, text


@dataclass(frozen=True, slots=True)
class PhaseSplit:
    """One phase of one split (current, recommended now, recommended at the peak)."""
    workers: int | None
    gpus: int | None
    gpus_needed: int | None
    headroom: float | None
    device: str


@dataclass(frozen=True, slots=True)
class SplitView:
    split: str                        # "P+D" or n/a
    prefill: PhaseSplit
    decode: PhaseSplit
    fits: bool | None


@dataclass(frozen=True, slots=True)
class CapacityView:
    """`/admin/v1/plan` as the Capacity screen shows it; every field may be n/a."""
    model: str
    simulated: bool
    horizon_s: float | None
    bucket_s: float | None
    method: str
    interval: tuple[float | None, float | None]
    history_buckets: int | None
    rate_mean: tuple[float | None, ...]         # λ forecast, requests/s, one per bucket
    rate_lower: tuple[float | None, ...]
    rate_upper: tuple[float | None, ...]
    rho_now: float | None
    rho_history: tuple[float | None, ...]
    rho_forecast: tuple[float | None, ...]
    rho_source: str
    current: SplitView
    recommended: SplitView
    at_peak: SplitView
    peak_in_s: float | None                     # from generated_at to the forecast peak
    bottleneck: str
    why: str
    profiles: tuple[tuple[str, str, str], ...]  # (phase, source, device)
    token_budget: int | None                    # the knee of the prefill profile
    max_batch_tokens: int | None                # what the engines run with
    max_batch_tokens_source: str
    usd_per_day: float | None
    kwh_per_day: float | None

    @property
    def profile_badge(self) -> str:
        """MEASURED when every phase's profile was measured on this box, else SIMULATED
        (a roofline or catalogue profile), n/a when the plan does not say."""
        sources = {s for _, s, _ in self.profiles if s != NA}
        if not sources:
            return NA
        return "MEASURED" if sources == {"measured"} else "SIMULATED"

    @property
    def estimated(self) -> bool:
        return "estimated" in self.rho_source or bool(self.rate_mean)


def _series(points: Any, key: str) -> tuple[float | None, ...]:
    return tuple(num(as_dict(p).get(key)) for p in as_list(points))


def _phase_split(value: Any) -> PhaseSplit:
    d = as_dict(value)
    return PhaseSplit(workers=as_int(d.get("workers")), gpus=as_int(d.get("gpus")),
                      gpus_needed=as_int(d.get("gpus_needed")), headroom=num(d.get("headroom")),
                      device=text(d.get("device")))


def _split_view(value: Any) -> SplitView:
    d = as_dict(value)
    fits = d.get("fits")
    return SplitView(split=text(d.get("split")), prefill=_phase_split(d.get("prefill")),
                     decode=_phase_split(d.get("decode")),
                     fits=fits if isinstance(fits, bool) else None)


def capacity_from_plan(plan: Any) -> CapacityView:
    """Read `/admin/v1/plan`, whatever subset of its keys (and of their types) it has."""
    plan = as_dict(plan)
    fc = as_dict(plan.get("forecast"))
    rho = as_dict(plan.get("rho"))
    rec = as_dict(plan.get("recommended"))
    peak = as_dict(rec.get("at_peak"))
    bott = as_dict(plan.get("bottleneck"))
    tuning = as_dict(plan.get("tuning"))
    cost = as_dict(plan.get("cost"))
    interval = as_list(fc.get("interval"))
    profiles = tuple((phase, text(as_dict(p).get("source")), text(as_dict(p).get("device")))
                     for phase, p in as_dict(plan.get("profile_source")).items())
    peak_t, gen = num(peak.get("t")), num(plan.get("generated_at"))
    mbt = as_dict(tuning.get("max_batch_tokens"))
    return CapacityView(
        model=text(plan.get("model")), simulated=plan.get("simulated") is True,
        horizon_s=num(plan.get("horizon_s")), bucket_s=num(plan.get("bucket_s")),
        method=text(fc.get("method")),
        interval=(num(interval[0]) if len(interval) > 1 else None,
                  num(interval[1]) if len(interval) > 1 else None),
        history_buckets=as_int(fc.get("history_buckets")),
        rate_mean=_series(fc.get("rate"), "mean"), rate_lower=_series(fc.get("rate"), "lower"),
        rate_upper=_series(fc.get("rate"), "upper"),
        rho_now=num(rho.get("now")), rho_history=_series(rho.get("history"), "value"),
        rho_forecast=_series(rho.get("forecast"), "value"), rho_source=text(rho.get("source")),
        current=_split_view(plan.get("current")), recommended=_split_view(rec),
        at_peak=_split_view(peak),
        peak_in_s=None if peak_t is None or gen is None else max(0.0, peak_t - gen),
        bottleneck=text(bott.get("phase")), why=text(bott.get("why"), ""),
        profiles=profiles, token_budget=as_int(tuning.get("prefill_token_budget")),
        max_batch_tokens=as_int(mbt.get("value")) if mbt else as_int(tuning.get("configured_max_batch_tokens")),
        max_batch_tokens_source=(text(mbt.get("source")) if mbt else
                                 "configured" if "configured_max_batch_tokens" in tuning else NA),
        usd_per_day=num(cost.get("usd_per_day")), kwh_per_day=num(cost.get("kwh_per_day")))


def resample(values: Iterable[float | None], width: int, how: str = "mean") -> list[float | None]:
    """`width` points from a longer series: each the mean / max / min of its stretch (a
    day of minute buckets has to fit an 80-column terminal); shorter series stay as is."""
    vals = list(values)
    if len(vals) <= width or width <= 0:
        return vals
    out: list[float | None] = []
    for i in range(width):
        chunk = [v for v in vals[i * len(vals) // width:(i + 1) * len(vals) // width] if v is not None]
        if not chunk:
            out.append(None)
        elif how == "max":
            out.append(max(chunk))
        elif how == "min":
            out.append(min(chunk))
        else:
            out.append(sum(chunk) / len(chunk))
    return out


def _span(s: float | None) -> str:
    if s is None:
        return NA
    if s >= 86400 and s % 86400 == 0:
        return f"{int(s // 86400)}d"
    if s >= 3600:
        return f"{s / 3600:.0f}h"
    return f"{s / 60:.0f}m"


def _extreme(values: Iterable[float | None], pick=max) -> float | None:
    nums = [v for v in values if v is not None]
    return pick(nums) if nums else None


def _gpus(p: PhaseSplit) -> str:
    return NA if p.gpus is None else f"{p.gpus}"


def render_capacity_lines(v: CapacityView, width: int = 80) -> list[str]:
    """The Capacity screen as lines of plain text (no colour needed to read it)."""
    spark_w = max(10, min(width - 26, 120))
    lines = []
    profs = " · ".join(f"{ph} {src} ({dev})" for ph, src, dev in v.profiles) or NA
    lines.append(f"[{v.profile_badge} profile] {profs}")
    lo, hi = v.interval
    band = NA if lo is None or hi is None else f"p{lo * 100:.0f}-p{hi * 100:.0f}"
    past = NA if v.history_buckets is None else str(v.history_buckets)
    lines.append(f"FORECAST λ req/s · next {_span(v.horizon_s)} by {_span(v.bucket_s)} · "
                 f"{v.method} · {band} · fit on {past}")
    top = _extreme(v.rate_upper) or _extreme(v.rate_mean)
    if not v.rate_mean:
        lines.append("  no forecast yet")
    else:
        for label, series, how, pick in (("high", v.rate_upper, "max", max),
                                         ("mean", v.rate_mean, "mean", max),
                                         ("low", v.rate_lower, "min", min)):
            pts = resample(series, spark_w, how)
            spark = sparkline(pts, width=spark_w, top=top or None) or NA
            lines.append(f"  {label:<4} {spark:<{spark_w}} {label} {fmt_num(_extreme(series, pick), digits=2)}")
        lines.append(f"       now{'':>{max(0, spark_w - 7)}}+{_span(v.horizon_s)}")
    hist = v.rho_history[-max(4, spark_w // 3):]
    fut = resample(v.rho_forecast, max(4, spark_w - len(hist) - 3))
    rho_top = _extreme(list(hist) + list(fut))
    lines.append(f"RHO prefill÷decode GPU demand  now {fmt_num(v.rho_now, digits=2)}"
                 f"  past {fmt_num(_extreme(hist, min), digits=2)}–{fmt_num(_extreme(hist), digits=2)}"
                 f"  next {fmt_num(_extreme(v.rho_forecast, min), digits=2)}"
                 f"–{fmt_num(_extreme(v.rho_forecast), digits=2)}  (estimated)")
    lines.append(f"  past {sparkline(hist, width=len(hist), top=rho_top) or NA} │ "
                 f"next {sparkline(fut, width=len(fut), top=rho_top) or NA}")
    peak = NA if v.peak_in_s is None else f"+{_span(v.peak_in_s)}"
    lines.append(f"{'SPLIT':<10}{'current':>12}{'recommended':>14}{'at peak ' + peak:>16}")
    lines.append(f"{'P+D':<10}{v.current.split:>12}{v.recommended.split:>14}{v.at_peak.split:>16}")
    for phase in ("prefill", "decode"):
        cur, rec, pk = (getattr(s, phase) for s in (v.current, v.recommended, v.at_peak))
        need = NA if rec.gpus_needed is None else str(rec.gpus_needed)
        room = NA if rec.headroom is None else f"{rec.headroom:.2f}x"
        lines.append(f"{phase + ' GPUs':<14}{_gpus(cur):>8}{_gpus(rec):>14}{_gpus(pk):>16}"
                     f"  need {need}, headroom {room}")
    lines.append(f"BOTTLENECK {v.bottleneck}: {v.why}".rstrip(": "))
    lines.append(f"prefill token budget (profile knee) {fmt_num(v.token_budget and float(v.token_budget), digits=0)}"
                 f" · engines run {fmt_num(v.max_batch_tokens and float(v.max_batch_tokens), digits=0)}"
                 f" ({v.max_batch_tokens_source})")
    lines.append(f"cost {fmt_num(v.usd_per_day, digits=0)} $/day · {fmt_num(v.kwh_per_day, digits=0)} kWh/day (estimated)")
    return lines
