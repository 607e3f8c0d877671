"""Who is calling: tenants by API key, operators by admin key, and what each may reach.

Keys are stored as SHA-256 digests and every configured digest is compared in constant
time, so neither a config leak nor response timing gives a key away. The OpenAI routes
need a tenant key once keys are configured; the admin surface (`/admin/…`) needs an
admin key, or, when none is configured, a loopback client: it shows worker pids, the
model directory and per-tenant usage, which a network neighbour has no business reading.

Keys come from two sources, merged: the config file (`[auth.keys]`, `admin_keys`, fixed
for the daemon's life) and the keys file in the state directory (`applianced keys …`,
swapped in whole by `set_file_keys` when it changes). Every key has a name, which is
what logs and the audit log show; never the key. With `[auth] admin_client_ca`, the
admin surface also needs a verified client certificate, whose subject joins the name.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.tls import subject

ADMIN_PREFIX = "/admin/"
CALLER = "caller"           # request[CALLER]: the Caller of an admin or metrics route


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What a matched key stands for."""

    name: str
    tenant: str | None = None       # None: an admin key
    admin: bool = False
    expires: float | None = None    # unix seconds; None: never


@dataclass(frozen=True, slots=True)
class Caller:
    """An admin-surface caller: an operator (admin key or trusted loopback), or a tenant
    whose API key may read its own usage and nothing else. `identity` (not compared) is
    who it is in logs: the key's name and/or the client certificate's subject."""

    admin: bool
    tenant: str | None = None
    identity: str = field(default="anonymous", compare=False)


class AuthFailure(ApiError):
    """An ApiError raised by authentication, so the guard can audit it."""


def _digest(header: str) -> bytes | None:
    if not header.startswith("Bearer ") or not header[7:].strip():
        return None
    return hashlib.sha256(header[7:].strip().encode()).digest()


def _match(digest: bytes, known: list[tuple[bytes, KeyInfo]]) -> KeyInfo | None:
    found = None
    for candidate, info in known:       # no early exit: constant time over the list
        if hmac.compare_digest(digest, candidate):
            found = info
    return found


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False        # a unix socket or an unparsable peer: not trusted


