"""What the serving benchmarks share: a real daemon on a free loopback port, and
percentiles. (Imported by the bench scripts, which run with bench/ on sys.path.)"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(state: Path, args: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """Start `applianced serve` on 127.0.0.1; return (process, base URL) once /ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(state), *args]
    proc = subprocess.Popen(cmd, stdout=open(state / "daemon.log", "wb"), stderr=subprocess.STDOUT,
                            cwd=ROOT, env={**os.environ, "APPLIANCED_LOG": "WARNING"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(state / 'daemon.log').read_text()}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("daemon did not become ready")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
