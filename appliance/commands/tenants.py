"""`applianced tenants` (each tenant's share, limits, live rate, budget state) and
`applianced reload` (re-read [tenants] and [budgets] without a restart)."""
from __future__ import annotations

import json
import os
import signal
import sys

from appliance.commands.client import AdminClient, add_client_args


def add_parsers(sub) -> None:
    p = sub.add_parser("tenants", help="per-tenant weights, limits, rates and budget state",
                       description="Each tenant's weight, priority, limits, current rate, "
                                   "concurrency, queue depth and budget state.")
    add_client_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_tenants)

    p = sub.add_parser("reload", help="re-read [tenants] and [budgets] from the config file",
                       description="Re-read [tenants] and [budgets] from the daemon's config "
                                   "file (validated first; a bad file changes nothing).")
    add_client_args(p)
    p.add_argument("--pid", type=int, default=None,
                   help="send SIGHUP to this daemon process instead of calling the admin "
                        "API (systemd's ExecReload: needs no admin key; the outcome goes "
                        "to the daemon's log)")
    p.set_defaults(run=cmd_reload)


def _limit(v) -> str:
    return "-" if not v else f"{v:g}"


def render_tenants(data: dict) -> str:
    lines = [f"{'tenant':<16}{'weight':>7}{'prio':>6}{'conc':>9}{'rpm':>13}{'tpm':>17}"
             f"{'queue':>6}{'refused':>8}  budget"]
    for t in data.get("tenants", []):
        lim, rate = t["limits"], t["rate"]
        conc = f"{t['inflight']}/{t['max_concurrent'] or '-'}"
        rpm = f"{rate['requests_per_minute']}/{_limit(lim['requests_per_minute'])}"
        tpm = f"{rate['tokens_per_minute']}/{_limit(lim['tokens_per_minute'])}"
        prio = str(t["priority"]) + ("!" if t.get("deprioritized") else "")
        queue = "n/a" if t.get("queue_depth") is None else str(t["queue_depth"])
        refused = sum(t.get("rejected", {}).values())
        b = t["budget"]
        parts = [f"{x['budget']} {x['used']:.4g}/{x['limit']:.4g}" for x in b["budgets"]]
        budget = (", ".join(parts) or "-") + f" [{b['enforce']}]" + (" SPENT" if b["spent"] else "")
        lines.append(f"{t['tenant']:<16}{t['weight']:>7g}{prio:>6}{conc:>9}{rpm:>13}{tpm:>17}"
                     f"{queue:>6}{refused:>8}  {budget}")
    lines.append("rates: the last minute, used/limit; conc: in flight/max_concurrent; "
                 "prio ! = lowered by a spent budget")
    if data.get("queue_depth_note"):
        lines.append(data["queue_depth_note"])
    if not data.get("budgets_tracked"):
        lines.append("budgets: not tracked ([accounting] enabled = false)")
    return "\n".join(lines)


def cmd_tenants(args) -> int:
    data = AdminClient.from_args(args).get("/admin/v1/tenants")
    print(json.dumps(data, indent=2) if args.json else render_tenants(data))
    return 0


def cmd_reload(args) -> int:
    if args.pid is not None:
        return _signal_reload(args.pid)
    data = AdminClient.from_args(args).post("/admin/v1/reload")
    enforce = data["budgets"]["enforce"]
    print(f"reloaded {data['reloaded']}: tenants {', '.join(data['tenants']) or '(none)'}; "
          f"budgets {data['budgets']['period']}, enforce "
          f"{', '.join(f'{k}={v}' for k, v in enforce.items()) or '(alert only)'}")
    return 0


def _signal_reload(pid: int) -> int:
    """SIGHUP to the daemon: the same reload, answered in its log, not here."""
    if pid <= 1:
        print(f"applianced: reload --pid: not a daemon pid: {pid}", file=sys.stderr)
        return 2
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        print(f"applianced: reload --pid: no process {pid}", file=sys.stderr)
        return 1
    except PermissionError:
        print(f"applianced: reload --pid: not allowed to signal process {pid}", file=sys.stderr)
        return 1
    print(f"sent SIGHUP to {pid}: the daemon re-reads [tenants] and [budgets]; "
          "the outcome is in its log")
    return 0
