"""One request's latency through two boxes (a prefill front and a decode box joined by
NIXL, docs/operations/cluster.md) against one box (prefill and decode workers side by
side, the KV handed over /dev/shm), both real daemons on this host's loopback with the
torch engine on the generated tiny model.

Sequential streaming requests (one at a time: the path's own cost, not throughput), each
prompt `--tokens` long (distinct prompts: no prefix-cache hits), `--max-tokens` greedy
output tokens. Per setup: the median time to the first token (the front's prefill, the
same on both) and to the last, and the median time per output token after the first
(where the decode box's pull and the extra HTTP hop show). Loopback, one host: no
network is measured. ~2 min on this 2-core machine with the defaults:

    .venv/bin/python bench/bench_cluster_serving.py          # -> bench/results/cluster_serving.json
    .venv/bin/python bench/bench_cluster_serving.py --tokens 256 2048 --reps 20
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from daemon_process import ROOT, free_port, wait_ready  # noqa: E402

KEY = "bench-cluster-key-0123456789"
MODEL = "tiny-llama"
ENGINE = ["--devices", "cpu", "--engine", "torch", "--mode", "disagg"]
POOL = "[engine]\nkv_cache_bytes = 67108864\n"


def serve(state: Path, port: int, config: str, model: Path):
    import os
    import subprocess
    state.mkdir(parents=True)
    (state / "c.toml").write_text(config)
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--state-dir", str(state / "s"), "--config", str(state / "c.toml"),
           "--model", str(model), *ENGINE]
    proc = subprocess.Popen(cmd, stdout=open(state / "daemon.log", "wb"),
                            stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "APPLIANCED_LOG": "WARNING"})
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, state / "daemon.log")
    return proc, url


def cluster(role: str, peer: int) -> str:
    return (POOL + f'[cluster]\nrole = "{role}"\npeers = ["http://127.0.0.1:{peer}"]\n'
            f'key = "{KEY}"\n')


def one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, to the last, tokens) of one streaming request."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    n = 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                n += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, n


def measure(url: str, tokens: int, max_tokens: int, reps: int, seed: int) -> dict:
    one(url, [7] * 16, 4)       # warm-up (and the first NIXL connection)
    ttft, total, per = [], [], []
    for r in range(reps):
        prompt = [(seed * 7919 + r * 131 + i * 17) % 2000 + 10 for i in range(tokens)]
        f, t, n = one(url, prompt, max_tokens)
        ttft.append(f)
        total.append(t)
        per.append((t - f) / max(1, max_tokens - 1))
    med = statistics.median
    return {"ttft_ms": round(med(ttft) * 1e3, 2), "total_ms": round(med(total) * 1e3, 2),
            "per_output_token_ms": round(med(per) * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster_serving.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    procs = []
    try:
        from appliance.models.tiny import init_tiny
        model = init_tiny(tmp / MODEL, seed=0)
        fp, dp, sp = free_port(), free_port(), free_port()
        p, single = serve(tmp / "single", sp, POOL, model)
        procs.append(p)
        p, _ = serve(tmp / "decode", dp, cluster("decode", fp), model)
        procs.append(p)
        p, front = serve(tmp / "front", fp, cluster("prefill", dp), model)
        procs.append(p)
        rows = []
        for n in args.tokens:
            for name, url in (("one box (/dev/shm)", single), ("two boxes (NIXL)", front)):
                row = {"setup": name, "prompt_tokens": n, "max_tokens": args.max_tokens,
                       **measure(url, n, args.max_tokens, args.reps, n)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "reps": args.reps,
                                              "note": "loopback, one host; sequential "
                                                      "requests; medians"}, indent=1) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except Exception:  # noqa: BLE001
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
