"""The unit tests start nothing: no daemon, no subprocess, no server. This hook fails a
test here that starts a process or binds or connects a network socket (socket pairs,
which the worker-loop and wire tests use, stay allowed), so a test that needs one goes
to tests/integration/ and `make test-unit` stays fast."""
from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

INET = (socket.AF_INET, socket.AF_INET6)
# What libraries run on their own: ctypes.util.find_library asks ldconfig (the CPU heap
# settings look up libc that way). A lookup, not a process a test starts.
LIBRARY_LOOKUPS = (["/sbin/ldconfig", "-p"],)


def _refuse(what: str):
    def refuse(*args, **kwargs):
        pytest.fail(f"a unit test {what}: it belongs in tests/integration/")
    return refuse


def _popen_guard(original):
    def init(self, args, *rest, **kwargs):
        if list(args) not in LIBRARY_LOOKUPS:
            pytest.fail("a unit test starts a subprocess: it belongs in tests/integration/")
        return original(self, args, *rest, **kwargs)
    return init


def _connect_guard(original):
    def connect(self, *args, **kwargs):
        if self.family in INET:
            pytest.fail("a unit test connects over the network: it belongs in tests/integration/")
        return original(self, *args, **kwargs)
    return connect


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # pytest calls this hook for every test of the session once this conftest is loaded:
    # only the tests under this directory are held to it.
    if HERE not in item.path.resolve().parents:
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess.Popen, "__init__", _popen_guard(subprocess.Popen.__init__))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            mp.setattr(os, name, _refuse(f"calls os.{name}"))
    mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starts a process"))
    mp.setattr(socket.socket, "bind", _refuse("binds a socket (a server)"))
    mp.setattr(socket.socket, "connect", _connect_guard(socket.socket.connect))
    mp.setattr(socket.socket, "connect_ex", _connect_guard(socket.socket.connect_ex))
    try:
        yield
    finally:
        mp.undo()
