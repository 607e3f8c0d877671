"""Keeps `Auth` on the keys file (`appliance.keystore`) while the daemon runs.

Polls the file's mtime/size/inode twice a second (no inotify dependency; a stat is a few
microseconds), re-reads it when they change, and swaps the file keys into `Auth` whole:
the next request sees the new set, a request already admitted is not touched. A broken
file, or one that redefines a config key's name, is refused in one log line and the
previous keys stay. When each key was last used goes to `keys.used.json` every few
seconds, for `applianced keys list`.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from appliance import keystore
from appliance.daemon.auth import Auth

log = logging.getLogger("applianced.keys")


class KeyWatcher:
    def __init__(self, auth: Auth, state_dir: Path, every: float = 0.5,
                 used_every: float = 5.0):
        self.auth = auth
        self.state_dir = Path(state_dir)
        self.path = keystore.keys_path(state_dir)
        self.every = every
        self.used_every = used_every
        self._stamp: tuple | None = None
        self._used_written: dict[str, float] = {}
        self._used_error = ""

    def _current_stamp(self) -> tuple | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def load(self) -> int:
        """Read the file into Auth now; ValueError (one line) when it cannot be used.
        Returns how many live keys it holds."""
        self._stamp = self._current_stamp()
        records = keystore.read(self.path)
        self.auth.set_file_keys(records)
        return sum(r.revoked is None for r in records)

    def poll(self, force: bool = False) -> bool:
        """Reload if the file changed (or `force`); True when it did and loaded."""
        if not force and self._current_stamp() == self._stamp:
            return False
        try:
            live = self.load()
        except ValueError as exc:
            log.error("keys file not loaded, the previous keys stay: %s", exc)
            return False
        log.info("keys file reloaded: %d live key(s)", live)
        return True

    def flush_used(self) -> None:
        used = dict(self.auth.last_used)
        if used == self._used_written:
            return
        try:
            keystore.write_used(self.state_dir, {**keystore.read_used(self.state_dir), **used})
            self._used_written = used
        except OSError as exc:
            if exc.strerror != self._used_error:       # once, not every few seconds
                log.warning("cannot write %s: %s", keystore.USED_FILE, exc.strerror)
            self._used_error = exc.strerror or ""

    async def run(self) -> None:
        since_used = 0.0
        try:
            while True:
                await asyncio.sleep(self.every)
                self.poll()
                since_used += self.every
                if since_used >= self.used_every:
                    since_used = 0.0
                    self.flush_used()
        finally:
            self.flush_used()
