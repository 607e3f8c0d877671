"""What the telemetry hub's answers look like to the outside: the live keys of
/admin/v1/status (`status_fields`) and the counters and gauges /metrics exports
(`metric_values`).

The hub (`telemetry/hub.py`) keeps the readings and answers queries over windows; this
module chooses the windows a status shows (1/10/60 s, the ratio over 10 s, the request
rate over 10 s), rounds, and lays the answers out. Knows nothing of HTTP: the daemon
serves what these functions return.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from appliance.percentiles import percentile
from appliance.telemetry.hub import HISTORY_S, LATENCY_WINDOW_S

if TYPE_CHECKING:
    from appliance.telemetry.hub import Telemetry

__all__ = ["RATE_WINDOW_S", "RATIO_WINDOW", "WINDOWS", "latency", "metric_values",
           "ratio_history", "status_fields"]

WINDOWS: tuple[tuple[str, float], ...] = (("1s", 1.0), ("10s", 10.0), ("60s", 60.0))
RATIO_WINDOW = "10s"
RATE_WINDOW_S = 10.0


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def status_fields(hub: Telemetry, workers: list[dict] | None = None) -> dict:
    """The live keys of /admin/v1/status. `workers`: the daemon's worker status rows
    (role, waiting, running, queued_prefill_tokens) for the queue depths. `devices`
    holds the live fields only; the daemon merges them into its inventory rows."""
    now = hub.clock()
    edge = hub.window_edge(now)
    windows = {name: {g: hub.group_window(g, edge - span, edge) for g in hub.groups}
               for name, span in WINDOWS}
    groups = {}
    span = dict(WINDOWS)
    for g in hub.groups:
        gw = {name: windows[name][g] for name, _ in WINDOWS}
        groups[g] = {
            "devices": hub.group_devices[g],
            "workers": len(hub.groups[g]),
            "busy_fraction": {n: _round(gw[n]["busy_fraction"]) for n in span},
            "gpu_seconds": {n: _round(gw[n]["busy_s"]) for n in span},
            "energy_joules": {n: _round(gw[n]["energy_j"], 3) for n in span},
            "utilization": {n: _round(gw[n]["utilization"]) for n in span},
            "power_w": _round(hub.group_power_w(g), 3),
            "tokens_per_s": {n: _round((gw[n]["prefill_tokens"] + gw[n]["decode_tokens"]) / span[n], 3)
                             for n in span},
            "queue": _queue(g, workers or []),
        }
        if gw["10s"]["cpu_s"] is not None:
            # CPU workers: their processes' CPU seconds (psutil), measured.
            groups[g]["cpu_seconds"] = {n: _round(gw[n]["cpu_s"], 4) for n in span}
    phase_tps = {p: {n: _round(sum(windows[n][g][f"{p}_tokens"] for g in hub.groups) / s, 3)
                     for n, s in WINDOWS} for p in ("prefill", "decode")}
    ratio = _ratios(hub, windows[RATIO_WINDOW])
    ratio["window"] = RATIO_WINDOW
    ratio["history"] = ratio_history(hub, now)
    return {
        "site": hub.site, "appliance": hub.appliance,
        "devices": [_device_row(hub, d, edge) for d in hub.devices],
        "groups": groups,
        "ratio": ratio,
        "phase_tokens_per_s": phase_tps,
        "latency": latency(hub, now),
        "requests_per_s": _round(len(hub.recent_requests(now, RATE_WINDOW_S)) / RATE_WINDOW_S, 3),
        "sources": hub.sources(windows[RATIO_WINDOW]),
    }


def _ratios(hub: Telemetry, win: dict[str, dict]) -> dict:
    """prefill:decode in three currencies over one window's group answers."""
    if hub.mode == "agg" or "prefill" not in win or "decode" not in win:
        return {"gpu_seconds": None, "energy": None, "activity": None}
    p, d = win["prefill"], win["decode"]
    return {"gpu_seconds": _round(_ratio(p["busy_s"], d["busy_s"]), 4),
            "energy": _round(_ratio(p["energy_j"], d["energy_j"]), 4),
            "activity": _round(_ratio(p["activity_s"], d["activity_s"]), 4)}


