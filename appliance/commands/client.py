"""A small synchronous client of the daemon's admin API, for the CLI.

Every failure becomes `AdminError` with one line for the operator (no daemon, a 4xx with
the daemon's own message, a timeout); the CLI prints it and exits 1.
"""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000"
ADMIN_KEY_ENV = "APPLIANCED_ADMIN_KEY"
CACERT_ENV = "APPLIANCED_CACERT"


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
    p.add_argument("--cacert", default=None, metavar="PEM",
                   help=f"CA bundle that signed the daemon's certificate, for https:// URLs "
                        f"(default: ${CACERT_ENV}, else the system's)")
    p.add_argument("--cert", default=None, metavar="PEM",
                   help="client certificate, when [auth] admin_client_ca asks for one")
    p.add_argument("--key", default=None, metavar="PEM",
                   help="the client certificate's private key (default: in --cert's file)")


def tls_context(cacert: str | None = None, cert: str | None = None,
                key: str | None = None) -> ssl.SSLContext | None:
    """The client side of TLS for https:// daemons: verify against --cacert (or the
    system's CAs), present --cert/--key when given. None when nothing is asked for, so
    the library's default verification applies. A bad file: AdminError, one line."""
    cacert = cacert or os.environ.get(CACERT_ENV) or None
    if key and not cert:
        raise AdminError("--key needs --cert (the certificate it belongs to)")
    if not (cacert or cert):
        return None
    def failed(flag: str, path: str, exc: Exception) -> AdminError:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
        return AdminError(f"{flag} {path}: {reason}")
    try:
        ctx = ssl.create_default_context(cafile=cacert)
    except (ssl.SSLError, OSError) as exc:
        raise failed("--cacert", cacert, exc) from None
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise failed("--cert/--key", f"{cert} {key or ''}".strip(), exc) from None
    return ctx


def tls_from_args(args) -> ssl.SSLContext | None:
    return tls_context(getattr(args, "cacert", None), getattr(args, "cert", None),
                       getattr(args, "key", None))


class AdminClient:
    def __init__(self, url: str = DEFAULT_URL, admin_key: str | None = None,
                 timeout: float = 10.0, tls: ssl.SSLContext | None = None):
        self.url = url.rstrip("/")
        self.admin_key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
        self.timeout = timeout
        self.tls = tls

    @classmethod
    def from_args(cls, args, url: str | None = None) -> "AdminClient":
        return cls(url or args.url, getattr(args, "admin_key", None), tls=tls_from_args(args))

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
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.tls) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path}: HTTP {exc.code}: {_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise AdminError(f"{self.url}: the daemon's certificate does not verify "
                                 f"({reason.verify_message}; give its CA with --cacert)") from None
            if isinstance(reason, ssl.SSLError):
                raise AdminError(f"{self.url}: TLS failed ({reason.reason or reason}; a "
                                 "client certificate may be needed: --cert/--key)") from None
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
