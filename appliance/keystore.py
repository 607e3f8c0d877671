"""API keys managed without a restart: `keys.json` in the state directory.

`applianced keys add|list|revoke` writes this file directly, on the box, under an
exclusive `flock` on `keys.json.lock`; the daemon re-reads it when its mtime changes
(polled twice a second). Direct, not through an admin endpoint, because: the file's
owner and mode (0600, the daemon's user) are the access control, the same as the state
directory's databases; the first admin key can be made before any exists (no
bootstrap problem) and while the daemon is down; and a key never crosses the network,
not even to the daemon. Only a key's SHA-256 digest is stored; the key is printed once.

The file is replaced atomically (write a temporary, fsync, rename), so the daemon never
reads half of it. Revoked keys stay in the file, marked, so `keys list` can show them
and a name is never reused by accident. The daemon writes when each key was last used
to `keys.used.json` (at most every few seconds), never to `keys.json`.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

KEYS_FILE = "keys.json"
USED_FILE = "keys.used.json"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
TAG_KEYS = ("team", "project", "cost_center")


@dataclass
class KeyRecord:
    """One key of the keys file (its digest, never the key)."""

    name: str
    digest: str
    tenant: str | None = None       # None: an admin key
    admin: bool = False
    created: float = 0.0
    expires: float | None = None    # unix seconds; None: never
    revoked: float | None = None    # unix seconds it was revoked; None: live
    tags: dict = field(default_factory=dict)

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and (now or time.time()) >= self.expires


class KeyFileError(ValueError):
    """One line: the keys file is unreadable or malformed, or a command was refused."""


def keys_path(state_dir: Path) -> Path:
    return Path(state_dir) / KEYS_FILE


def read(path: Path) -> list[KeyRecord]:
    """Every record of the file ([] when it does not exist); KeyFileError when broken."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(raw)
        records = [KeyRecord(**r) for r in data["keys"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"{path}: malformed keys file ({exc})") from None
    seen: set[str] = set()
    for r in records:
        if not re.fullmatch(r"[0-9a-f]{64}", r.digest):
            raise KeyFileError(f"{path}: key {r.name!r} has no valid SHA-256 digest")
        if r.name in seen:
            raise KeyFileError(f"{path}: the name {r.name!r} is defined twice")
        seen.add(r.name)
    return records


def own_like_directory(fd: int, directory: Path) -> None:
    """Run as root on a state directory another user owns (the daemon's `applianced`),
    give the new file to that user: a root-owned 0600 file would lock the daemon out."""
    if os.geteuid() != 0:
        return
    st = os.stat(directory)
    if st.st_uid != 0:
        os.fchown(fd, st.st_uid, st.st_gid)


def _write(path: Path, records: list[KeyRecord]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    body = json.dumps({"version": 1, "keys": [asdict(r) for r in records]}, indent=1)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        own_like_directory(fd, path.parent)
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):     # the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def locked(path: Path):
    """Exclusive lock for a read-modify-write of the keys file (one `keys` command at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        own_like_directory(fd, path.parent)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add(path: Path, name: str, *, tenant: str | None, admin: bool, expires_s: float | None,
        tags: dict[str, str], taken: set[str] = frozenset()) -> tuple[str, KeyRecord]:
    """A new key: (the key, shown once; its record, stored). `taken`: names the config
    file already uses."""
    if not NAME.match(name):
        raise KeyFileError(f"key name {name!r}: use letters, digits and . _ @ - (at most 64)")
    if admin == bool(tenant):
        raise KeyFileError("a key is either a tenant's (--tenant T) or an admin key (--admin)")
    unknown = sorted(set(tags) - set(TAG_KEYS))
    if unknown:
        raise KeyFileError(f"unknown tag {unknown[0]!r} (known: {', '.join(TAG_KEYS)})")
    if name in taken:
        raise KeyFileError(f"the name {name!r} is already a key in the config file")
    prefix = "adm-" if admin else "sk-"
    key = prefix + secrets.token_urlsafe(32)
    now = time.time()
    record = KeyRecord(name=name, digest=digest(key), tenant=tenant, admin=admin,
                       created=round(now, 3),
                       expires=round(now + expires_s, 3) if expires_s else None, tags=dict(tags))
    with locked(path):
        records = read(path)
        if any(r.name == name for r in records):
            raise KeyFileError(f"a key named {name!r} exists already (revoked names are "
                               "not reused)")
        _write(path, records + [record])
    return key, record


def revoke(path: Path, name: str) -> KeyRecord:
    with locked(path):
        records = read(path)
        found = next((r for r in records if r.name == name), None)
        if found is None:
            raise KeyFileError(f"no key named {name!r} in {path}")
        if found.revoked is not None:
            raise KeyFileError(f"the key {name!r} was revoked already")
        found.revoked = round(time.time(), 3)
        _write(path, records)
    return found


def read_used(state_dir: Path) -> dict[str, float]:
    try:
        data = json.loads((Path(state_dir) / USED_FILE).read_bytes())
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def write_used(state_dir: Path, used: dict[str, float]) -> None:
    path = Path(state_dir) / USED_FILE
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        own_like_directory(fd, path.parent)
        os.write(fd, json.dumps(used).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
