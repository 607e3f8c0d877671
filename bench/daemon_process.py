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


def start_daemon(state: Path, args: list[str], timeout: float = 300,
                 root: Path = ROOT, profile: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start `applianced serve` on 127.0.0.1; return (process, base URL) once /ready.
    `root`: the source tree to run (another checkout's, to compare two versions of the
    engine with the same client; `python -m` puts it first on sys.path, and PYTHONPATH
    puts it first for the workers and the daemon's other children too). `profile`: run
    it under `profile_daemon.py`, which profiles between SIGUSR1 and SIGUSR2 into that file."""
    port = free_port()
    run = ([str(ROOT / "bench" / "profile_daemon.py"), str(profile)] if profile else [])
    cmd = [sys.executable, *run, "-m", "appliance", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--state-dir", str(state), *args]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "APPLIANCED_LOG": "WARNING", "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, stdout=open(state / "daemon.log", "wb"), stderr=subprocess.STDOUT,
                            cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    return proc, wait_ready(proc, url, state / "daemon.log", timeout=timeout)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, path: str = "/ready",
               timeout: float = 300, interval: float = 0.2, context=None,
               stop=lambda p: p.kill()) -> str:
    """`url` once `path` answers 200 (a server under benchmark, ours or a peer's); exits
    with its log if the process dies first, and stops it if it never gets there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{Path(proc.args[0]).name} exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + path, timeout=2, context=context) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        time.sleep(interval)
    stop(proc)
    raise SystemExit(f"{url} did not become ready")


def wait_populated(url: str, timeout: float = 300) -> float:
    """Wait until every worker's KV pool is faulted in (`kv_populated` in the status: a
    CPU worker's fills at idle priority after it starts, `cpu_heap.PoolPopulator`), so a
    measurement starts from the steady state, as a server that touches its pool at start
    does; returns the seconds waited. Gives up (and says so) after `timeout`."""
    import json
    t0 = time.monotonic()
    while True:
        with urllib.request.urlopen(f"{url}/admin/v1/status", timeout=10) as r:
            workers = json.loads(r.read())["workers"]
        if all((w.get("kv_populated") or 0.0) >= 1.0 for w in workers):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            print(f"{url}: KV pools still faulting in after {timeout:.0f} s: "
                  + ", ".join(f"{w['worker']} {w.get('kv_populated')}" for w in workers),
                  file=sys.stderr)
            return time.monotonic() - t0
        time.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
