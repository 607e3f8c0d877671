"""Start-up time of the daemon: exec to /ready 200, for the single binary and for the
source tree (`python -m appliance`), on the CPU default (torch engine, 2 workers) with
the default model already generated, and for `applianced version` (process start only).

    .venv/bin/python bench/bench_startup.py [--runs 3]     # needs `make binary` first
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINARY = ROOT / "dist" / "applianced" / "applianced"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(cmd: list[str], env: dict) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd + ["--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"exited with {proc.returncode}: {cmd}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def time_run(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not BINARY.exists():
        raise SystemExit("no dist/applianced/applianced: run make binary")
    state = Path(tempfile.mkdtemp(prefix="startup-"))
    src_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bin_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(BINARY), "model", "ensure-default", str(state)], check=True, env=bin_env)
    serve = ["serve", "--state-dir", str(state)]
    results = {"binary_serve_s": [], "source_serve_s": [], "binary_version_s": [],
               "source_version_s": []}
    for _ in range(args.runs):   # interleaved, so drift on shared cores hits both
        results["binary_serve_s"].append(time_to_ready([str(BINARY), *serve], bin_env))
        results["source_serve_s"].append(time_to_ready([sys.executable, "-m", "appliance", *serve], src_env))
        results["binary_version_s"].append(time_run([str(BINARY), "version"], bin_env))
        results["source_version_s"].append(time_run([sys.executable, "-m", "appliance", "version"], src_env))
    size = sum(p.stat().st_size for p in BINARY.parent.rglob("*") if p.is_file())
    out = {k: {"median": round(statistics.median(v), 3), "runs": [round(x, 3) for x in v]}
           for k, v in results.items()}
    out["binary_tree_bytes"] = size
    print(json.dumps(out, indent=2))
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "startup.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
