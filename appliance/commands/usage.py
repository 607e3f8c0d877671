"""`applianced usage`, `applianced carbon` and `applianced rates`: the ledger's reports
from a running daemon.

By default a short table sorted by GPU-seconds (the GPU budget consumed), with the
conservation and capacity lines under it; `--json` and `--csv` give the API's own answer.
`usage --url FRONT --url DECODE` joins the reports of boxes serving as one
(accounting/cluster_join.py): one window for all (resolved here, not by each box's
clock), one row per group.
"""
from __future__ import annotations

import json
import time

from appliance.commands.client import DEFAULT_URL, AdminClient, AdminError, add_client_args


def add_parsers(sub) -> None:
    p = sub.add_parser("usage", help="GPU-seconds, energy, cost and carbon per tenant/model/phase",
                       description="Per-request chargeback from the ledger, grouped. Several "
                                   "--url: the boxes of a prefill/decode pair joined into one "
                                   "report (each request counted once).")
    add_client_args(p, fleet_help=f"a daemon (default {DEFAULT_URL}); repeat for the boxes "
                                  "of a cluster, joined into one report")
    p.add_argument("--by", default="tenant",
                   help="tenant,model,phase,site,request_id,tag:team,tag:project,"
                        "tag:cost_center (comma list; default tenant)")
    p.add_argument("--since", default="24h", help="ISO time or a span back from now (24h, 7d)")
    p.add_argument("--until", default=None, help="ISO time or a span back from now (default now)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--csv", action="store_true")
    out.add_argument("--focus", action="store_true",
                     help="FOCUS 1.2 cost-and-usage CSV: tenant x model x phase x site x hour")
    p.set_defaults(run=cmd_usage)

    p = sub.add_parser("carbon", help="gCO2e per site/tenant with SCI and provenance",
                       description="Operational and embodied carbon from the ledger, grouped.")
    add_client_args(p)
    p.add_argument("--by", default="site",
                   help="site,tenant,model,tag:team,tag:project,tag:cost_center (comma list; "
                        "default site)")
    p.add_argument("--since", default="24h")
    p.add_argument("--until", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_carbon)

    p = sub.add_parser("rates", help="the rate cards the reports price with",
                       description="Price per device-hour and per kWh, with effective dates.")
    add_client_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_rates)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _window(since: str, until: str | None) -> tuple[str, str]:
    """The window as absolute times, so every box reports the same one."""
    from appliance.accounting.reports import parse_when
    now = time.time()
    try:
        t1 = parse_when(until, now, now)
        t0 = parse_when(since, now, t1 - 86400.0)
    except ValueError as exc:
        raise AdminError(f"bad --since/--until: {exc}") from None
    return repr(t0), repr(t1)


def _each(args, urls: list[str], params: dict, raw: bool = False) -> list[tuple[str, object]]:
    """Every box's answer; a box that fails stops the join with one line naming it."""
    out = []
    for url in urls:
        try:
            out.append((url, AdminClient.from_args(args, url).get("/admin/v1/usage", params,
                                                                    raw=raw)))
        except AdminError as exc:
            msg = str(exc)
            raise AdminError(msg if url.rstrip("/") in msg else f"{url}: {msg}") from None
    return out


def _joined(args, urls: list[str]):
    """The boxes' reports (or FOCUS exports) joined: (json report | None, text | None)."""
    from appliance.accounting.cluster_join import JoinError, join_focus, join_usage
    since, until = _window(args.since, args.until)
    params = {"group_by": args.by, "since": since, "until": until}
    try:
        if args.focus:
            parts = _each(args, urls, {**params, "format": "focus"}, raw=True)
            return None, join_focus([(u, b.decode()) for u, b in parts])
        data = join_usage(_each(args, urls, params))
    except JoinError as exc:
        raise AdminError(str(exc)) from None
    if args.csv:
        from appliance.accounting.reports import usage_csv
        return None, usage_csv(data)
    return data, None


