"""The audit log: who did what to the appliance, one JSON line per action.

Every admin action (workflow start and cancel, key add and revoke, TLS reload) and every
refused authentication on `/admin/` appends a line to `audit.jsonl` in the state
directory: `time` (unix seconds), `identity` (a key's name and/or a client certificate's
subject, or the local user for a CLI command; never a key), `remote`, `action`, `params`,
`result`. Both the daemon and the `applianced keys` command append, each under an
exclusive `flock` on the file, so lines never interleave and rotation (by size: the file
becomes `audit.jsonl.1`, that `.2`, … up to `backups`) happens once. Under systemd the
daemon also sends each line to the journal as `SYSLOG_IDENTIFIER=applianced-audit`.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from appliance.keystore import own_like_directory

log = logging.getLogger("applianced.audit")

AUDIT_FILE = "audit.jsonl"
MAX_BYTES = 10 << 20
BACKUPS = 5


class AuditLog:
    def __init__(self, path: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS,
                 journal: Callable[[dict, str], None] | None = None):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.journal = journal

    @classmethod
    def in_state_dir(cls, state_dir: Path, **kw) -> "AuditLog":
        return cls(Path(state_dir) / AUDIT_FILE, **kw)

    def record(self, action: str, identity: str, result: str, *, remote: str | None = None,
               params: dict | None = None) -> dict:
        entry = {"time": round(time.time(), 3), "identity": identity, "remote": remote,
                 "action": action, "params": params or {}, "result": result}
        line = json.dumps(entry, separators=(",", ":"), default=str) + "\n"
        try:
            self._append(line)
        except OSError as exc:
            # the action itself is not undone for it: say so, with the entry, in the log
            log.error("audit log %s not written (%s): %s", self.path, exc.strerror, line.strip())
        if self.journal is not None:
            self.journal(entry, line.rstrip("\n"))
        return entry

    def _append(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open_locked()
        try:
            if os.fstat(fd).st_size + len(line) > self.max_bytes:
                fd = self._rotate(fd)
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _open_locked(self) -> int:
        """The current file, locked; reopened if another writer rotated it meanwhile."""
        while True:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            own_like_directory(fd, self.path.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _rotate(self, fd: int) -> int:
        """Shift the files under the lock held on `fd`, then open (and lock) a new one.
        A writer blocked on the old file's lock sees it renamed and reopens
        (`_open_locked` checks the inode)."""
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        new = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        own_like_directory(new, self.path.parent)
        fcntl.flock(new, fcntl.LOCK_EX)
        os.close(fd)
        return new

    def read(self, since: float = 0.0, limit: int = 1000) -> list[dict]:
        """Entries at or after `since`, oldest first, the newest `limit` of them."""
        files = [self.path.with_name(f"{self.path.name}.{i}")
                 for i in range(self.backups, 0, -1)] + [self.path]
        out: list[dict] = []
        for path in files:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue            # a torn last line after a crash
                if isinstance(entry, dict) and entry.get("time", 0) >= since:
                    out.append(entry)
        return out[-limit:]
