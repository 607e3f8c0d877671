"""The KV handoff as an operator sees it: a real daemon (CPU torch engine, one prefill
and one decode worker, the generated small model) serves greedy completions of three
prompt lengths, and this reads `applianced_kv_transfer_bytes_total{transport="shm"}` and
`applianced_kv_transfer_seconds` from its /metrics after each length: bytes and mean
seconds per request, and the rate. The bytes are exact (the prompt's whole blocks:
64 KiB each for this model); the seconds are the decode worker's copy, on whatever else
the machine runs. bench/bench_kv_transfer.py measures the copy itself, against NIXL.

    .venv/bin/python bench/bench_kv_metrics.py              # ~40 s; -> bench/results/kv_metrics.json
    .venv/bin/python bench/bench_kv_metrics.py --reps 50    # steadier means
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_process import ROOT, start_daemon  # noqa: E402

sys.path.insert(0, str(ROOT))
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from appliance.models.tiny import init_tiny  # noqa: E402


def kv_metrics(url: str) -> tuple[float, float, float]:
    """(bytes, transfers, seconds) over the shm transport so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("applianced_kv_transfer") and s.labels.get("transport") == "shm":
                got[s.name] = s.value
    return (got.get("applianced_kv_transfer_bytes_total", 0.0),
            got.get("applianced_kv_transfer_seconds_count", 0.0),
            got.get("applianced_kv_transfer_seconds_sum", 0.0))


def complete(url: str, model: str, prompt: str) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["usage"]["prompt_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="requests per prompt length")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_metrics.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-kv-metrics-") as tmp:
        tmp = Path(tmp)
        model = init_tiny(tmp / "tiny-llama", seed=0)
        (tmp / "config.toml").write_text("[engine]\nkv_cache_bytes = 67108864\n")
        state = tmp / "state"
        state.mkdir()
        proc, url = start_daemon(state, ["--model", str(model), "--devices", "cpu", "--engine",
                                         "torch", "--config", str(tmp / "config.toml")])
        try:
            with urllib.request.urlopen(url + "/admin/v1/status", timeout=10) as r:
                name = json.loads(r.read())["model"]
            rows = []
            before = kv_metrics(url)
            for words in (8, 64, 200):
                tokens = [complete(url, name, "the quick brown fox " * words)
                          for _ in range(args.reps)]
                after = kv_metrics(url)
                n = after[1] - before[1]
                b, s = (after[0] - before[0]) / n, (after[2] - before[2]) / n
                rows.append({"prompt_tokens": tokens[0], "requests": int(n),
                             "bytes_per_request": b, "mean_seconds": s,
                             "gb_per_s": b / s / 1e9 if s else None})
                print(f"{tokens[0]:>5} prompt tokens: {b / 2**20:7.2f} MiB a request, "
                      f"{s * 1e3:6.2f} ms mean, {b / s / 1e9:5.2f} GB/s ({int(n)} requests)")
                before = after
        finally:
            proc.kill()
            proc.wait()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"transport": "shm", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
