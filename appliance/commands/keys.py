"""`applianced keys add|list|revoke`: API keys without a restart.

These write the keys file in the state directory directly (see `appliance.keystore` for
why not through the admin API); the running daemon picks a change up within a second.
Run them on the box as root (`sudo applianced keys …`: files made in the daemon's state
directory are given to its owner) or as the daemon's user with `--state-dir`.
"""
from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import sys


def add_parsers(sub) -> None:
    p = sub.add_parser("keys", help="add, list and revoke API keys (no restart)",
                       description="Manage the keys file in the state directory: the running "
                                   "daemon picks changes up within a second.")
    ksub = p.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)

    q = ksub.add_parser("add", help="make a key; it is printed once",
                        description="Make a new key for a tenant (or an admin key), print it "
                                    "once, store only its SHA-256 digest.")
    q.add_argument("name", help="the key's name (shown in logs and the audit log)")
    q.add_argument("--tenant", help="the tenant (microservice) the key bills to")
    q.add_argument("--admin", action="store_true", help="an admin key (the /admin/ API)")
    q.add_argument("--expires", metavar="DURATION", help="valid for this long, e.g. 90d, 12h")
    q.add_argument("--tags", action="append", default=[], metavar="K=V[,K=V]",
                   help="the tenant's tags: team, project, cost_center")
    _common(q)
    q.set_defaults(run=cmd_add)

    q = ksub.add_parser("list", help="list keys: tenant, created, expires, last used",
                        description="List the keys of the keys file (never the keys).")
    q.add_argument("--json", action="store_true")
    _common(q)
    q.set_defaults(run=cmd_list)

    q = ksub.add_parser("revoke", help="revoke a key (refused from its next request)",
                        description="Revoke a key: its next request gets 401.")
    q.add_argument("name")
    _common(q)
    q.set_defaults(run=cmd_revoke)


def _common(q) -> None:
    q.add_argument("--config", help="TOML config (default /etc/applianced/config.toml if present)")
    q.add_argument("--state-dir", help="state directory (default: as `serve`)")


def _where(args):
    from appliance import config, keystore
    cfg = config.load(args.config)
    state = config.state_dir(cfg, args.state_dir)
    return cfg, state, keystore.keys_path(state)


def _tags(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        for part in filter(None, item.split(",")):
            k, sep, v = part.partition("=")
            if not sep or not k.strip() or not v.strip():
                raise ValueError(f"--tags {part!r}: expected KEY=VALUE (e.g. team=search)")
            out[k.strip()] = v.strip()
    return out


def _who() -> str:
    """The local user, and who they were before sudo (`cli:applianced sudo:alice`)."""
    try:
        who = f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        who = f"cli:uid {os.getuid()}"
    sudo = os.environ.get("SUDO_USER")
    return f"{who} sudo:{sudo}" if sudo else who


def _audit(state, action: str, params: dict, result: str) -> None:
    from appliance.audit import AuditLog
    AuditLog.in_state_dir(state).record(action, _who(), result, remote="local", params=params)


def cmd_add(args) -> int:
    from appliance import keystore
    from appliance.config import parse_duration
    cfg, state, path = _where(args)
    expires = parse_duration(args.expires) if args.expires else None
    taken = set(cfg.auth.key_names.values()) | {f"admin:{d[:8]}" for d in cfg.auth.admin_keys}
    params = {"name": args.name, "tenant": args.tenant, "admin": args.admin,
              "expires": args.expires}
    try:
        key, record = keystore.add(path, args.name, tenant=args.tenant, admin=args.admin,
                                   expires_s=expires, tags=_tags(args.tags), taken=taken)
    except keystore.KeyFileError as exc:
        _audit(state, "key.add", params, f"refused: {exc}")
        raise
    _audit(state, "key.add", params, "added")
    print(key)
    if sys.stderr.isatty():
        print(f"applianced: key {record.name!r} added to {path}; it is shown only now",
              file=sys.stderr)
    return 0


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def cmd_list(args) -> int:
    from appliance import keystore
    _, state, path = _where(args)
    records = keystore.read(path)
    used = keystore.read_used(state)
    rows = []
    for r in records:
        status = "revoked" if r.revoked is not None else "expired" if r.expired() else "active"
        rows.append({"name": r.name, "tenant": r.tenant, "admin": r.admin, "created": r.created,
                     "expires": r.expires, "last_used": used.get(r.name), "status": status,
                     "tags": r.tags})
    if args.json:
        print(json.dumps({"keys": rows}, indent=2))
        return 0
    if not rows:
        print(f"no keys in {path}")
        return 0
    table = [("NAME", "TENANT", "CREATED", "EXPIRES", "LAST USED", "STATUS")]
    table += [(r["name"], "(admin)" if r["admin"] else r["tenant"], _when(r["created"]),
               _when(r["expires"]), _when(r["last_used"]), r["status"]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def cmd_revoke(args) -> int:
    from appliance import keystore
    _, state, path = _where(args)
    try:
        keystore.revoke(path, args.name)
    except keystore.KeyFileError as exc:
        _audit(state, "key.revoke", {"name": args.name}, f"refused: {exc}")
        raise
    _audit(state, "key.revoke", {"name": args.name}, "revoked")
    print(f"revoked {args.name}")
    return 0
