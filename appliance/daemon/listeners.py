"""The listeners' TLS set-up: which context each listener gets, from the config.

- No `[server] tls_cert`: plain HTTP (and a warning when bound beyond loopback).
- TLS, no `[auth] admin_client_ca`: one server context for every listener.
- TLS with `admin_client_ca` on a shared listener: the context asks every client for a
  certificate (CERT_OPTIONAL: tenants without one still connect) and `auth` checks for a
  verified one on `/admin/` routes. With a separate admin listener (`admin_port`), that
  listener requires one in the handshake (CERT_REQUIRED) and the API's asks none.
"""
from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass

from appliance.config import Config
from appliance.daemon.tls import CertificateWatcher, Pair, TlsError, resolve, server_context


@dataclass
class TlsSetup:
    api: ssl.SSLContext | None = None
    admin: ssl.SSLContext | None = None
    watcher: CertificateWatcher | None = None

    @property
    def enabled(self) -> bool:
        return self.api is not None


def tls_setup(cfg: Config, on_change=None) -> TlsSetup:
    """The contexts, loaded now; TlsError (one line) for a bad file, pair or CA.
    `on_change(loaded, error)`: after each reload a change of the files caused."""
    s = cfg.server
    if not s.tls_cert:
        return TlsSetup()
    pair = Pair(resolve(s.tls_cert, "server.tls_cert"), resolve(s.tls_key, "server.tls_key"))
    ca = resolve(cfg.auth.admin_client_ca, "auth.admin_client_ca") \
        if cfg.auth.admin_client_ca else None
    if s.admin_port:
        api = server_context(pair)
        admin = server_context(pair, ca, require_client_cert=True) if ca else server_context(pair)
        contexts = [api, admin]
    else:
        api = admin = server_context(pair, ca)
        contexts = [api]
    return TlsSetup(api, admin, CertificateWatcher(pair, contexts, on_change=on_change))


def is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


__all__ = ["TlsError", "TlsSetup", "is_loopback_host", "tls_setup"]
