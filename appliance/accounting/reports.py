"""Usage and carbon reports over the ledger: the figures `/admin/v1/usage` and
`/admin/v1/carbon` return (the daemon only adds HTTP around them).

Rows come from request rows (by the request's finish time); totals from the device
windows (by window start), so over a span that covers whole windows, the rows'
GPU-seconds add up to `attributed_gpu_seconds` and attributed + idle + unattributed =
measured. Requests still waiting for their windows to close count with the figures
they have so far.
"""
from __future__ import annotations

import csv
import io
import re
import time
from datetime import datetime, timezone

from appliance.accounting.carbon import parse_time
from appliance.accounting.ledger import Ledger

USAGE_DIMS = ("tenant", "model", "phase", "site")
CARBON_DIMS = ("site", "tenant", "model")
IDLE_TENANT = "(idle)"
ROW_FIELDS = ("tenant", "model", "phase", "site", "requests", "prompt_tokens", "output_tokens",
              "gpu_seconds", "energy_joules", "cost_usage", "cost_allocation", "co2e_grams",
              "measured", "simulated")

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str | None, now: float, default: float) -> float:
    """ISO 8601 time, unix seconds, or a span back from now (`90m`, `24h`, `7d`)."""
    if text is None or text == "":
        return default
    text = text.strip()
    m = _RELATIVE.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_time(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give ISO 8601 (2026-11-23T10:00:00Z), "
                         "unix seconds, or a span back from now (30m, 24h, 7d)") from None


def parse_group_by(text: str | None, allowed: tuple[str, ...], default: tuple[str, ...]) -> list[str]:
    if text is None or text.strip() == "":
        return list(default)
    dims = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dims if d not in allowed]
    if bad:
        raise ValueError(f"cannot group by {', '.join(bad)} (allowed: {', '.join(allowed)})")
    return list(dict.fromkeys(dims))


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _phase_select(phase: str) -> str:
    p = phase
    return (f"{p}_gpu_s AS gpu_s, {p}_j AS j, {p}_cost_usage AS cu, {p}_cost_allocation AS ca, "
            f"{p}_co2e_op_g AS op, {p}_co2e_emb_g AS emb, '{p}' AS phase, "
            + ("prompt_tokens AS pt, 0 AS ot" if p == "prefill" else "0 AS pt, output_tokens AS ot"))


_BOTH = ("prefill_gpu_s + decode_gpu_s AS gpu_s, "
         "CASE WHEN prefill_j IS NULL AND decode_j IS NULL THEN NULL "
         "ELSE coalesce(prefill_j, 0) + coalesce(decode_j, 0) END AS j, "
         "prefill_cost_usage + decode_cost_usage AS cu, "
         "prefill_cost_allocation + decode_cost_allocation AS ca, "
         "CASE WHEN prefill_co2e_op_g IS NULL AND decode_co2e_op_g IS NULL THEN NULL "
         "ELSE coalesce(prefill_co2e_op_g, 0) + coalesce(decode_co2e_op_g, 0) END AS op, "
         "prefill_co2e_emb_g + decode_co2e_emb_g AS emb, NULL AS phase, "
         "prompt_tokens AS pt, output_tokens AS ot")

_BASE = ("request_id, tenant, model, site, finish, simulated, energy_source, "
         "intensity_g_per_kwh, intensity_source, intensity_kind, intensity_estimated, pue")


def _source(by_phase: bool, where: str) -> str:
    if by_phase:
        return (f"SELECT {_BASE}, {_phase_select('prefill')} FROM requests WHERE {where} "
                f"UNION ALL SELECT {_BASE}, {_phase_select('decode')} FROM requests WHERE {where}")
    return f"SELECT {_BASE}, {_BOTH} FROM requests WHERE {where}"


def _where(since: float, until: float, tenant: str | None) -> tuple[str, tuple]:
    where, args = "finish >= ? AND finish < ?", (since, until)
    if tenant is not None:
        where += " AND tenant = ?"
        args += (tenant,)
    return where, args


def totals(ledger: Ledger, since: float, until: float) -> dict:
    """Energy totals cover the windows whose energy was read (a window before the meter's
    first reading, or of a device it cannot read, has none): the identity holds over
    those, and `unmeasured_energy_windows` says how many were left out."""
    (r,) = ledger.query(
        "SELECT sum(attributed_gpu_s), sum(idle_gpu_s), sum(unattributed_gpu_s), "
        "sum(measured_gpu_s), sum(attributed_j), sum(idle_j), sum(unattributed_j), "
        "sum(measured_j), sum(idle_cost), count(measured_j), sum(measured_j IS NULL) "
        "FROM device_windows WHERE start >= ? AND start < ?", (since, until))
    e = (lambda v: v or 0.0) if r[9] else (lambda v: None)
    return {"attributed_gpu_seconds": r[0] or 0.0, "idle_gpu_seconds": r[1] or 0.0,
            "unattributed_gpu_seconds": r[2] or 0.0, "measured_gpu_seconds": r[3] or 0.0,
            "attributed_energy_joules": e(r[4]), "idle_energy_joules": e(r[5]),
            "unattributed_energy_joules": e(r[6]), "measured_energy_joules": e(r[7]),
            "unmeasured_energy_windows": r[10] or 0, "_idle_cost": r[8] or 0.0}


