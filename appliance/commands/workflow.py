"""`applianced workflow …`: start, list, show (or follow) and cancel admin workflows."""
from __future__ import annotations

import json
import sys
import time

from appliance.commands.client import AdminClient, AdminError, add_client_args

FINISHED = ("succeeded", "failed", "cancelled", "compensated")


def add_parsers(sub) -> None:
    p = sub.add_parser("workflow", help="durable admin workflows (repartition, swap-model, drain)",
                       description="Start and watch durable admin workflows on a running daemon.")
    wsub = p.add_subparsers(dest="workflow_command", metavar="SUBCOMMAND", required=True)

    q = wsub.add_parser("start", help="start a workflow",
                        description="Start a workflow: repartition --split P+D, "
                                    "swap-model --model DIR|SPEC, drain, resume.")
    q.add_argument("kind", choices=["repartition", "swap-model", "drain", "resume"])
    q.add_argument("--split", help="repartition: prefill+decode worker counts, e.g. 6+2")
    q.add_argument("--model", help="swap-model: a checkpoint directory or a model spec name")
    q.add_argument("--model-name", help="swap-model: the name to serve it under")
    q.add_argument("--wait", action="store_true", help="follow it until it finishes")
    q.add_argument("--json", action="store_true")
    add_client_args(q)
    q.set_defaults(run=cmd_start)

    q = wsub.add_parser("list", help="list workflows", description="List recent workflows.")
    q.add_argument("--limit", type=int, default=20)
    q.add_argument("--json", action="store_true")
    add_client_args(q)
    q.set_defaults(run=cmd_list)

    q = wsub.add_parser("show", help="show one workflow and its steps",
                        description="Show one workflow, its steps as a table.")
    q.add_argument("id")
    q.add_argument("--follow", action="store_true", help="redraw until it finishes")
    q.add_argument("--json", action="store_true")
    add_client_args(q)
    q.set_defaults(run=cmd_show)

    q = wsub.add_parser("cancel", help="cancel a workflow (it compensates)",
                        description="Cancel a workflow: it stops at the next step boundary "
                                    "and compensates back to the state before it.")
    q.add_argument("id")
    add_client_args(q)
    q.set_defaults(run=cmd_cancel)


def params_for(args) -> dict:
    if args.kind == "repartition":
        if not args.split:
            raise ValueError("repartition needs --split P+D (e.g. --split 6+2)")
        return {"split": args.split}
    if args.split:
        raise ValueError(f"--split applies to repartition, not {args.kind}")
    if args.kind == "swap-model":
        if not args.model:
            raise ValueError("swap-model needs --model DIR|SPEC")
        params = {"model": args.model}
        if args.model_name:
            params["model_name"] = args.model_name
        return params
    if args.model or args.model_name:
        raise ValueError(f"--model applies to swap-model, not {args.kind}")
    return {}


def cmd_start(args) -> int:
    client = AdminClient.from_args(args)
    wf = client.post("/admin/v1/workflows", {"kind": args.kind, "params": params_for(args)})
    if args.json and not args.wait:
        print(json.dumps(wf, indent=2))
        return 0
    print(f"{wf['id']} ({wf['kind']}) {wf['status']}")
    if args.wait:
        return follow(client, wf["id"])
    return 0


def _when(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _took(s) -> str:
    if s.get("started_at") and s.get("finished_at"):
        return f"{s['finished_at'] - s['started_at']:.2f}s"
    return "-"


def format_workflow(wf: dict) -> str:
    lines = [f"{wf['id']}  {wf['kind']}  {json.dumps(wf['params'])}  {wf['status'].upper()}"
             + (f" ({wf['phase']})" if wf["phase"] != "forward" else "")
             + ("  cancel requested" if wf["cancel_requested"] and wf["status"] not in FINISHED
                else "")]
    if wf.get("error"):
        lines.append(f"error: {wf['error']}")
    lines.append(f"{'#':>2}  {'step':<18} {'status':<10} {'tries':>5} {'started':>9} "
                 f"{'took':>7}  result")
    for s in wf["steps"]:
        result = "" if s["result"] is None else json.dumps(s["result"], separators=(",", ":"))
        if len(result) > 70:
            result = result[:67] + "..."
        lines.append(f"{s['seq']:>2}  {s['name']:<18} {s['status']:<10} {s['attempts']:>5} "
                     f"{_when(s['started_at']):>9} {_took(s):>7}  {result}")
    return "\n".join(lines)


def follow(client: AdminClient, wid: str, interval: float = 0.5) -> int:
    """Redraw the workflow until it finishes; exit 0 when it succeeded."""
    tty = sys.stdout.isatty()
    last = None
    while True:
        wf = client.get(f"/admin/v1/workflows/{wid}")
        text = format_workflow(wf)
        if text != last:
            if tty and last is not None:
                print(f"\x1b[{last.count(chr(10)) + 1}F\x1b[J", end="")
            print(text, flush=True)
            if not tty:
                print()
            last = text
        if wf["status"] in FINISHED:
            return 0 if wf["status"] == "succeeded" else 1
        time.sleep(interval)


def cmd_list(args) -> int:
    data = AdminClient.from_args(args).get("/admin/v1/workflows", {"limit": args.limit})["data"]
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    if not data:
        print("no workflows")
        return 0
    print(f"{'id':<26} {'kind':<12} {'status':<12} {'step':<18} {'created':>9}  params")
    for wf in data:
        step = next((s["name"] for s in wf["steps"] if s["status"] in ("running", "pending")), "-")
        print(f"{wf['id']:<26} {wf['kind']:<12} {wf['status']:<12} {step:<18} "
              f"{_when(wf['created_at']):>9}  {json.dumps(wf['params'])}")
    return 0


def cmd_show(args) -> int:
    client = AdminClient.from_args(args)
    if args.follow:
        return follow(client, args.id)
    wf = client.get(f"/admin/v1/workflows/{args.id}")
    print(json.dumps(wf, indent=2) if args.json else format_workflow(wf))
    return 0


def cmd_cancel(args) -> int:
    wf = AdminClient.from_args(args).post(f"/admin/v1/workflows/{args.id}/cancel")
    print(f"{wf['id']} ({wf['kind']}): cancel requested; it stops at the next step boundary "
          "and compensates")
    return 0


__all__ = ["add_parsers", "AdminError"]