def cmd_usage(args) -> int:
    urls = list(dict.fromkeys(u.rstrip("/") for u in (args.url or [DEFAULT_URL])))
    if len(urls) > 1:
        data, text = _joined(args, urls)
        if text is not None:
            print(text, end="")
            return 0
    else:
        client = AdminClient.from_args(args, urls[0])
        params = {"group_by": args.by, "since": args.since, "until": args.until}
        if args.csv or args.focus:
            fmt = "focus" if args.focus else "csv"
            print(client.get("/admin/v1/usage", {**params, "format": fmt}, raw=True).decode(),
                  end="")
            return 0
        data = client.get("/admin/v1/usage", params)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    dims = data["group_by"]
    cur = data.get("currency", "USD")
    print(f"usage {data['since']} .. {data['until']} (prices in {cur}, idle "
          f"{data.get('idle_policy', 'share')})")
    if data.get("boxes"):
        print("boxes: " + ", ".join(b["url"] for b in data["boxes"]))
    head = "".join(f"{d:<18}" for d in dims)
    print(f"{head}{'requests':>9} {'prompt':>9} {'output':>9} {'GPU-s':>10} {'share':>6} "
          f"{'kJ':>9} {'usage':>9} {'alloc':>9} {'gCO2e':>9}")
    rows = sorted(data["rows"], key=lambda r: -r["gpu_seconds"])
    total_gpu = sum(r["gpu_seconds"] for r in rows) or 1.0
    for r in rows:
        flags = "" if r["measured"] else " (energy not measured)" if r["energy_joules"] is None \
            else " (estimated)"
        flags += " [SIMULATED]" if r["simulated"] else ""
        if r.get("requests_without_energy"):
            flags += f" (carbon incomplete: {r['requests_without_energy']} without energy)"
        kj = None if r["energy_joules"] is None else r["energy_joules"] / 1000
        print("".join(f"{str(r.get(d) if r.get(d) is not None else '-'):<18}" for d in dims)
              + f"{r['requests']:>9} {r['prompt_tokens']:>9} {r['output_tokens']:>9} "
              f"{r['gpu_seconds']:>10.3f} {r['gpu_seconds'] / total_gpu:>6.1%} {_num(kj, '>9.2f')} "
              f"{r['cost_usage']:>9.4f} {r['cost_allocation']:>9.4f} {r['co2e_grams']:>9.2f}{flags}")
    t = data["totals"]
    if t.get("measured_gpu_seconds") is not None:
        print(f"device-seconds: attributed {t['attributed_gpu_seconds']:.3f} + idle "
              f"{t['idle_gpu_seconds']:.3f} + unattributed {t['unattributed_gpu_seconds']:.3f} "
              f"= measured {t['measured_gpu_seconds']:.3f}")
        if t.get("measured_energy_joules") is not None:
            print(f"energy J: attributed {t['attributed_energy_joules']:.1f} + idle "
                  f"{t['idle_energy_joules']:.1f} + unattributed {t['unattributed_energy_joules']:.1f}"
                  f" = measured {t['measured_energy_joules']:.1f}")
        if t.get("capacity_cost") is not None:
            util = t.get("utilization")
            print(f"capacity cost {t['capacity_cost']:.4f} {cur} = used {t['used_cost']:.4f} + "
                  f"idle {t['idle_cost']:.4f}"
                  + (f" (utilization {util:.1%})" if util is not None else ""))
    if data.get("note"):
        print(data["note"])
    for b in data.get("budgets", []):
        alert = " ALERT " + ",".join(f"{a['threshold']:.0%}" for a in b["alerts"]) if b["alerts"] else ""
        print(f"budget {b['tenant']} {b['budget']} per {b['period']}: {b['used']:.6g} of "
              f"{b['limit']:.6g} ({b['used_ratio']:.0%}){alert}")
    return 0


def cmd_carbon(args) -> int:
    data = AdminClient.from_args(args).get(
        "/admin/v1/carbon", {"group_by": args.by, "since": args.since, "until": args.until})
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    dims = data["group_by"]
    s = data["site"]
    print(f"carbon {data['since']} .. {data['until']} — site {s['name']} ({s['region'] or 'region ?'}), "
          f"PUE {s['pue']}, intensity {s['intensity_source']} ({s['intensity_kind']})")
    market = s.get("market_g_per_kwh") is not None
    print("".join(f"{d:<18}" for d in dims) + f"{'requests':>9} {'gCO2e':>10} {'operational':>12} "
          f"{'node':>8} {'embodied':>10} {'g/request':>10} {'g/1k tok':>9}"
          + (f" {'market op':>10}" if market else "") + "  provenance")
    for r in data["rows"]:
        p = r["provenance"]
        prov = f"{','.join(p['sources'])} {','.join(p['kinds'])} {p.get('basis', 'location')}" + \
            (" estimated" if p["estimated"] else "") + f"; energy {p['energy']}"
        if not r.get("co2e_complete", True):
            prov += f"; INCOMPLETE: {r.get('requests_without_energy', 0)} requests without energy"
        node = (r.get("components") or {}).get("operational_node_overhead")
        print("".join(f"{str(r.get(d) if r.get(d) is not None else '-'):<18}" for d in dims)
              + f"{r['requests']:>9} {r['co2e_grams']:>10.3f} {_num(r['co2e_operational_grams'], '>12.3f')} "
              f"{_num(node, '>8.3f')} {r['co2e_embodied_grams']:>10.3f} "
              f"{_num(r['sci_grams_per_request'], '>10.4f')} "
              f"{_num(r['sci_grams_per_1k_tokens'], '>9.4f')}"
              + (f" {_num(r.get('co2e_market_operational_grams'), '>10.3f')}" if market else "")
              + f"  {prov}")
    t = data.get("totals")
    if t:
        print(f"total {t['co2e_grams']:.3f} gCO2e (operational {t['co2e_operational_grams']:.3f}, "
              f"of it node overhead {t['components']['operational_node_overhead']:.3f}; embodied "
              f"{t['co2e_embodied_grams']:.3f}); SCI {_num(t['sci_grams_per_request'], '.4f')} "
              f"g/request, {_num(t['sci_grams_per_1k_tokens'], '.4f')} g/1k tokens"
              + ("" if t["co2e_complete"] else " (INCOMPLETE: energy not read everywhere)"))
        if t.get("co2e_market_operational_grams") is not None:
            print(f"market-based operational (not in SCI): "
                  f"{t['co2e_market_operational_grams']:.3f} gCO2e")
    return 0


def cmd_rates(args) -> int:
    data = AdminClient.from_args(args).get("/admin/v1/rates", {})
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"rates in {data['currency']}; energy priced on {data['energy_basis']}")
    for c in data["cards"]:
        prices = ", ".join(f"{m} {v:g}/h" for m, v in c["per_device_hour"].items())
        print(f"from {c['effective'] or 'the beginning':<22} {prices}; {c['per_kwh']:g}/kWh")
    if data.get("unpriced_models"):
        print(f"no price for: {', '.join(data['unpriced_models'])} (billed at 0)")
    return 0
