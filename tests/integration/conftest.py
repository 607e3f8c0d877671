"""Fixtures of the integration tests: real daemons, stopped when the test ends."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from helpers.daemons import Daemon, start_daemon


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[Daemon] = []

    def factory(*args: str, model: Path | None, config: str | None = None,
                env: dict | None = None) -> Daemon:
        d = start_daemon(tmp_path / f"d{len(started)}", model, *args, config=config, env=env)
        started.append(d)
        return d

    yield factory
    for d in started:
        d.stop(signal.SIGKILL)
