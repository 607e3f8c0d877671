"""What TLS costs the daemon: the same sim daemon (step time negligible) with and without
`[server] tls_cert`, driven over keep-alive connections (the steady state: symmetric
crypto only) and with a new connection per request (every request pays a handshake).

    .venv/bin/python bench/bench_tls.py [--seconds 5] [--concurrency 16]

A throw-away CA and server certificate (ECDSA P-256) are made with the `openssl` CLI.
Prints a Markdown table and writes bench/results/tls.json. The load generator shares the
machine's cores with the daemon and its workers, as in bench_serving.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from daemon_process import ROOT, free_port, pct, wait_ready

BODY = json.dumps({"model": "tiny-llama", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "Say something short."}]})


def make_pki(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=bench CA", "-days", "2",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext")


def start(state: Path, tls: Path | None, ctx) -> tuple[subprocess.Popen, str]:
    state.mkdir(parents=True)
    port = free_port()
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(state), "--devices", "cpu", "--engine", "sim",
           "--sim-speed", "1000"]
    if tls is not None:
        (state / "c.toml").write_text(f'[server]\ntls_cert = "{tls / "server.pem"}"\n'
                                      f'tls_key = "{tls / "server.key"}"\n')
        cmd += ["--config", str(state / "c.toml")]
    proc = subprocess.Popen(cmd, stdout=open(state / "daemon.log", "wb"),
                            stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "APPLIANCED_LOG": "WARNING"})
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    return proc, wait_ready(proc, url, state / "daemon.log", context=ctx)


async def level(url: str, ctx, concurrency: int, seconds: float, new_connection: bool) -> dict:
    latencies: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=concurrency, ssl=ctx if ctx else False,
                                force_close=new_connection)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker(stop_at: float) -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=BODY,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                if r.status == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
        await asyncio.gather(*(worker(time.perf_counter() + 1.0) for _ in range(concurrency)))
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(worker(started + seconds) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"req_per_s": len(latencies) / elapsed, "p50_ms": 1000 * pct(latencies, 0.5),
            "p99_ms": 1000 * pct(latencies, 0.99), "errors": errors, "requests": len(latencies)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pki = Path(tmp) / "pki"
        pki.mkdir()
        make_pki(pki)
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        for name, tls in (("plain HTTP", None), ("TLS", pki)):
            proc, url = start(Path(tmp) / name.replace(" ", "-"), tls, ctx if tls else None)
            try:
                for mode, new in (("keep-alive", False), ("new connection each", True)):
                    r = asyncio.run(level(url, ctx if tls else None, args.concurrency,
                                          args.seconds, new))
                    rows.append({"listener": name, "connections": mode, **r})
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    print(f"| listener | connections | req/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['listener']} | {r['connections']} | {r['req_per_s']:.0f} | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} |")
    out = ROOT / "bench" / "results" / "tls.json"
    out.write_text(json.dumps({"concurrency": args.concurrency, "seconds": args.seconds,
                               "cpus": os.cpu_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
