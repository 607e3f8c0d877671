"""Usage and carbon reports over the ledger: the figures `/admin/v1/usage` and
`/admin/v1/carbon` return (the daemon only adds HTTP around them).

Rows come from request rows (by the request's finish time); totals from the device
windows overlapping the query window (each clipped to it). Whole hours (and at the
edges whole minutes) that are rolled up are read from the rollups (rollups.py), which
keep the same quantities summed, so a report over a month reads thousands of rows. Money and carbon are
computed here, at query time (`allocation.py`): the rows' quantities are their usage,
the device windows' capacity is the pot, and Σ rows' allocation (+ the `(idle)` row)
= the devices' capacity cost of the window; the same for carbon. Requests still
waiting for their windows to close count with the figures they have so far.

Across boxes (two appliances serving as a prefill/decode pair) each box bills its own
phase under the same request id: the front's row counts the request and its tokens, the
decode box's row (endpoint `cluster_decode`) bills its decode time but counts neither
(`COUNTED`, `PT`, `OT`), so the boxes' reports add up, request counts included.
"""
from __future__ import annotations

import csv
import io
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from appliance.accounting import rollups
from appliance.accounting.rollups import CLUSTER_DECODE, COUNTED, OT, PT  # noqa: F401
from appliance.accounting.allocation import Method, Pots, fractions, window_pots
from appliance.accounting.carbon import EmbodiedCarbon, parse_time
from appliance.accounting.cost import PriceBook
from appliance.accounting.ledger import Ledger

USAGE_DIMS = ("tenant", "model", "phase", "site")
# One row per request (and whatever else is asked): read from the request rows alone
# (the rollups have no ids), so only as far back as [accounting] retention_days keeps them.
REQUEST_DIM = "request_id"
USAGE_GROUPS = (*USAGE_DIMS, REQUEST_DIM)
CARBON_DIMS = ("site", "tenant", "model")
IDLE_TENANT = "(idle)"
TAG_KEYS = ("team", "project", "cost_center")
TAG_DIMS = tuple(f"tag:{k}" for k in TAG_KEYS)
ROW_FIELDS = ("tenant", "model", "phase", "site", "requests", "prompt_tokens", "output_tokens",
              "gpu_seconds", "energy_joules", "cost_usage", "cost_allocation", "currency",
              "co2e_grams", "co2e_complete", "requests_without_energy", "measured", "simulated")

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
    """Dimensions, plus `tag:team`, `tag:project`, `tag:cost_center` (the tenant's key tags)."""
    if text is None or text.strip() == "":
        return list(default)
    dims = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dims if d not in allowed and d not in TAG_DIMS]
    if bad:
        raise ValueError(f"cannot group by {', '.join(bad)} (allowed: "
                         f"{', '.join((*allowed, *TAG_DIMS))})")
    return list(dict.fromkeys(dims))


def tag_dims(dims: list[str]) -> list[str]:
    return [d for d in dims if d.startswith("tag:")]


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")



_BOTH = ("prefill_gpu_s + decode_gpu_s AS gpu_s, "
         "CASE WHEN prefill_j IS NULL AND decode_j IS NULL THEN NULL "
         "ELSE coalesce(prefill_j, 0) + coalesce(decode_j, 0) END AS j, "
         "prefill_cost_usage + decode_cost_usage AS cu, "
         "CASE WHEN prefill_co2e_op_g IS NULL AND decode_co2e_op_g IS NULL THEN NULL "
         "ELSE coalesce(prefill_co2e_op_g, 0) + coalesce(decode_co2e_op_g, 0) END AS op, "
         "prefill_co2e_emb_g + decode_co2e_emb_g AS emb, NULL AS phase, "
         f"{PT} AS pt, {OT} AS ot")

_BASE = ("request_id, tenant, model, site, endpoint, finish, simulated, energy_source, "
         "intensity_g_per_kwh, intensity_source, intensity_kind, intensity_estimated, pue")


def _source(where: str) -> str:
    return f"SELECT {_BASE}, {_BOTH} FROM requests WHERE {where}"


def default_method(idle_policy: str = "share") -> Method:
    return Method(PriceBook({}, 0.0, idle_policy), EmbodiedCarbon({}, {}))


