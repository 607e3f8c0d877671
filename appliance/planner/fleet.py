"""A fleet's capacity plan: the plans of several appliances (each one's
`GET /admin/v1/plan`), added up per site and for the whole fleet.

Pure functions on plan JSON; fetching the plans is the CLI's business. Each appliance
plans its own box (one site each, `[site] name`); a site's figures are sums over its
appliances: GPUs per phase (current, recommended now and at the forecast peak, and the
fractional GPUs needed), and GPU demand in GPU-seconds per second, whose ratio is ρ.
Appliances may serve different models on different GPU types: GPU counts and
GPU-seconds add up across them, so ratios and headrooms are computed from the sums,
never averaged.
"""
from __future__ import annotations

import math

PHASES = ("prefill", "decode")


def appliance_row(url: str, plan: dict) -> dict:
    """The figures of one appliance's plan that a fleet view adds up."""
    site = plan.get("site") or {}
    rec, cur = plan["recommended"], plan["current"]
    peak = rec.get("at_peak") or rec
    sizing = plan.get("sizing") or {}

    def need(which: str, phase: str) -> float | None:
        p = (sizing.get(which) or {}).get(phase) or {}
        if p.get("workers") is None:       # unservable (null in JSON: infinite)
            return None
        return float(p["workers"]) * int(p.get("tp") or 1)

    demand = (plan.get("rho") or {}).get("demand") or {}
    return {
        "url": url, "site": site.get("name") or "local",
        "appliance": site.get("appliance") or url, "model": plan.get("model"),
        "simulated": bool(plan.get("simulated")),
        "split": {"current": cur["split"], "recommended": rec["split"], "at_peak": peak["split"]},
        "current": {ph: cur[ph]["gpus"] for ph in PHASES},
        "recommended": {ph: rec[ph]["gpus"] for ph in PHASES},
        "at_peak": {ph: peak[ph]["gpus"] for ph in PHASES},
        "needed": {ph: need("now", ph) for ph in PHASES},
        "needed_peak": {ph: need("peak", ph) for ph in PHASES},
        "demand": {k: {ph: (demand.get(k) or {}).get(f"{ph}_gpu_s_per_s") or 0.0 for ph in PHASES}
                   for k in ("now", "peak")},
        "rho": {"now": (plan.get("rho") or {}).get("now"),
                "at_peak": (plan.get("rho") or {}).get("at_peak")},
        "bottleneck": (plan.get("bottleneck") or {}).get("phase"),
        "arrival_scv": (plan.get("burstiness") or {}).get("arrival_scv"),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def add_up(rows: list[dict]) -> dict:
    """One site's (or the fleet's) totals from appliance rows."""
    out: dict = {"appliances": len(rows), "simulated": any(r["simulated"] for r in rows),
                 "changes": sum(r["split"]["current"] != r["split"]["recommended"] for r in rows)}
    for key in ("current", "recommended", "at_peak"):
        out[key] = {ph: sum(r[key][ph] for r in rows) for ph in PHASES}
    for key in ("needed", "needed_peak"):
        out[key] = {ph: (None if any(r[key][ph] is None for r in rows)
                         else round(sum(r[key][ph] for r in rows), 4)) for ph in PHASES}
    demand = {k: {ph: sum(r["demand"][k][ph] for r in rows) for ph in PHASES} for k in ("now", "peak")}
    out["demand"] = demand
    out["rho"] = {"now": _ratio(demand["now"]["prefill"], demand["now"]["decode"]),
                  "at_peak": _ratio(demand["peak"]["prefill"], demand["peak"]["decode"])}
    out["headroom"] = {
        which: {ph: (0.0 if out["needed"][ph] is None else _ratio(out[which][ph], out["needed"][ph]))
                for ph in PHASES} for which in ("current", "recommended")}
    out["bottleneck"], out["why"] = _bottleneck(out)
    return out


def _bottleneck(t: dict) -> tuple[str, str]:
    h = t["headroom"]["recommended"]
    if all(h[ph] is None for ph in PHASES):
        return "none", "no traffic: nothing binds"
    phase = min(PHASES, key=lambda ph: math.inf if h[ph] is None else h[ph])
    parts = []
    for ph in PHASES:
        need = t["needed"][ph]
        if need is None:
            parts.append(f"{ph}: some appliance cannot meet the SLO at any size")
        else:
            parts.append(f"{ph} {t['recommended'][ph]} GPUs recommended for {need:.2f} needed"
                         + (f" ({h[ph]:.2f}x)" if h[ph] is not None else ""))
    return phase, f"{phase} binds; " + "; ".join(parts)


def fleet_plan(results: list[tuple[str, dict | None, str | None]]) -> dict:
    """results: (url, plan or None, error or None) per appliance, in the order asked."""
    rows = [appliance_row(url, plan) for url, plan, err in results if plan is not None]
    sites: dict[str, list[dict]] = {}
    for r in rows:
        sites.setdefault(r["site"], []).append(r)
    return {
        "simulated": any(r["simulated"] for r in rows),
        "appliances": rows,
        "sites": {name: {**add_up(rs), "members": [r["appliance"] for r in rs]}
                  for name, rs in sorted(sites.items())},
        "fleet": add_up(rows) if rows else None,
        "unreachable": [{"url": url, "error": err} for url, plan, err in results if plan is None],
        "source": "each appliance's own plan (estimated; simulated where it says so)",
    }