class Auth:
    def __init__(self, keys: dict[str, str], admin_keys: list[str] | None = None,
                 metrics_access: str = "loopback", *, key_names: dict[str, str] | None = None,
                 client_ca: bool = False, admin_port: int = 0):
        names = key_names or {}
        self._config_keys = [(bytes.fromhex(d), KeyInfo(names.get(d, f"config:{d[:8]}"), t))
                             for d, t in keys.items()]
        self._config_admin = [(bytes.fromhex(d), KeyInfo(f"admin:{d[:8]}", admin=True))
                              for d in admin_keys or []]
        self.metrics_access = metrics_access
        self.client_ca = client_ca          # admin routes need a verified client certificate
        self.admin_port = admin_port        # >0: admin routes only on this listener's port
        self.last_used: dict[str, float] = {}
        self.set_file_keys([])

    def set_file_keys(self, records) -> None:
        """Swap in the keys file's records (keystore.KeyRecord). Revoked ones are left
        out; a name or digest the config file already has is refused (ValueError), and
        the previous file keys stay."""
        taken = {i.name for _, i in self._config_keys + self._config_admin}
        digests = {d for d, _ in self._config_keys + self._config_admin}
        keys, admin = [], []
        for r in records:
            if r.name in taken:
                raise ValueError(f"key name {r.name!r} is defined in the config file and "
                                 f"in the keys file")
            raw = bytes.fromhex(r.digest)
            if raw in digests:
                raise ValueError(f"key {r.name!r} of the keys file is also in the config file")
            if r.revoked is not None:
                continue
            info = KeyInfo(r.name, r.tenant, r.admin, r.expires)
            (admin if r.admin else keys).append((raw, info))
        self.keys = self._config_keys + keys
        self.admin_keys = self._config_admin + admin
        self.tenants = frozenset(i.tenant for _, i in self.keys if i.tenant)

    def _check_expiry(self, info: KeyInfo) -> KeyInfo:
        now = time.time()
        if info.expires is not None and now >= info.expires:
            raise AuthFailure(401, f"API key {info.name!r} expired at {_when(info.expires)}",
                              code="expired_api_key")
        self.last_used[info.name] = now
        return info

    def tenant(self, request: web.Request) -> str:
        """The tenant of an OpenAI-route request ("default" when no keys are set)."""
        if not self.keys:
            return "default"
        digest = _digest(request.headers.get("Authorization", ""))
        if digest is None:
            raise AuthFailure(401, "missing API key (send 'Authorization: Bearer KEY')",
                              code="invalid_api_key")
        found = _match(digest, self.keys)
        if found is None:
            raise AuthFailure(401, "invalid API key", code="invalid_api_key")
        return self._check_expiry(found).tenant

    def client_subject(self, request: web.Request) -> str | None:
        """The verified client certificate's subject, or a 401 when one is required."""
        if not self.client_ca:
            return None
        transport = request.transport
        who = subject(transport.get_extra_info("peercert") if transport is not None else None)
        if who is None:
            raise AuthFailure(401, "the admin API needs a client certificate signed by "
                                   "[auth] admin_client_ca (mutual TLS)",
                              code="client_certificate_required")
        return who

    def caller(self, request: web.Request) -> Caller:
        """Who calls an admin route; raises 401/403 when nobody we trust."""
        cert = self.client_subject(request)
        with_cert = (lambda name: f"{name} cert={cert}") if cert else (lambda name: name)
        digest = _digest(request.headers.get("Authorization", ""))
        if digest is not None:
            if self.admin_keys and (info := _match(digest, self.admin_keys)):
                return Caller(admin=True, identity=with_cert(self._check_expiry(info).name))
            info = _match(digest, self.keys) if self.keys else None
            if info is not None:
                info = self._check_expiry(info)
                return Caller(admin=False, tenant=info.tenant, identity=with_cert(info.name))
            if self.admin_keys or self.keys:
                raise AuthFailure(401, "invalid admin key", code="invalid_api_key")
        if not self.admin_keys and is_loopback(request):
            return Caller(admin=True, identity=with_cert("loopback"))
        if self.admin_keys:
            raise AuthFailure(401, "the admin API needs an admin key (send 'Authorization: "
                                   "Bearer KEY' with a key listed in [auth] admin_keys or made "
                                   "with `applianced keys add NAME --admin`)",
                              code="invalid_api_key")
        raise AuthFailure(403, "the admin API answers loopback clients only while no "
                               "[auth] admin_keys are configured", code="forbidden")

    def metrics_allowed(self, request: web.Request) -> bool:
        if self.metrics_access == "open":
            return True
        if self.metrics_access == "loopback" and is_loopback(request):
            return True
        digest = _digest(request.headers.get("Authorization", ""))
        return bool(digest is not None and self.admin_keys and _match(digest, self.admin_keys))

    def on_admin_listener(self, request: web.Request) -> bool:
        """Whether this request came in on the admin listener (always, when shared)."""
        if not self.admin_port:
            return True
        transport = request.transport
        name = transport.get_extra_info("sockname") if transport is not None else None
        return isinstance(name, tuple) and name[1] == self.admin_port


def require_admin(request: web.Request) -> Caller:
    """For admin handlers that only operators may use (a tenant key gets 403)."""
    caller: Caller = request[CALLER]
    if not caller.admin:
        raise ApiError(403, "this admin route needs an admin key; a tenant key may read "
                            "its own /admin/v1/usage only", code="forbidden")
    return caller


def guard(auth: Auth, on_failure: Callable[[web.Request, ApiError], None] | None = None):
    """Middleware: every `/admin/…` route gets request[CALLER] or a 401/403 first (each
    refusal reported to `on_failure`: the audit log); `/metrics` follows `[auth]
    metrics_access`. With a separate admin listener, `/admin/…` is served there only and
    the OpenAI routes everywhere else."""

    @web.middleware
    async def access_guard(request: web.Request, handler):
        path = request.path
        if auth.admin_port and path.startswith(("/admin/", "/v1/")):
            if path.startswith(ADMIN_PREFIX) != auth.on_admin_listener(request):
                where = "the admin listener" if path.startswith(ADMIN_PREFIX) else \
                    "the API listener (server.host/port)"
                raise ApiError(404, f"no route {request.method} {path} here: it is served on "
                                    f"{where}", code="unknown_route")
        if path.startswith(ADMIN_PREFIX):
            try:
                request[CALLER] = auth.caller(request)
            except AuthFailure as err:
                if on_failure is not None:
                    on_failure(request, err)
                raise
        elif path == "/metrics" and not auth.metrics_allowed(request):
            raise ApiError(403, "/metrics is closed to this client ([auth] metrics_access = "
                                f"{auth.metrics_access!r}); send an admin key",
                           code="forbidden")
        return await handler(request)

    return access_guard
