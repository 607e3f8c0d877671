"""One chargeback view of several boxes: their usage reports (`reports.usage` answers,
fetched per box) joined into one, and their FOCUS exports into one file.

Two boxes serving as a prefill/decode pair bill each its own phase under the same
request id; the decode box's row counts neither the request nor its tokens (the front's
does: `rollups.COUNTED`). So joining is summing: per group, GPU-seconds, energy, cost and
carbon are the boxes' sums (each box's carbon at its own site's intensity, each box's
cost against its own capacity), and requests and tokens add up to each request once.
"""
from __future__ import annotations

from appliance.accounting.reports import IDLE_TENANT

_SUMMED = ("requests", "prompt_tokens", "output_tokens", "gpu_seconds", "cost_usage",
           "cost_allocation", "co2e_grams", "requests_without_energy")


class JoinError(ValueError):
    """Reports that cannot be added up (one line)."""


def _key(row: dict, dims: list[str]) -> tuple:
    # the (idle) row stays its own row whatever the grouping
    return (*(row.get(d) for d in dims), row.get("tenant") == IDLE_TENANT)


def join_usage(parts: list[tuple[str, dict]]) -> dict:
    """`parts`: (box url, its `/admin/v1/usage` JSON) for the same group_by and window."""
    if not parts:
        raise JoinError("no box to join")
    first = parts[0][1]
    dims = list(first["group_by"])
    currency = first.get("currency", "USD")
    for url, rep in parts[1:]:
        if list(rep["group_by"]) != dims:
            raise JoinError(f"{url} grouped by {rep['group_by']}, not {dims}")
        if rep.get("currency", "USD") != currency:
            raise JoinError(f"{url} prices in {rep.get('currency')}, {parts[0][0]} in {currency}: "
                            "costs in two currencies cannot be added")
    rows: dict[tuple, dict] = {}
    for url, rep in parts:
        for r in rep["rows"]:
            key = _key(r, dims)
            a = rows.get(key)
            if a is None:
                rows[key] = {**r, "boxes": [url]}
                continue
            for f in _SUMMED:
                a[f] = (a.get(f) or 0) + (r.get(f) or 0)
            # energy unknown on any box leaves the sum unknown, as within one box
            a["energy_joules"] = (None if a.get("energy_joules") is None
                                  or r.get("energy_joules") is None
                                  else a["energy_joules"] + r["energy_joules"])
            a["co2e_complete"] = bool(a.get("co2e_complete", True) and r.get("co2e_complete", True))
            a["measured"] = bool(a.get("measured") and r.get("measured"))
            a["simulated"] = bool(a.get("simulated") or r.get("simulated"))
            a["boxes"].append(url)
    policies = sorted({rep.get("idle_policy", "share") for _, rep in parts})
    return {"since": first["since"], "until": first["until"], "group_by": dims,
            "idle_policy": policies[0] if len(policies) == 1 else ",".join(policies),
            "currency": currency,
            "boxes": [{"url": url, "rows": len(rep["rows"]), "totals": rep.get("totals")}
                      for url, rep in parts],
            "rows": sorted(rows.values(), key=lambda r: -r["gpu_seconds"]),
            "totals": _join_totals([rep.get("totals") or {} for _, rep in parts], currency),
            "note": (f"{len(parts)} boxes joined: GPU-seconds, energy, cost and carbon are "
                     "summed; each request and its tokens counted once (at the box that "
                     "received it)")}


def _join_totals(totals: list[dict], currency: str) -> dict:
    """Each box's capacity, idle and measured figures, summed; a figure one box does not
    have (None: not measured there) is None in the sum."""
    out: dict = {}
    for k in totals[0]:
        vals = [t.get(k) for t in totals]
        if k in ("currency", "utilization"):
            continue
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = sum(vals)
        else:
            out[k] = None
    out["currency"] = currency
    cap, used = out.get("capacity_cost"), out.get("used_cost")
    out["utilization"] = used / cap if cap and used is not None else None
    return out


def join_focus(parts: list[tuple[str, str]]) -> str:
    """Each box's FOCUS CSV, one after the other under one header. Every row already
    names its box (ResourceId, BillingAccountId) and site (RegionId), and a decode box's
    rows count no requests or tokens, so the file sums to the pair's totals."""
    header = None
    lines: list[str] = []
    for url, text in parts:
        got = text.splitlines()
        if not got:
            raise JoinError(f"{url} sent an empty FOCUS export")
        if header is None:
            header = got[0]
        elif got[0] != header:
            raise JoinError(f"{url} sent FOCUS columns that differ from {parts[0][0]}'s "
                            "(different applianced versions?)")
        lines += got[1:]
    return "\n".join([header, *lines]) + "\n"