@dataclass
class _Group:
    """One report row before pricing: its quantities and its usage weights."""

    dims: dict
    requests: int
    pt: int
    ot: int
    gpu_s: float
    j: float | None
    j_null: int                 # requests (or request phases) without an energy reading
    w_cost: float
    w_op: float
    w_emb: float
    measured: bool
    simulated: bool
    imin: float | None = None
    imax: float | None = None
    sources: str = ""
    kinds: str = ""
    estimated: bool = False
    # its shares of the pots, filled by _shares
    f_cost: float = 0.0
    f_op: float = 0.0
    f_emb: float = 0.0


_SHARED = ("min(energy_source = 'measured'), max(simulated), min(intensity_g_per_kwh), "
           "max(intensity_g_per_kwh), group_concat(DISTINCT intensity_source), "
           "group_concat(DISTINCT intensity_kind), max(intensity_estimated)")


def _phase_sums(p: str) -> str:
    return (f"sum({p}_gpu_s), sum({p}_j), sum({p}_j IS NULL AND {p}_gpu_s > 0), "
            f"sum({p}_cost_usage), sum(coalesce({p}_co2e_op_g, 0)), sum({p}_co2e_emb_g)")


def _raw_sql(keys: list[str], by_phase: bool) -> str:
    """The request rows of [?, ?) per `keys`, in one pass over them: with `phase`, both
    phases' sums side by side (split by `_split_phases`); a UNION ALL of the two phases
    read every row twice, and the raw rows are what a report's time goes to."""
    where = "finish >= ? AND finish < ?"
    if by_phase:
        k = ", ".join(d for d in keys if d != "phase")
        return (f"SELECT {k}, {COUNTED}, sum({PT}), sum({OT}), "
                f"{_phase_sums('prefill')}, {_phase_sums('decode')}, {_SHARED} "
                f"FROM requests WHERE {where} GROUP BY {k}")
    return (f"SELECT {', '.join(keys)}, {COUNTED}, sum(pt), sum(ot), sum(gpu_s), sum(j), "
            f"sum(j IS NULL AND gpu_s > 0), sum(cu), sum(coalesce(op, 0)), sum(emb), {_SHARED} "
            f"FROM ({_source(where)}) GROUP BY {', '.join(keys)}")


def _split_phases(rows: list[tuple], keys: list[str]) -> list[tuple]:
    """`_raw_sql`'s rows with both phases as one row per phase, in `keys` order."""
    i = keys.index("phase")
    n = len(keys) - 1
    out = []
    for r in rows:
        k, (count, pt, ot), pre, dec, shared = (r[:n], r[n:n + 3], r[n + 3:n + 9],
                                                 r[n + 9:n + 15], r[n + 15:])
        for phase, sums, toks in (("prefill", pre, (pt, 0)), ("decode", dec, (0, ot))):
            out.append((*k[:i], phase, *k[i:], count, *toks, *sums, *shared))
    return out


def _merge(a: list, r: tuple) -> None:
    """Add a piece's figures (n, pt, ot, gpu, j, j_null, cu, op, emb, measured, simulated,
    imin, imax, sources, kinds, est) to a group's."""
    for i in (0, 1, 2, 3, 5, 6, 7, 8):
        a[i] = (a[i] or 0) + (r[i] or 0)
    a[4] = a[4] if r[4] is None else (a[4] or 0.0) + r[4]
    a[9], a[11] = _min(a[9], r[9]), _min(a[11], r[11])
    a[10], a[12], a[15] = _max(a[10], r[10]), _max(a[12], r[12]), _max(a[15], r[15])
    for i in (13, 14):
        if r[i]:
            a[i] = ",".join(sorted(set(filter(None, f"{a[i] or ''},{r[i]}".split(",")))))


