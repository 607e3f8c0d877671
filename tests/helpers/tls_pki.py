"""A throw-away PKI for the TLS tests, made with the `openssl` CLI: a CA, a server
certificate for 127.0.0.1/localhost, and client certificates (the `cryptography`
package is not a dependency of the appliance; the CLI is on every box that has TLS)."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI")


def _run(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@dataclass
class Pki:
    dir: Path
    ca: Path

    def issue(self, name: str, cn: str, usage: str = "serverAuth",
              san: str = "IP:127.0.0.1,DNS:localhost", ca: str = "ca") -> tuple[Path, Path]:
        """(certificate, key) signed by the CA `ca` (its files ca.pem / ca.key)."""
        ext = self.dir / f"{name}.ext"
        ext.write_text(f"extendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else "")
                       + "basicConstraints=CA:FALSE\n")
        _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=self.dir)
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name,
             cwd=self.dir)
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"

    def new_ca(self, name: str, cn: str) -> Path:
        _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={cn}", "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=self.dir)
        return self.dir / f"{name}.pem"


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory, directory / "ca.pem")
    pki.new_ca("ca", "applianced test CA")
    return pki


def client_context(ca: Path | None, cert: Path | None = None,
                   key: Path | None = None):
    import ssl
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def https(method: str, url: str, ctx, body: bytes | None = None, headers: dict | None = None,
          timeout: float = 30):
    """helpers.daemons.http over TLS: (status, headers, JSON or raw)."""
    import json
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, raw = exc.code, dict(exc.headers), exc.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw


def start_tls_daemon(tmp_path: Path, model: Path, ctx, *args: str, config: str,
                     env: dict | None = None, timeout: float = 120):
    """A daemon whose config turns TLS on; ready when /ready answers over https with `ctx`."""
    import os
    import signal
    import sys
    import time

    from helpers.daemons import ROOT, Daemon, free_port
    port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.toml").write_text(config)
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(tmp_path / "state"), "--model", str(model),
           "--config", str(tmp_path / "config.toml"), "--devices", "cpu", "--engine", "sim",
           "--sim-speed", "50", *args]
    log = tmp_path / f"daemon-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    daemon = Daemon(proc, port, log)
    daemon.url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}:\n{daemon.log_text()}")
        try:
            if https("GET", daemon.url + "/ready", ctx, timeout=2)[0] == 200:
                return daemon
        except OSError:
            pass
        time.sleep(0.1)
    daemon.stop(signal.SIGKILL)
    raise AssertionError(f"daemon not ready after {timeout}s:\n{daemon.log_text()}")
