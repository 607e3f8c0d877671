"""`applianced usage` and `applianced carbon`: the ledger's reports from a running daemon.

By default a short table sorted by GPU-seconds (the GPU budget consumed), with the
conservation line under it; `--json` and `--csv` give the API's own answer.
"""
from __future__ import annotations

import json

from appliance.commands.client import AdminClient, add_client_args


def add_parsers(sub) -> None:
    p = sub.add_parser("usage", help="GPU-seconds, energy, cost and carbon per tenant/model/phase",
                       description="Per-request chargeback from the ledger, grouped.")
    add_client_args(p)
    p.add_argument("--by", default="tenant", help="tenant,model,phase,site (comma list; default tenant)")
    p.add_argument("--since", default="24h", help="ISO time or a span back from now (24h, 7d)")
    p.add_argument("--until", default=None, help="ISO time or a span back from now (default now)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--csv", action="store_true")
    p.set_defaults(run=cmd_usage)

    p = sub.add_parser("carbon", help="gCO2e per site/tenant with SCI and provenance",
                       description="Operational and embodied carbon from the ledger, grouped.")
    add_client_args(p)
    p.add_argument("--by", default="site", help="site,tenant,model (comma list; default site)")
    p.add_argument("--since", default="24h")
    p.add_argument("--until", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_carbon)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def cmd_usage(args) -> int:
    client = AdminClient.from_args(args)
    params = {"group_by": args.by, "since": args.since, "until": args.until}
    if args.csv:
        print(client.get("/admin/v1/usage", {**params, "format": "csv"}, raw=True).decode(), end="")
        return 0
    data = client.get("/admin/v1/usage", params)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    dims = data["group_by"]
    print(f"usage {data['since']} .. {data['until']}")
    head = "".join(f"{d:<18}" for d in dims)
    print(f"{head}{'requests':>9} {'prompt':>9} {'output':>9} {'GPU-s':>10} {'share':>6} "
          f"{'kJ':>9} {'$ usage':>9} {'$ alloc':>9} {'gCO2e':>9}")
    rows = sorted(data["rows"], key=lambda r: -r["gpu_seconds"])
    total_gpu = sum(r["gpu_seconds"] for r in rows) or 1.0
    for r in rows:
        flags = "" if r["measured"] else " (energy not measured)" if r["energy_joules"] is None \
            else " (estimated)"
        flags += " [SIMULATED]" if r["simulated"] else ""
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
    print("".join(f"{d:<18}" for d in dims) + f"{'requests':>9} {'gCO2e':>10} {'operational':>12} "
          f"{'embodied':>10} {'g/request':>10} {'g/1k tok':>9}  provenance")
    for r in data["rows"]:
        p = r["provenance"]
        prov = f"{','.join(p['sources'])} {','.join(p['kinds'])}" + \
            (" estimated" if p["estimated"] else "") + f"; energy {p['energy']}"
        print("".join(f"{str(r.get(d) if r.get(d) is not None else '-'):<18}" for d in dims)
              + f"{r['requests']:>9} {r['co2e_grams']:>10.3f} {_num(r['co2e_operational_grams'], '>12.3f')} "
              f"{r['co2e_embodied_grams']:>10.3f} {r['sci_grams_per_request']:>10.4f} "
              f"{_num(r['sci_grams_per_1k_tokens'], '>9.4f')}  {prov}")
    return 0