def _groups(ledger: Ledger, dims: list[str], since: float, until: float,
            tenant_tags: dict | None = None) -> list[_Group]:
    """Request rows that finished in [since, until), grouped by `dims` and always by
    tenant (a tenant's own view needs every tenant's weights for its shares). Tag
    dimensions are the tenant's tags, looked up here (query time) from `tenant_tags`.
    Whole rolled hours and minutes are read from the rollups, the rest from the rows
    (rollups.usage_segments); the pieces are summed per group."""
    by_phase = "phase" in dims
    tags = tag_dims(dims)
    keys = list(dict.fromkeys([*(d for d in dims if d not in tags), "tenant"]))
    raw = _raw_sql(keys, by_phase)
    rolled = rollups.usage_sql(keys, by_phase)
    sums: dict[tuple, list] = {}
    segments = ([("raw", since, until)] if REQUEST_DIM in keys
                else rollups.usage_segments(ledger.query, since, until))
    for kind, a, b in segments:
        if kind == "raw":
            got = ledger.query(raw, (a, b))
            if by_phase:
                got = _split_phases(got, keys)
        else:
            got = ledger.query(rolled, (kind, a, b))
        for r in got:
            key = tuple(r[:len(keys)])
            acc = sums.get(key)
            if acc is None:
                sums[key] = list(r[len(keys):])
            else:
                _merge(acc, r[len(keys):])
    out = []
    for key, r in sums.items():
        vals = dict(zip(keys, key))
        own = (tenant_tags or {}).get(vals["tenant"], {})
        for d in tags:
            vals[d] = own.get(d[4:])
        (n, pt, ot, gpu, j, j_null, cu, op, emb, measured, simulated, imin, imax, sources,
         kinds, est) = r
        if not n and not gpu and not cu:    # nothing ran, nothing counted
            continue
        # a request that ran nothing (rejected) has no energy to read and lacks none
        out.append(_Group(vals, n, pt or 0, ot or 0, gpu or 0.0, None if j_null else (j or 0.0),
                          j_null or 0, max(cu or 0.0, 0.0), max(op or 0.0, 0.0),
                          max(emb or 0.0, 0.0), bool(measured), bool(simulated), imin, imax,
                          sources or "", kinds or "", bool(est)))
    return out


def _shares(groups: list[_Group]) -> None:
    gpu = [g.gpu_s for g in groups]
    n = [float(g.requests) for g in groups]
    for g, f in zip(groups, fractions([g.w_cost for g in groups], gpu, n)):
        g.f_cost = f
    for g, f in zip(groups, fractions([g.w_op for g in groups], gpu, n)):
        g.f_op = f
    for g, f in zip(groups, fractions([g.w_emb for g in groups], gpu, n)):
        g.f_emb = f


def _fold(groups: list[_Group], dims: list[str], tenant: str | None) -> list[_Group]:
    """The internal per-tenant groups folded into the asked dimensions (and, for a
    tenant's own view, only its own)."""
    out: dict[tuple, _Group] = {}
    for g in groups:
        if tenant is not None and g.dims.get("tenant") != tenant:
            continue
        key = tuple(g.dims.get(d) for d in dims)
        a = out.get(key)
        if a is None:
            out[key] = _Group({d: g.dims.get(d) for d in dims}, g.requests, g.pt, g.ot, g.gpu_s,
                              g.j, g.j_null, g.w_cost, g.w_op, g.w_emb, g.measured, g.simulated,
                              g.imin, g.imax, g.sources, g.kinds, g.estimated,
                              g.f_cost, g.f_op, g.f_emb)
            continue
        a.requests += g.requests
        a.pt += g.pt
        a.ot += g.ot
        a.gpu_s += g.gpu_s
        a.j = None if a.j is None or g.j is None else a.j + g.j
        a.j_null += g.j_null
        a.measured &= g.measured
        a.simulated |= g.simulated
        a.imin = _min(a.imin, g.imin)
        a.imax = _max(a.imax, g.imax)
        a.sources = ",".join(sorted(set(filter(None, (a.sources + "," + g.sources).split(",")))))
        a.kinds = ",".join(sorted(set(filter(None, (a.kinds + "," + g.kinds).split(",")))))
        a.estimated |= g.estimated
        a.f_cost += g.f_cost
        a.f_op += g.f_op
        a.f_emb += g.f_emb
    return list(out.values())


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def _carbon_of(g: _Group, p: Pots, share: bool, market: bool) -> dict:
    """A row's allocated carbon: its shares of the operational pots (by its energy
    usage) and of the embodied pot (by its GPU-seconds), whole pots with `share`, the
    attributed parts with `idle`."""
    active, static, node = p.op_active_g * g.f_op, p.op_static_g * g.f_op, p.op_node_g * g.f_op
    used, idle = p.emb_used_g * g.f_emb, p.emb_idle_g * g.f_emb
    if not share:
        static = node = idle = 0.0
    out = {"operational_active": active, "operational_idle_static": static,
           "operational_node_overhead": node, "embodied_used": used, "embodied_idle": idle}
    if market:
        m = p.market_active_g + ((p.market_static_g + p.market_node_g) if share else 0.0)
        out["market_operational"] = m * g.f_op
    return out


