"""The unit tests' guard (tests/unit/conftest.py) does refuse what a unit test must not do,
and lets through what it may."""
from __future__ import annotations

import asyncio
import multiprocessing
import socket
import subprocess

import pytest

REFUSED = pytest.fail.Exception


def test_a_subprocess_a_process_and_a_server_are_refused():
    with pytest.raises(REFUSED, match="tests/integration"):
        subprocess.run(["true"])
    with pytest.raises(REFUSED, match="tests/integration"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with socket.socket() as s, pytest.raises(REFUSED, match="binds a socket"):
        s.bind(("127.0.0.1", 0))
    with socket.socket() as s, pytest.raises(REFUSED, match="network"):
        s.connect(("127.0.0.1", 9))


def test_socket_pairs_and_event_loops_are_allowed():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    assert asyncio.run(asyncio.sleep(0, result=7)) == 7
