"""TLS for the listeners: the server certificate, client certificates for the admin API,
and rotation without a restart.

The context comes from `ssl.create_default_context(Purpose.CLIENT_AUTH)` (the ssl
module's secure defaults: no SSLv3/compression, strong ciphers) with TLS 1.2 as the floor.
A live context is never rebuilt: `load_cert_chain` on it changes what the *next*
handshake presents, while established connections keep the session they negotiated, so
rotation drops nothing. A new pair is first loaded into a scratch context; only if that
succeeds (both files readable, PEM, the key matching the certificate) is it loaded into
the live ones, so a bad file on disk leaves the old certificate serving.

Paths may name a systemd credential: `credential:NAME` reads `$CREDENTIALS_DIRECTORY/NAME`
(`LoadCredential=NAME:/etc/applianced/tls/server.key` in the unit: systemd copies the file
into a private, read-only directory only the service can read, so the key need not be
readable by the `applianced` user on disk).
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger("applianced.tls")

CREDENTIAL = "credential:"


class TlsError(ValueError):
    """One line: what is wrong with a certificate, key or CA file."""


def resolve(value: str, what: str) -> Path:
    """A config path, or `credential:NAME` -> $CREDENTIALS_DIRECTORY/NAME."""
    if not value.startswith(CREDENTIAL):
        return Path(value)
    name = value[len(CREDENTIAL):]
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        raise TlsError(f"{what} = {value!r}: no $CREDENTIALS_DIRECTORY (set LoadCredential="
                       f"{name}:/path/to/file in the unit, or give a path)")
    if not name or "/" in name:
        raise TlsError(f"{what} = {value!r}: a credential name has no '/'")
    return Path(directory) / name


def _describe(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError):
        reason = getattr(exc, "reason", None) or str(exc)
        if reason == "KEY_VALUES_MISMATCH":
            return "the private key does not match the certificate"
        return reason.lower().replace("_", " ")
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    def stamp(self) -> tuple:
        """What changes when either file is replaced (mtime, size, inode)."""
        out = []
        for p in (self.cert, self.key):
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)


class _Encrypted(Exception):
    pass


def _no_password():
    """OpenSSL would prompt on the terminal for an encrypted key; a daemon has none."""
    raise _Encrypted()


def _load(ctx: ssl.SSLContext, pair: Pair, cert: Path | None = None,
          key: Path | None = None) -> None:
    """Load `pair` (or the same bytes at `cert`/`key`) into `ctx`; TlsError: one line."""
    try:
        ctx.load_cert_chain(cert or pair.cert, key or pair.key, password=_no_password)
    except _Encrypted:
        raise TlsError(f"TLS key {pair.key}: the private key is encrypted; give it "
                       "unencrypted (mode 0600), or as a systemd credential") from None
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"TLS certificate {pair.cert} / key {pair.key}: {_describe(exc)}") from None


class _Snapshot:
    """The pair's bytes as read once, behind /proc/self/fd paths of memory files: what
    is checked is exactly what the live contexts then load, even if a writer replaces a
    file in between; the key never touches a disk."""

    def __init__(self, pair: Pair):
        self.fds: list[int] = []
        try:
            self.cert = self._memfile(pair.cert)
            self.key = self._memfile(pair.key)
        except OSError as exc:
            self.close()
            raise TlsError(f"TLS certificate {pair.cert} / key {pair.key}: "
                           f"{_describe(exc)}") from None

    def _memfile(self, path: Path) -> Path:
        data = path.read_bytes()
        fd = os.memfd_create("applianced-tls", os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.write(fd, data)
        return Path(f"/proc/self/fd/{fd}")

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class HandshakeLog:
    """One line per failed handshake (plain HTTP on the TLS port, a client that does not
    trust our certificate, a client certificate from another CA), at most one per reason
    every `every` seconds with a count of the ones in between: a scanner cannot flood the
    log. The event loop's SSL transport closes such a connection quietly (it logs only in
    debug mode), so without this an operator would see nothing."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def failed(self, exc: ssl.SSLError) -> None:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        now = time.monotonic()
        if now - self._last.get(reason, -self.every) < self.every:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        quiet = self._quiet.pop(reason, 0)
        more = f" ({quiet} more since the last line)" if quiet else ""
        self._last[reason] = now
        if reason == "HTTP_REQUEST":
            log.warning("refused a plain-HTTP request on the TLS port (clients must use "
                        "https://)%s", more)
        else:
            detail = getattr(exc, "verify_message", None) or reason.lower().replace("_", " ")
            log.warning("TLS handshake failed: %s%s", detail, more)


HANDSHAKES = HandshakeLog()


class _LoggedSSLObject(ssl.SSLObject):
    """The connection's TLS state (what the loop's SSL transport drives): a failed
    handshake is reported to `HANDSHAKES` before the transport closes it."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            HANDSHAKES.failed(exc)
            raise


def server_context(pair: Pair, client_ca: Path | None = None,
                   require_client_cert: bool = False) -> ssl.SSLContext:
    """A listener's context. With `client_ca`, clients may (or, `require_client_cert`, must)
    present a certificate signed by it; one that does not verify fails the handshake."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.sslobject_class = _LoggedSSLObject
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, pair)
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(client_ca))
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(f"auth.admin_client_ca {client_ca}: {_describe(exc)}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


_SHORT = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
          "countryName": "C", "stateOrProvinceName": "ST", "localityName": "L",
          "domainComponent": "DC", "userId": "UID"}


def subject(peercert: dict | None) -> str | None:
    """A verified peer certificate's subject as "CN=alice,O=ops" (the admin's identity)."""
    if not peercert:
        return None
    parts = [f"{_SHORT.get(k, k)}={v}" for rdn in peercert.get("subject", ()) for k, v in rdn]
    return ",".join(parts) or None


class CertificateWatcher:
    """Keeps the listeners' contexts on the files' current pair: polled every `every`
    seconds (mtime/size/inode) and on `reload()` (SIGHUP)."""

    def __init__(self, pair: Pair, contexts: list[ssl.SSLContext], every: float = 1.0,
                 on_change: Callable[[bool, str], None] | None = None):
        self.pair = pair
        self.contexts = contexts
        self.every = every
        self.on_change = on_change      # (loaded, why) after a reload the files caused
        self._stamp = pair.stamp()
        self.reloads = 0
        self.last_error = ""

    def reload(self, why: str = "SIGHUP") -> bool:
        """Load the pair on disk into every live context, if it loads; else keep the old
        one and say why in one line."""
        self.last_error = ""
        self._stamp = self.pair.stamp()
        snap = None
        try:
            snap = _Snapshot(self.pair)
            _load(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), self.pair,
                  snap.cert, snap.key)
            for ctx in self.contexts:
                _load(ctx, self.pair, snap.cert, snap.key)
        except TlsError as exc:
            self.last_error = str(exc)
            log.error("%s; still serving the previous certificate (%s)", exc, why)
            return False
        finally:
            if snap is not None:
                snap.close()
        self.reloads += 1
        log.info("TLS certificate %s reloaded (%s); new connections get it", self.pair.cert, why)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            stamp = self.pair.stamp()
            if stamp != self._stamp:
                # a writer may be half-way (cert replaced, key not yet): one more beat
                await asyncio.sleep(min(self.every, 0.2))
                if self.pair.stamp() == self._stamp:
                    continue            # a SIGHUP reloaded it meanwhile
                loaded = self.reload("the file changed")
                if self.on_change is not None:
                    self.on_change(loaded, self.last_error)
