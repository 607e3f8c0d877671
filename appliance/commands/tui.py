"""`applianced tui`: the live console, for one appliance or several (`--url` repeated,
or `[tui] urls` in the config)."""
from __future__ import annotations

import os

from appliance.commands.client import ADMIN_KEY_ENV, DEFAULT_URL, add_client_args, tls_from_args


def add_parsers(sub) -> None:
    p = sub.add_parser("tui", help="live console for one appliance or a fleet",
                       description="A live console: the prefill:decode ratio, devices, "
                                   "tenants, carbon, and a fleet view with several --url.")
    add_client_args(p, f"an appliance; repeat for a fleet (default: [tui] urls, else {DEFAULT_URL})")
    p.add_argument("--config", help="TOML config with [tui] urls "
                                    "(default /etc/applianced/config.toml if present)")
    p.set_defaults(run=cmd_tui)


def resolve_urls(cli_urls: list[str] | None, config_path: str | None) -> list[str]:
    """--url wins; then the config's [tui] urls; then the local daemon."""
    if cli_urls:
        urls = cli_urls
    else:
        from appliance import config
        urls = config.load(config_path).tui.urls or [DEFAULT_URL]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url {url!r}: expected http://host:port or https://host:port")
    return list(dict.fromkeys(u.rstrip("/") for u in urls))


def cmd_tui(args) -> int:
    urls = resolve_urls(args.url, args.config)
    try:
        from appliance.tui.app import run
    except ImportError as exc:            # textual missing from a stripped install
        raise ValueError(f"the console needs textual ({exc})") from None
    key = args.admin_key if args.admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
    return run(urls, key, tls_from_args(args))
