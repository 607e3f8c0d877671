"""Who is calling: tenants by API key, operators by admin key, and what each may reach.

Keys are stored as SHA-256 digests and every configured digest is compared in constant
time, so neither a config leak nor response timing gives a key away. The OpenAI routes
need a tenant key once keys are configured; the admin surface (`/admin/…`) needs an
admin key, or, when none is configured, a loopback client: it shows worker pids, the
model directory and per-tenant usage, which a network neighbour has no business reading.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass

from aiohttp import web

from appliance.daemon.openai_protocol import ApiError

ADMIN_PREFIX = "/admin/"
CALLER = "caller"           # request[CALLER]: the Caller of an admin or metrics route


@dataclass(frozen=True, slots=True)
class Caller:
    """An admin-surface caller: an operator (admin key or trusted loopback), or a tenant
    whose API key may read its own usage and nothing else."""

    admin: bool
    tenant: str | None = None


def _digest(header: str) -> bytes | None:
    if not header.startswith("Bearer ") or not header[7:].strip():
        return None
    return hashlib.sha256(header[7:].strip().encode()).digest()


def _match(digest: bytes, known: list[tuple[bytes, str]]) -> str | None:
    found = None
    for candidate, name in known:       # no early exit: constant time over the list
        if hmac.compare_digest(digest, candidate):
            found = name
    return found


def is_loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False        # a unix socket or an unparsable peer: not trusted


class Auth:
    def __init__(self, keys: dict[str, str], admin_keys: list[str] | None = None,
                 metrics_access: str = "loopback"):
        self.keys = [(bytes.fromhex(d), t) for d, t in keys.items()]
        self.admin_keys = [(bytes.fromhex(d), "admin") for d in admin_keys or []]
        self.metrics_access = metrics_access

    def tenant(self, request: web.Request) -> str:
        """The tenant of an OpenAI-route request ("default" when no keys are set)."""
        if not self.keys:
            return "default"
        digest = _digest(request.headers.get("Authorization", ""))
        if digest is None:
            raise ApiError(401, "missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        found = _match(digest, self.keys)
        if found is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return found

    def caller(self, request: web.Request) -> Caller:
        """Who calls an admin route; raises 401/403 when nobody we trust."""
        digest = _digest(request.headers.get("Authorization", ""))
        if digest is not None:
            if self.admin_keys and _match(digest, self.admin_keys):
                return Caller(admin=True)
            tenant = _match(digest, self.keys) if self.keys else None
            if tenant is not None:
                return Caller(admin=False, tenant=tenant)
            if self.admin_keys or self.keys:
                raise ApiError(401, "invalid admin key", code="invalid_api_key")
        if not self.admin_keys and is_loopback(request):
            return Caller(admin=True)
        if self.admin_keys:
            raise ApiError(401, "the admin API needs an admin key (send 'Authorization: "
                                "Bearer KEY' with a key listed in [auth] admin_keys)",
                           code="invalid_api_key")
        raise ApiError(403, "the admin API answers loopback clients only while no "
                            "[auth] admin_keys are configured", code="forbidden")

    def metrics_allowed(self, request: web.Request) -> bool:
        if self.metrics_access == "open":
            return True
        if self.metrics_access == "loopback" and is_loopback(request):
            return True
        digest = _digest(request.headers.get("Authorization", ""))
        return bool(digest is not None and self.admin_keys and _match(digest, self.admin_keys))


def require_admin(request: web.Request) -> Caller:
    """For admin handlers that only operators may use (a tenant key gets 403)."""
    caller: Caller = request[CALLER]
    if not caller.admin:
        raise ApiError(403, "this admin route needs an admin key; a tenant key may read "
                            "its own /admin/v1/usage only", code="forbidden")
    return caller


def guard(auth: Auth):
    """Middleware: every `/admin/…` route gets request[CALLER] or a 401/403 first;
    `/metrics` follows `[auth] metrics_access`."""

    @web.middleware
    async def access_guard(request: web.Request, handler):
        path = request.path
        if path.startswith(ADMIN_PREFIX):
            request[CALLER] = auth.caller(request)
        elif path == "/metrics" and not auth.metrics_allowed(request):
            raise ApiError(403, "/metrics is closed to this client ([auth] metrics_access = "
                                f"{auth.metrics_access!r}); send an admin key",
                           code="forbidden")
        return await handler(request)

    return access_guard
