"""Where a served CPU layout's time goes, per process: one `bench_vs_vllm.py` cell against
one applianced, with each process's CPU time sampled every 50 ms. Not a test: prints each
process's CPU seconds per request and busy share, how many decode steps shared the
prefill core (`engine.cpu_decode_helper`) and why the others did not, and a timeline
(one line per --bin).

    .venv/bin/python bench/serve_cpu_timeline.py --concurrency 32 --requests 1 \
        --set 'engine.dtype="bfloat16"'

Which worker is which comes from its `--spec` (its "worker" name); other children (the
request preparers, the accounting process) are summed as "other". A line where one worker
is busy and the other at 0% is a core left idle: in disagg with one wave of requests the
prefill and decode workers take turns.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_vllm as vs  # noqa: E402
from daemon_process import ROOT, start_daemon, wait_populated  # noqa: E402


def processes(root_pid: int) -> dict[int, str]:
    import psutil
    names = {root_pid: "daemon"}
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            found = re.search(r'"worker":\s*"(\w+)"', " ".join(child.cmdline()))
        except psutil.Error:
            continue
        names[child.pid] = found.group(1) if found else "other"
    return names


def engine_steps(url: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(worker, phase) -> (steps, busy seconds) from the daemon's /metrics, since its
    start (the cell's warm-up requests included)."""
    from prometheus_client.parser import text_string_to_metric_families
    found: dict[tuple[str, str], list[float]] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            if family.name not in ("applianced_engine_iterations",
                                   "applianced_engine_busy_seconds"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    row = found.setdefault((sample.labels["worker"], sample.labels["phase"]),
                                           [0.0, 0.0])
                    row[family.name.endswith("busy_seconds")] = sample.value
    return {k: (v[0], v[1]) for k, v in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: the 82m preset)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=1, help="requests = concurrency x this")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config key, VALUE a TOML literal (repeatable)")
    ap.add_argument("--bin", type=float, default=1.0, help="timeline resolution, seconds")
    ap.add_argument("--output-tokens", type=int, default=64)
    args = ap.parse_args()
    import psutil
    model = args.model or vs.make_model(Path.home() / ".cache" / "applianced-bench")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    _, _, tables = vs.parse_variant("x:" + ",".join(args.set))
    state = Path(tempfile.mkdtemp(prefix="cpu-timeline-"))
    (state / "config.toml").write_text("".join(
        f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
        for section, keys in tables.items()))
    proc, url = start_daemon(state, ["--model", str(model), "--engine", "torch",
                                     "--config", str(state / "config.toml")], root=ROOT)
    try:
        print(f"KV pools faulted in {wait_populated(url):.1f} s after /ready", file=sys.stderr)
        names = processes(proc.pid)
        samples: list[tuple[float, dict[str, float]]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                row: dict[str, float] = {}
                for pid, name in names.items():
                    try:
                        t = psutil.Process(pid).cpu_times()
                    except psutil.Error:
                        continue
                    row[name] = row.get(name, 0.0) + t.user + t.system
                samples.append((time.perf_counter(), row))
                done.wait(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        cell = asyncio.run(vs.cell(url, model.name, args.concurrency,
                                   args.concurrency * args.requests, 256, args.output_tokens, vocab,
                                   seed=args.concurrency))
        done.set()
        sampler.join()
        with urllib.request.urlopen(f"{url}/admin/v1/status", timeout=10) as r:
            workers = json.loads(r.read())["workers"]
        steps = engine_steps(url)
    finally:
        vs.stop(proc)
    (t0, first), (t1, last) = samples[0], samples[-1]
    wall, requests = t1 - t0, cell["requests"] + 2          # the cell's 2 warm-up requests
    print(f"{cell['req_s']:.2f} req/s, TTFT p50 {cell['ttft_p50_s']:.2f} s, ITL p50 "
          f"{cell['itl_p50_ms']:.1f} ms; {wall:.1f} s sampled, load average "
          f"{psutil.getloadavg()[0]:.1f}")
    print("| process | CPU s | CPU s/request | busy |\n|---|---:|---:|---:|")
    for name in sorted(last):
        used = last[name] - first.get(name, 0.0)
        print(f"| {name} | {used:.2f} | {used / requests:.3f} | {used / wall:.0%} |")
    print("| worker | phase | steps | busy s | ms a step |\n|---|---|---:|---:|---:|")
    for (worker, phase), (n, busy) in sorted(steps.items()):
        print(f"| {worker} | {phase} | {n:.0f} | {busy:.2f} | {1e3 * busy / max(n, 1):.2f} |")
    for w in workers:       # a decode worker that may borrow the prefill core
        if w.get("borrowed_core") is not None:
            n = w["borrowed_core_steps"] + w["borrowed_core_lender_busy_steps"] + \
                w["borrowed_core_taken_steps"]
            print(f"{w['worker']} steps on core {w['borrowed_core']} too: "
                  f"{w['borrowed_core_steps']} of {n}; sat out while a prompt ran there "
                  f"{w['borrowed_core_lender_busy_steps']}, after it held a step up "
                  f"{w['borrowed_core_taken_steps']}; groups and items taken back from it "
                  f"{w.get('borrowed_core_taken_back')}")
        if w.get("lent_core_steps"):    # the prefill worker taking that core back
            print(f"{w['worker']} took its core back for {w['lent_core_steps']} steps; "
                  f"{w['lent_core_waits']} waited for a helper to leave its group "
                  f"({1e3 * w['lent_core_wait_s']:.1f} ms in all), "
                  f"{w['lent_core_gave_up']} gave up waiting")
    step = max(1, round(args.bin / 0.05))
    for i in range(0, len(samples) - step, step):
        (a, ra), (b, rb) = samples[i], samples[i + step]
        print(f"{a - t0:6.1f} s  " + "  ".join(
            f"{n} {(rb[n] - ra.get(n, 0.0)) / (b - a):4.0%}" for n in sorted(rb)))


if __name__ == "__main__":
    main()
