"""The daemon's child processes: spawn, handshake, reap, restart with backoff.

Both kinds of child the daemon keeps running, the workers (`daemon.workers`) and the
accounting process (`daemon.accounting_link`), are this program run again with exec (the
spawn model: no fork of a process that holds threads, CUDA contexts or an event loop),
talking over one end of a socketpair whose other end it gets as `--fd N`. Each says
first whether it could start (its own hello, or a typed failure with one line), and a
child that dies is started again after a delay that doubles up to a cap. What differs
(what the child is told first, what its hello is, what its death fails) stays with the
link that owns it.
"""
from __future__ import annotations

import asyncio
import socket
import sys
from typing import Awaitable, Callable

from appliance.worker import wire

REAP_GRACE_S = 5.0


def program_command() -> list[str]:
    """How to run this program again: a frozen binary is its own interpreter."""
    return [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "appliance"]


async def spawn(command: Callable[[int], list[str]], env: dict | None = None,
                keep_fds: tuple[int, ...] = ()
                ) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader, asyncio.StreamWriter]:
    """Start `command(fd)` with `fd`, one end of a socketpair, passed to it (and
    `keep_fds`, the daemon's, under the same numbers); returns the process and the
    daemon's end as a stream. The child's end is closed here once the child holds it:
    when the child dies the daemon's reader sees the end of the stream."""
    parent, child = socket.socketpair()
    try:
        proc = await asyncio.create_subprocess_exec(
            *command(child.fileno()), pass_fds=(child.fileno(), *keep_fds), env=env,
            stdin=asyncio.subprocess.DEVNULL)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    reader, writer = await asyncio.open_unix_connection(sock=parent)
    return proc, reader, writer


async def first_message(reader: asyncio.StreamReader, timeout: float):
    """The child's first message (its hello or its refusal), or None if it closed the
    stream or did not answer in `timeout` seconds."""
    try:
        return await asyncio.wait_for(wire.recv_async(reader), timeout)
    except asyncio.TimeoutError:
        return None


def exit_text(returncode: int | None) -> str:
    return (f"killed by signal {-returncode}" if returncode is not None and returncode < 0
            else f"exit code {returncode}")


async def reap(proc: asyncio.subprocess.Process | None, grace: float = REAP_GRACE_S) -> str:
    """Wait for a child that is ending (it closed its stream, or was told to stop) and
    say how it ended; after `grace` seconds it is killed."""
    if proc is None:
        return "not started"
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
    return exit_text(proc.returncode)


async def restart(start: Callable[[], Awaitable[None]], *, delay: float, max_delay: float,
                  stopping: Callable[[], bool], failures: tuple[type[BaseException], ...],
                  on_failure: Callable[[BaseException], None],
                  on_attempt: Callable[[], None] = lambda: None) -> bool:
    """Call `start` after `delay` seconds, again after twice that on one of `failures`,
    up to `max_delay` between tries, until it succeeds (True) or `stopping()` (False)."""
    while not stopping():
        await asyncio.sleep(delay)
        if stopping():
            return False
        on_attempt()
        try:
            await start()
            return True
        except failures as exc:
            on_failure(exc)
            delay = min(max_delay, delay * 2)
    return False

