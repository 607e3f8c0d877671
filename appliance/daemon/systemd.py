"""systemd integration without libsystemd: sd_notify, socket activation, the journal.

All three are small documented protocols over Unix sockets, so they are spoken here
directly rather than through a C library the single binary would have to carry:
- sd_notify: datagrams to $NOTIFY_SOCKET (a leading '@' names an abstract socket);
- socket activation: listening sockets inherited as fds 3.. ($LISTEN_FDS, $LISTEN_PID);
- the journal's native protocol: KEY=value datagrams to /run/systemd/journal/socket, so
  a log line keeps its fields (priority, logger, worker ...) instead of being one string.
Outside systemd every call is a no-op and logging goes to stderr as usual.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import sys
import threading
import traceback
from typing import Callable

LISTEN_FDS_START = 3
JOURNAL_SOCKET = "/run/systemd/journal/socket"


def _address(path: str) -> str:
    return "\0" + path[1:] if path.startswith("@") else path


def notify(*lines: str) -> bool:
    """Send sd_notify lines (READY=1, STATUS=..., WATCHDOG=1 ...); False outside systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), _address(path))
        return True
    except OSError:
        return False


def extend_timeout(seconds: float, status: str | None = None) -> bool:
    """Ask for `seconds` more to finish the current phase (start-up, stop): systemd then
    waits past TimeoutStartSec= as long as these keep coming, and no longer."""
    lines = [f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}"]
    if status:
        lines.append(f"STATUS={status}")
    return notify(*lines)


class KeepExtending:
    """While a long phase runs (generating a model, loading weights into workers), send
    EXTEND_TIMEOUT_USEC every `every` seconds, each granting `grant` seconds. A thread,
    not a task: model preparation blocks the event loop. A hung phase stops nothing here;
    its own timeout (workers.start_timeout_s) ends it."""

    def __init__(self, grant: float = 60.0, every: float = 20.0):
        self.grant = grant
        self.every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> KeepExtending:
        if os.environ.get("NOTIFY_SOCKET"):
            extend_timeout(self.grant)
            self._thread = threading.Thread(target=self._run, name="sd-extend", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            extend_timeout(self.grant)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


async def watchdog_loop() -> None:
    """Ping WATCHDOG=1 at half the interval systemd asked for (WatchdogSec=). From the
    event loop on purpose: a loop stuck for WatchdogSec gets the daemon restarted."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit():
        return
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return
    interval = int(usec) / 2e6
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def listen_sockets(unset_environment: bool = True) -> list[socket.socket]:
    """The listening sockets systemd passed (socket activation), as sd_listen_fds does:
    only if $LISTEN_PID is this process. The variables are removed so the workers this
    daemon starts do not think the sockets are theirs."""
    pid, count = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    if unset_environment:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(name, None)
    if not (pid.isdigit() and count.isdigit()) or int(pid) != os.getpid():
        return []
    socks = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks


# ---- the journal -------------------------------------------------------------------

def stderr_is_journal() -> bool:
    """$JOURNAL_STREAM (device:inode) names stderr's stream when systemd connected it to
    the journal; a redirect (`2>file`) changes stderr and this says no."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


# logging level -> syslog priority (journalctl -p)
_PRIORITY = [(logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
             (logging.INFO, 6), (logging.DEBUG, 7)]


def journal_priority(levelno: int) -> int:
    return next((prio for level, prio in _PRIORITY if levelno >= level), 7)


def journal_field(name: str, value) -> bytes:
    """One field of the native protocol: NAME=value, or NAME, a 64-bit little-endian
    length and the raw bytes when the value has a newline."""
    data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
    key = name.encode()
    if b"\n" in data:
        return key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key + b"=" + data + b"\n"


def journal_name(name: str) -> str:
    """Journal field names: upper case letters, digits and '_', not starting with '_'."""
    out = "".join(c if c.isalnum() else "_" for c in name.upper()).lstrip("_")
    return out if out and not out[0].isdigit() else f"F_{out}"


class JournalHandler(logging.Handler):
    """Writes records to the journal with fields: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER,
    LOGGER, CODE_FILE/LINE/FUNC, and every `extra=` key whose name starts with
    `applianced_` (e.g. `log.warning(..., extra={"applianced_worker": "decode0"})` gives
    APPLIANCED_WORKER=decode0, for `journalctl APPLIANCED_WORKER=decode0`). A record too
    big for one datagram, or a journal that is gone, falls back to stderr."""

    def __init__(self, path: str = JOURNAL_SOCKET, identifier: str = "applianced"):
        super().__init__()
        self.path = path
        self.identifier = identifier
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.fallback = logging.StreamHandler(sys.stderr)

    def setFormatter(self, fmt) -> None:  # noqa: N802 - logging's name
        super().setFormatter(fmt)
        self.fallback.setFormatter(fmt)

    def payload(self, record: logging.LogRecord) -> bytes:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        fields = [("MESSAGE", message), ("PRIORITY", journal_priority(record.levelno)),
                  ("SYSLOG_IDENTIFIER", self.identifier), ("LOGGER", record.name),
                  ("CODE_FILE", record.pathname), ("CODE_LINE", record.lineno),
                  ("CODE_FUNC", record.funcName)]
        fields += [(journal_name(k), v) for k, v in vars(record).items()
                   if k.startswith("applianced_") and v is not None]
        return b"".join(journal_field(name, value) for name, value in fields)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sock.sendto(self.payload(record), self.path)
        except OSError:     # EMSGSIZE (memfd passing is not worth it here), journal down
            self.fallback.emit(record)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def log_handler() -> logging.Handler:
    """The journal when stderr goes to it (running under systemd), else stderr."""
    if stderr_is_journal() and os.path.exists(JOURNAL_SOCKET):
        return JournalHandler()
    return logging.StreamHandler(sys.stderr)


def journal_sender(identifier: str) -> Callable[[dict, str], None] | None:
    """A function sending one structured entry to the journal under `identifier` (e.g.
    the audit log's `applianced-audit`: `journalctl -t applianced-audit`), or None when
    the daemon does not run under the journal. Its fields: MESSAGE (the JSON line) and
    AUDIT_<KEY> for each top-level scalar (AUDIT_ACTION=workflow.start ...)."""
    if not (stderr_is_journal() and os.path.exists(JOURNAL_SOCKET)):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def send(entry: dict, line: str) -> None:
        fields = [("MESSAGE", line), ("PRIORITY", 5), ("SYSLOG_IDENTIFIER", identifier)]
        fields += [(f"AUDIT_{journal_name(k)}", v) for k, v in entry.items()
                   if isinstance(v, (str, int, float)) and v is not None]
        try:
            sock.sendto(b"".join(journal_field(n, v) for n, v in fields), JOURNAL_SOCKET)
        except OSError:
            pass            # the file holds the entry; the journal is a copy
    return send