def ratio_history(hub: Telemetry, now: float | None = None) -> list[list]:
    """[end of second, busy GPU-seconds ratio in that second] for the last 60 whole seconds."""
    if hub.mode == "agg" or "prefill" not in hub.groups or "decode" not in hub.groups:
        return []
    now = hub.clock() if now is None else now
    end = math.floor(now)
    first = max(end - HISTORY_S, math.floor(hub.started))
    out = []
    for t in range(first, end):
        busy = {g: hub.group_busy_s(g, t, t + 1) for g in ("prefill", "decode")}
        out.append([float(t + 1), _round(_ratio(busy["prefill"], busy["decode"]), 4)])
    return out


def latency(hub: Telemetry, now: float | None = None) -> dict:
    """TTFT and ITL p50/p99 of the requests finished in the last minute (the one
    percentile definition the planner's replay uses too)."""
    now = hub.clock() if now is None else now
    recent = hub.recent_requests(now, LATENCY_WINDOW_S)
    ttft = [r[1] for r in recent if r[1] is not None]
    itl = [r[2] for r in recent if r[2] is not None]
    return {"ttft_p50_s": _round(percentile(ttft, 0.5)),
            "ttft_p99_s": _round(percentile(ttft, 0.99)),
            "itl_p50_s": _round(percentile(itl, 0.5)), "itl_p99_s": _round(percentile(itl, 0.99)),
            "window_s": LATENCY_WINDOW_S, "requests": len(recent)}


def _queue(group: str, workers: list[dict]) -> dict:
    rows = [w for w in workers if w.get("role") == group]
    return {k: sum(w.get(k) or 0 for w in rows)
            for k in ("waiting", "queued_prefill_tokens", "running")}


def _device_row(hub: Telemetry, d: str, edge: float) -> dict:
    s = hub.latest(d)
    workers = hub.device_workers(d)
    row = {
        "id": d,
        "group": "+".join(hub.device_groups.get(d, [])) or None,
        "worker": "+".join(workers) or None,
        "util": None, "power_w": None, "energy_j": None, "mem_used_bytes": None,
        "mem_total_bytes": None, "sm_clock_mhz": None, "temp_c": None, "activity": {},
        "busy_fraction": {n: _round(min(1.0, hub.device_busy_s(d, edge - span, edge) / span))
                          for n, span in WINDOWS},
        "source": s.source if s is not None else None,
        "lost": bool(s.lost) if s is not None else False,
        "sampled_at": s.t if s is not None else None,
    }
    if s is not None:
        row.update(util=_round(s.util), power_w=_round(s.power_w, 3),
                   energy_j=_round(s.energy_j, 3), mem_used_bytes=s.mem_used_bytes,
                   mem_total_bytes=s.mem_total_bytes, sm_clock_mhz=s.sm_clock_mhz,
                   temp_c=s.temp_c, activity={k: _round(v) for k, v in s.activity.items()})
    return row


def metric_values(hub: Telemetry) -> dict:
    """Counters and gauges for /metrics, read at scrape time."""
    devices = []
    for d in hub.devices:
        s = hub.latest(d)
        devices.append({"device": d, "group": "+".join(hub.device_groups.get(d, [])) or "none",
                        "t": s.t if s is not None else None,
                        "energy_j": s.energy_j if s is not None else None,
                        "power_w": s.power_w if s is not None else None,
                        "util": s.util if s is not None else None})
    return {"group_busy_seconds": dict(hub.group_busy_total),
            "group_energy_joules": dict(hub.group_energy_total),
            "group_devices": {g: len(v) for g, v in hub.group_devices.items()},
            "group_workers": {g: len(v) for g, v in hub.groups.items()},
            "phase_tokens": dict(hub.phase_tokens_total),
            "devices": devices}