def usage(ledger: Ledger, group_by: list[str], since: float, until: float,
          tenant: str | None = None, idle_policy: str = "share") -> dict:
    """`tenant` set: a tenant's own view (its rows only; no appliance-wide totals)."""
    where, args = _where(since, until, tenant)
    by_phase = "phase" in group_by
    dims = [d for d in group_by]
    select_dims = ", ".join(dims) if dims else "NULL"
    sql = (f"SELECT {select_dims}, count(DISTINCT request_id), sum(pt), sum(ot), sum(gpu_s), "
           f"sum(j), sum(j IS NULL), sum(cu), sum(ca), sum(coalesce(op, 0) + emb), "
           f"min(energy_source = 'measured'), max(simulated) "
           f"FROM ({_source(by_phase, where)}) "
           + (f"GROUP BY {select_dims} " if dims else ""))
    rows = []
    for r in ledger.query(sql, args * (2 if by_phase else 1)):
        vals = dict(zip(dims, r[:len(dims)])) if dims else {}
        (n, pt, ot, gpu, j, j_null, cu, ca, co2, measured, simulated) = r[max(len(dims), 1):]
        if not n:
            continue
        rows.append({"tenant": vals.get("tenant"), "model": vals.get("model"),
                     "phase": vals.get("phase"), "site": vals.get("site"),
                     "requests": n, "prompt_tokens": pt or 0, "output_tokens": ot or 0,
                     "gpu_seconds": gpu or 0.0, "energy_joules": None if j_null else (j or 0.0),
                     "cost_usage": cu or 0.0, "cost_allocation": ca or 0.0,
                     "co2e_grams": co2 or 0.0, "measured": bool(measured),
                     "simulated": bool(simulated)})
    if tenant is None:
        tot = totals(ledger, since, until)
        idle_cost = tot.pop("_idle_cost")
        if idle_policy == "idle" and tot["measured_gpu_seconds"]:
            ie = tot["idle_energy_joules"]
            rows.append({"tenant": IDLE_TENANT, "model": None, "phase": None, "site": None,
                         "requests": 0, "prompt_tokens": 0, "output_tokens": 0,
                         "gpu_seconds": tot["idle_gpu_seconds"] + tot["unattributed_gpu_seconds"],
                         "energy_joules": None if ie is None
                         else ie + tot["unattributed_energy_joules"],
                         "cost_usage": 0.0, "cost_allocation": idle_cost, "co2e_grams": 0.0,
                         "measured": tot["measured_energy_joules"] is not None,
                         "simulated": any(r["simulated"] for r in rows)})
    else:
        tot = {k: None for k in ("attributed_gpu_seconds", "idle_gpu_seconds",
                                 "unattributed_gpu_seconds", "measured_gpu_seconds",
                                 "attributed_energy_joules", "idle_energy_joules",
                                 "unattributed_energy_joules", "measured_energy_joules",
                                 "unmeasured_energy_windows")}
    rows.sort(key=lambda r: -r["gpu_seconds"])
    return {"since": iso(since), "until": iso(until), "group_by": group_by, "rows": rows,
            "totals": tot}


def usage_csv(report: dict) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(ROW_FIELDS)
    for r in report["rows"]:
        w.writerow(["" if r[f] is None else str(r[f]).lower() if isinstance(r[f], bool)
                    else r[f] for f in ROW_FIELDS])
    return out.getvalue()


def carbon(ledger: Ledger, group_by: list[str], since: float, until: float) -> dict:
    where, args = _where(since, until, None)
    dims = list(group_by)
    select_dims = ", ".join(dims) if dims else "NULL"
    sql = (f"SELECT {select_dims}, count(*), sum(pt), sum(ot), sum(j), sum(j IS NULL), "
           f"sum(op), sum(emb), min(intensity_g_per_kwh), max(intensity_g_per_kwh), "
           f"sum(intensity_g_per_kwh * coalesce(j, 0)), min(pue), max(pue), "
           f"group_concat(DISTINCT intensity_source), group_concat(DISTINCT intensity_kind), "
           f"max(intensity_estimated), min(energy_source = 'measured'), max(simulated) "
           f"FROM ({_source(False, where)}) " + (f"GROUP BY {select_dims}" if dims else ""))
    rows = []
    for r in ledger.query(sql, args):
        vals = dict(zip(dims, r[:len(dims)])) if dims else {}
        (n, pt, ot, j, j_null, op, emb, imin, imax, iwsum, pmin, pmax, sources, kinds,
         est, measured, simulated) = r[max(len(dims), 1):]
        if not n:
            continue
        op_known = not j_null
        total = (op or 0.0) + (emb or 0.0)
        tokens = (pt or 0) + (ot or 0)
        rows.append({
            **{d: vals.get(d) for d in dims},
            "requests": n, "prompt_tokens": pt or 0, "output_tokens": ot or 0,
            "energy_joules": j if op_known else None,
            "co2e_operational_grams": op if op_known else None,
            "co2e_embodied_grams": emb or 0.0, "co2e_grams": total,
            "sci_grams_per_request": total / n,
            "sci_grams_per_1k_tokens": total / tokens * 1000 if tokens else None,
            "intensity_g_per_kwh": {"min": imin, "max": imax,
                                    "energy_weighted": iwsum / j if op_known and j else None},
            "pue": {"min": pmin, "max": pmax},
            "provenance": {"sources": sorted((sources or "").split(",")) if sources else [],
                           "kinds": sorted((kinds or "").split(",")) if kinds else [],
                           "estimated": bool(est),
                           "energy": "measured" if measured else
                           ("not measured" if not op_known else "estimated or simulated")},
            "measured": bool(measured), "simulated": bool(simulated)})
    rows.sort(key=lambda r: -r["co2e_grams"])
    return {"since": iso(since), "until": iso(until), "group_by": group_by, "rows": rows,
            "note": "operational = attributed energy x PUE x grid intensity at the request's "
                    "arrival; embodied = device embodied carbon x GPU-seconds / lifetime; "
                    "SCI per 1k tokens counts prompt + output tokens"}


def now() -> float:
    return time.time()
