"""Real daemons on loopback ports for the integration tests: start one, talk to it over
HTTP, stop it (the `daemon_factory` fixture in tests/integration/conftest.py stops what it
started)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 30):
    """(status, headers, parsed JSON or raw bytes) without raising on 4xx/5xx."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, raw = exc.code, dict(exc.headers), exc.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw


class Daemon:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc = proc
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    def client(self, api_key: str = "unused", **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)

    def status(self) -> dict:
        code, _, body = http("GET", self.url + "/admin/v1/status")
        assert code == 200, body
        return body

    def worker(self, name: str) -> dict:
        return next(w for w in self.status()["workers"] if w["worker"] == name)

    def wait_for(self, predicate, timeout: float = 20, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.status()
            if predicate(last):
                return last
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last status: {last}")

    def post(self, path: str, obj=None, raw: bytes | None = None, headers: dict | None = None):
        body = raw if raw is not None else json.dumps(obj).encode()
        return http("POST", self.url + path, body,
                    {"Content-Type": "application/json", **(headers or {})})

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_daemon(tmp_path: Path, model: Path | None, *args: str, config: str | None = None,
                 timeout: float = 120, env: dict | None = None, port: int | None = None) -> Daemon:
    """`port`: a given one (a daemon restarted where its peers expect it); else a free one."""
    port = port or free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(tmp_path / "state")]
    if model is not None:
        cmd += ["--model", str(model)]
    if config is not None:
        cfg = tmp_path / "config.toml"
        cfg.write_text(config)
        cmd += ["--config", str(cfg)]
    cmd += list(args)
    log = tmp_path / f"daemon-{port}.log"
    n = 1
    while log.exists():     # a restart on the same port: the last run's log (and what its
        n += 1              # accounting process wrote after it died) is kept
        log = tmp_path / f"daemon-{port}-{n}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    daemon = Daemon(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}:\n{daemon.log_text()}")
        try:
            code, _, _ = http("GET", daemon.url + "/ready", timeout=2)
            if code == 200:
                return daemon
        except OSError:
            pass
        time.sleep(0.1)
    daemon.stop(signal.SIGKILL)
    raise AssertionError(f"daemon not ready after {timeout}s:\n{daemon.log_text()}")


def engine_daemon(engine: str, model: Path, tmp_path_factory, prefix: str,
                  config: str | None = None) -> Daemon:
    """A CPU daemon on the simulator (fast: --sim-speed 50) or the real torch engine, for the
    tests that run the same requests through both."""
    args = ["--devices", "cpu", "--engine", engine]
    if engine == "sim":
        args += ["--sim-speed", "50"]
    return start_daemon(tmp_path_factory.mktemp(f"{prefix}-{engine}"), model, *args, config=config)



def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