def _idle_carbon(p: Pots, market: bool) -> dict:
    out = {"operational_active": 0.0, "operational_idle_static": p.op_static_g,
           "operational_node_overhead": p.op_node_g, "embodied_used": 0.0,
           "embodied_idle": p.emb_idle_g}
    if market:
        out["market_operational"] = p.market_static_g + p.market_node_g
    return out


def _everything_idle(p: Pots, market: bool) -> dict:
    """No request in the window: nobody to share with, the whole pot is idle."""
    out = {"operational_active": p.op_active_g, "operational_idle_static": p.op_static_g,
           "operational_node_overhead": p.op_node_g, "embodied_used": p.emb_used_g,
           "embodied_idle": p.emb_idle_g}
    if market:
        out["market_operational"] = p.market_g
    return out


def _total(c: dict) -> float:
    return sum(v for k, v in c.items() if k != "market_operational")


def _op(c: dict) -> float:
    return c["operational_active"] + c["operational_idle_static"] + c["operational_node_overhead"]


def _totals(p: Pots, m: Method) -> dict:
    """Energy totals cover the windows whose energy was read (a window before the meter's
    first reading, or of a device it cannot read, has none): the identity holds over
    those, and `unmeasured_energy_windows` says how many were left out."""
    e = (lambda v: v) if p.windows > p.unmeasured_windows else (lambda v: None)
    return {"attributed_gpu_seconds": p.attributed_s, "idle_gpu_seconds": p.idle_s,
            "unattributed_gpu_seconds": p.unattributed_s, "measured_gpu_seconds": p.device_seconds,
            "attributed_energy_joules": e(p.attributed_j), "idle_energy_joules": e(p.idle_j),
            "unattributed_energy_joules": e(p.unattributed_j),
            "measured_energy_joules": e(p.measured_j),
            "node_overhead_energy_joules": p.node_overhead_j,
            "facility_energy_joules": e(p.measured_j * m.pue + p.node_overhead_j * m.pue),
            "unmeasured_energy_windows": p.unmeasured_windows,
            "capacity_cost": p.capacity_cost, "used_cost": p.used_cost, "idle_cost": p.idle_cost,
            "currency": m.currency,
            "utilization": p.used_cost / p.capacity_cost if p.capacity_cost > 0 else None}


