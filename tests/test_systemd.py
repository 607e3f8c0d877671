"""systemd integration: the unit file verifies, and the daemon speaks sd_notify."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess

import pytest

from conftest import ROOT


def test_daemon_notifies_ready_status_and_stopping(daemon_factory, tiny_model, tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(10)
    d = daemon_factory("--devices", "cpu", "--engine", "sim", model=tiny_model,
                       env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "2000000"})
    messages = []
    while not any("READY=1" in m for m in messages):
        messages.append(sock.recv(4096).decode())
    assert any(m.startswith("STATUS=") for m in messages)
    assert any("STATUS=serving tiny-llama" in m for m in messages)
    while not any("WATCHDOG=1" in m for m in messages):
        messages.append(sock.recv(4096).decode())
    d.proc.send_signal(signal.SIGTERM)
    while not any("STOPPING=1" in m for m in messages):
        messages.append(sock.recv(4096).decode())
    assert d.proc.wait(30) == 0
    sock.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_unit_file_verifies(tmp_path):
    unit = (ROOT / "systemd" / "applianced.service").read_text()
    # Point ExecStart at a binary that exists here; everything else is checked as shipped.
    fake = tmp_path / "applianced"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    unit = unit.replace("/opt/applianced/bin/applianced", str(fake))
    target = tmp_path / "applianced.service"
    target.write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", str(target)], capture_output=True,
                         text=True, timeout=60)
    problems = [line for line in out.stderr.splitlines()
                if "applianced.service" in line and "Failed to" not in line
                or "Unknown" in line or "Invalid" in line]
    assert out.returncode == 0 and not problems, out.stderr
    settings = [line.strip() for line in unit.splitlines() if not line.startswith("#")]
    assert "PrivateDevices=yes" not in settings and "KillMode=mixed" in settings
    assert "Type=notify" in settings
