"""A small synchronous client of the daemon's admin API, for the CLI.

Every failure becomes `AdminError` with one line for the operator (no daemon, a 4xx with
the daemon's own message, a timeout); the CLI prints it and exits 1.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000"
ADMIN_KEY_ENV = "APPLIANCED_ADMIN_KEY"


class AdminError(Exception):
    """One line for the operator."""


def add_client_args(p, fleet_help: str | None = None) -> None:
    """--url and --admin-key; with `fleet_help`, --url may repeat (a fleet view) and
    defaults to None, so the command can tell "none given" from the default."""
    if fleet_help is None:
        p.add_argument("--url", default=DEFAULT_URL, help=f"the daemon (default {DEFAULT_URL})")
    else:
        p.add_argument("--url", action="append", default=None, metavar="URL", help=fleet_help)
    p.add_argument("--admin-key", default=None,
                   help=f"admin key (default: ${ADMIN_KEY_ENV}; none needed on loopback "
                        "while no [auth] admin_keys are configured)")


class AdminClient:
    def __init__(self, url: str = DEFAULT_URL, admin_key: str | None = None,
                 timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.admin_key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
        self.timeout = timeout

    @classmethod
    def from_args(cls, args) -> "AdminClient":
        return cls(args.url, getattr(args, "admin_key", None))

    def request(self, method: str, path: str, params: dict | None = None,
                body: dict | None = None, raw: bool = False):
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path}: HTTP {exc.code}: {_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(f"no daemon at {self.url} ({reason})") from None
        if raw:
            return payload
        try:
            return json.loads(payload)
        except ValueError:
            raise AdminError(f"{method} {path}: the daemon answered something not JSON") from None

    def get(self, path: str, params: dict | None = None, raw: bool = False):
        return self.request("GET", path, params=params, raw=raw)

    def post(self, path: str, body: dict | None = None):
        return self.request("POST", path, body=body if body is not None else {})


def _message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")