def usage(ledger: Ledger, group_by: list[str], since: float, until: float,
          tenant: str | None = None, idle_policy: str | None = None,
          method: Method | None = None) -> dict:
    """`tenant` set: a tenant's own view (its rows only; no appliance-wide totals)."""
    m = method or default_method(idle_policy or "share")
    policy = idle_policy or m.idle_policy
    share = policy == "share"
    p = window_pots(ledger.query, since, until, m)
    groups = _groups(ledger, group_by, since, until, m.tenant_tags)
    _shares(groups)
    rows = []
    tags = tag_dims(group_by)
    by_request = REQUEST_DIM in group_by
    for g in _fold(groups, group_by, tenant):
        c = _carbon_of(g, p, share, False)
        rows.append({"tenant": g.dims.get("tenant"), "model": g.dims.get("model"),
                     "phase": g.dims.get("phase"), "site": g.dims.get("site"),
                     **({REQUEST_DIM: g.dims.get(REQUEST_DIM)} if by_request else {}),
                     **{d: g.dims.get(d) for d in tags},
                     "requests": g.requests, "prompt_tokens": g.pt, "output_tokens": g.ot,
                     "gpu_seconds": g.gpu_s, "energy_joules": g.j,
                     "cost_usage": p.used_cost * g.f_cost,
                     "cost_allocation": (p.capacity_cost if share else p.used_cost) * g.f_cost,
                     "currency": m.currency, "co2e_grams": _total(c),
                     "co2e_complete": g.j_null == 0, "requests_without_energy": g.j_null,
                     "measured": g.measured, "simulated": g.simulated})
    if tenant is None:
        tot = _totals(p, m)
        idle_row = None
        if not groups and p.windows:
            idle_row = (p.capacity_cost, p.device_seconds, p.measured_j, _everything_idle(p, False))
        elif not share and p.windows:
            idle_row = (p.idle_cost, p.idle_s + p.unattributed_s, p.idle_j + p.unattributed_j,
                        _idle_carbon(p, False))
        if idle_row is not None:
            cost, secs, joules, c = idle_row
            rows.append({"tenant": IDLE_TENANT, "model": None, "phase": None, "site": None,
                         **({REQUEST_DIM: None} if by_request else {}),
                         **{d: None for d in tags},
                         "requests": 0, "prompt_tokens": 0, "output_tokens": 0,
                         "gpu_seconds": secs,
                         "energy_joules": None if tot["measured_energy_joules"] is None else joules,
                         "cost_usage": 0.0, "cost_allocation": cost, "currency": m.currency,
                         "co2e_grams": _total(c), "co2e_complete": p.unmeasured_windows == 0,
                         "requests_without_energy": 0,
                         "measured": tot["measured_energy_joules"] is not None,
                         "simulated": any(r["simulated"] for r in rows)})
    else:
        tot = {k: None for k in ("attributed_gpu_seconds", "idle_gpu_seconds",
                                 "unattributed_gpu_seconds", "measured_gpu_seconds",
                                 "attributed_energy_joules", "idle_energy_joules",
                                 "unattributed_energy_joules", "measured_energy_joules",
                                 "node_overhead_energy_joules", "facility_energy_joules",
                                 "unmeasured_energy_windows", "capacity_cost", "used_cost",
                                 "idle_cost", "utilization")}
        tot["currency"] = m.currency
    rows.sort(key=lambda r: -r["gpu_seconds"])
    return {"since": iso(since), "until": iso(until), "group_by": group_by,
            "idle_policy": policy, "currency": m.currency, "rows": rows, "totals": tot,
            "note": ("no request finished in this window: its whole capacity is the (idle) row"
                     if tenant is None and not groups and p.windows else None)}


def usage_csv(report: dict) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    by_request = [REQUEST_DIM] if REQUEST_DIM in report["group_by"] else []
    fields = (*ROW_FIELDS[:4], *by_request, *tag_dims(report["group_by"]), *ROW_FIELDS[4:])
    w.writerow(fields)
    for r in report["rows"]:
        w.writerow(["" if r[f] is None else str(r[f]).lower() if isinstance(r[f], bool)
                    else r[f] for f in fields])
    return out.getvalue()


def _provenance(sources: str, kinds: str, estimated: bool, basis: str) -> dict:
    return {"sources": sorted(set(sources.split(","))) if sources else [],
            "kinds": sorted(set(kinds.split(","))) if kinds else [], "estimated": estimated,
            "basis": basis}


