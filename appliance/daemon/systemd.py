"""sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET (Type=notify units).

A leading '@' names an abstract socket. Outside systemd every call is a no-op."""
from __future__ import annotations

import asyncio
import os
import socket


def notify(*lines: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), address)
        return True
    except OSError:
        return False


async def watchdog_loop() -> None:
    """Ping WATCHDOG=1 at half the interval systemd asked for (WatchdogSec=)."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit():
        return
    interval = int(usec) / 2e6
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