def carbon(ledger: Ledger, group_by: list[str], since: float, until: float,
           method: Method | None = None) -> dict:
    """gCO2e per group after SCI: operational = all energy of the provisioned devices
    (idle and static included, and the node overhead) × PUE × the grid intensity at the
    time; embodied = every device's wall-clock time × embodied ÷ lifetime; both
    allocated like cost. Σ rows (+ the `(idle)` row) = the window's totals."""
    m = method or default_method()
    share = m.idle_policy == "share"
    market = m.market_g_per_kwh is not None
    p = window_pots(ledger.query, since, until, m)
    groups = _groups(ledger, group_by, since, until, m.tenant_tags)
    _shares(groups)
    src = m.intensity.source
    rows = []
    for g in _fold(groups, group_by, None):
        c = _carbon_of(g, p, share, market)
        rows.append(_carbon_row(g.dims, g.requests, g.pt, g.ot, g.j, g.j_null, c, g.measured,
                                g.simulated, {"min": g.imin, "max": g.imax},
                                _provenance(g.sources, g.kinds, g.estimated or p.intensity_estimated,
                                            "location"), m))
    idle = None
    if not groups and p.windows:
        idle = _everything_idle(p, market)
    elif not share and p.windows:
        idle = _idle_carbon(p, market)
    if idle is not None:
        rows.append(_carbon_row({d: IDLE_TENANT if d == "tenant" else None for d in group_by},
                                0, 0, 0, p.idle_j + p.unattributed_j, 0, idle,
                                p.unmeasured_windows == 0, any(r["simulated"] for r in rows),
                                {"min": p.intensity_min, "max": p.intensity_max},
                                _provenance(src, m.intensity.kind, p.intensity_estimated,
                                            "location"), m))
    rows.sort(key=lambda r: -r["co2e_grams"])
    requests = sum(g.requests for g in groups)
    tokens = sum(g.pt + g.ot for g in groups)
    total = p.op_g + p.emb_g
    facility = p.measured_j * m.pue + p.node_overhead_j * m.pue
    totals = {
        "requests": requests, "tokens": tokens,
        "energy_joules": p.measured_j, "node_overhead_energy_joules": p.node_overhead_j,
        "facility_energy_joules": facility, "unmeasured_energy_windows": p.unmeasured_windows,
        "co2e_operational_grams": p.op_g, "co2e_embodied_grams": p.emb_g, "co2e_grams": total,
        "components": {"operational_active": p.op_active_g, "operational_idle_static": p.op_static_g,
                       "operational_node_overhead": p.op_node_g, "embodied_used": p.emb_used_g,
                       "embodied_idle": p.emb_idle_g},
        "co2e_market_operational_grams": p.market_g if market else None,
        "sci_grams_per_request": total / requests if requests else None,
        "sci_grams_per_1k_tokens": total / tokens * 1000 if tokens else None,
        "co2e_complete": p.unmeasured_windows == 0 and all(g.j_null == 0 for g in groups),
        "requests_without_energy": sum(g.j_null for g in groups),
        "intensity_g_per_kwh": {"min": p.intensity_min, "max": p.intensity_max,
                                "energy_weighted": p.intensity_weighted / facility if facility
                                else None},
        "provenance": _provenance(src, m.intensity.kind, p.intensity_estimated, "location"),
        "market_provenance": (_provenance("static", "average", False, "market") if market
                              else None)}
    return {"since": iso(since), "until": iso(until), "group_by": group_by,
            "idle_policy": m.idle_policy, "rows": rows, "totals": totals,
            "note": "location-based (SCI): operational = all device energy in the window (idle "
                    "and static included) + node overhead, x PUE x grid intensity at the time; "
                    "embodied = every device's wall-clock time x embodied / lifetime; both "
                    "allocated to rows like cost (energy usage, GPU-seconds). Market-based "
                    "operational is a second column, never in SCI. SCI per 1k tokens counts "
                    "prompt + output tokens"}


def _carbon_row(dims: dict, n: int, pt: int, ot: int, j, j_null: int, c: dict, measured: bool,
                simulated: bool, intensity: dict, provenance: dict, m: Method) -> dict:
    total = _total(c)
    tokens = pt + ot
    provenance["energy"] = ("measured" if measured else
                            "not measured" if j is None else "estimated or simulated")
    return {**dims, "requests": n, "prompt_tokens": pt, "output_tokens": ot,
            "energy_joules": j, "co2e_operational_grams": _op(c),
            "co2e_embodied_grams": c["embodied_used"] + c["embodied_idle"], "co2e_grams": total,
            "components": {k: v for k, v in c.items() if k != "market_operational"},
            "co2e_market_operational_grams": c.get("market_operational"),
            "sci_grams_per_request": total / n if n else None,
            "sci_grams_per_1k_tokens": total / tokens * 1000 if tokens else None,
            "co2e_complete": j_null == 0 and (n > 0 or measured),
            "requests_without_energy": j_null,
            "intensity_g_per_kwh": intensity, "pue": m.pue, "provenance": provenance,
            "market_provenance": ({"sources": ["static"], "kinds": ["average"],
                                   "estimated": False, "basis": "market"}
                                  if "market_operational" in c else None),
            "measured": measured, "simulated": simulated}


def now() -> float:
    return time.time()
