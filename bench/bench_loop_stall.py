"""Does a big request stall the event loop? `/health` latency while ~1 MB bodies arrive
back to back.

    .venv/bin/python bench/bench_loop_stall.py [--seconds 10] [--root OTHER_CHECKOUT]

Starts a real daemon (sim engine, the generated tiny model's tokenizer) twice: with the
context of Llama-3.1-70B (131,072 tokens), where the big bodies pass the cost bound and
are parsed, templated and tokenized in full (the worst case), and with the tiny model's
own context (4,096 tokens), where the cost bound refuses most of them before any
tokenizing. A child process posts the bodies back to back on one connection, cycling
through three kinds (30,000 chat messages; one 1 MB word; 330k CJK characters); this
process probes `GET /health` every 10 ms on its own connection and reports its p50/p99
over the load window, next to an idle baseline. `--root` runs another checkout's daemon
(e.g. the code before this benchmark's fix) for comparison. Writes
bench/results/loop_stall.json.
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import platform
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import daemon_process
from daemon_process import ROOT, pct, start_daemon


def bodies(model: str) -> dict[str, bytes]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i % 1000}"}
            for i in range(30_000)]
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20_000) for i in range(330_000))
    return {
        "30k messages": json.dumps({"model": model, "messages": msgs, "max_tokens": 1}).encode(),
        "1 MB word": json.dumps({"model": model, "prompt": "a" * 1_000_000,
                                 "max_tokens": 1}).encode(),
        "330k CJK chars": json.dumps({"model": model, "prompt": cjk, "max_tokens": 1},
                                     ensure_ascii=False).encode(),
    }


def sender(port: int, model: str, seconds: float, out) -> None:
    """Post the big bodies back to back; report per kind: count, statuses, mean seconds."""
    kinds = bodies(model)
    paths = {"30k messages": "/v1/chat/completions"}
    stats = {k: {"sent": 0, "status": {}, "seconds": 0.0, "answer": ""} for k in kinds}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for kind, body in kinds.items():
            t0 = time.perf_counter()
            conn.request("POST", paths.get(kind, "/v1/completions"), body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = resp.read()
            s = stats[kind]
            s["answer"] = s["answer"] or answer[:160].decode(errors="replace")
            s["sent"] += 1
            s["seconds"] += time.perf_counter() - t0
            s["status"][str(resp.status)] = s["status"].get(str(resp.status), 0) + 1
    out.send(stats)


def probe(port: int, seconds: float, interval: float = 0.01) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        lat.append((time.perf_counter() - t0) * 1000)
        time.sleep(interval)
    return lat


def summary(lat: list[float]) -> dict:
    return {"probes": len(lat), "p50_ms": round(pct(lat, 0.5), 2),
            "p99_ms": round(pct(lat, 0.99), 2), "max_ms": round(max(lat), 2)}


def run(label: str, args: list[str], seconds: float, config: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        cfg = state / "config.toml"
        cfg.write_text("[server]\nmax_body_bytes = 2097152\n" + config)
        proc, url = start_daemon(state, ["--devices", "cpu", "--engine", "sim", "--sim-speed",
                                         "100", "--config", str(cfg), *args])
        port = int(url.rsplit(":", 1)[1])
        with urllib.request.urlopen(url + "/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        try:
            idle = probe(port, 2)
            recv, send = multiprocessing.Pipe(duplex=False)
            child = multiprocessing.Process(target=sender, args=(port, model, seconds, send))
            child.start()
            time.sleep(0.5)             # the first body is on its way
            loaded = probe(port, seconds - 0.5)
            child.join(120)
            stats = recv.recv() if recv.poll(5) else {}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    for s in stats.values():
        s["mean_s"] = round(s.pop("seconds") / max(1, s["sent"]), 3)
    return {"label": label, "idle": summary(idle), "loaded": summary(loaded), "bodies": stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--root", help="run the daemon from this checkout instead")
    a = ap.parse_args()
    if a.root:
        daemon_process.ROOT = Path(a.root).resolve()
    results = [
        run("context 131,072 (llama-3.1-70b-fp8 spec): bodies tokenized in full",
            ["--model-spec", "llama-3.1-70b-fp8"], a.seconds,
            # simulated: a KV pool that holds the whole context (nothing is allocated)
            "[engine]\nkv_cache_bytes = 32000000000\n"),
        run("context 4,096 (tiny model): the cost bound refuses most", [], a.seconds),
    ]
    print(f"daemon from {daemon_process.ROOT}\n")
    print("| context | /health idle p50 / p99 | under load p50 / p99 / max | probes | bodies "
          "(count, status, mean s) |")
    print("|---|---:|---:|---:|---|")
    for r in results:
        b = "; ".join(f"{k}: {v['sent']}, {v['status']}, {v['mean_s']}"
                      for k, v in r["bodies"].items())
        i, l = r["idle"], r["loaded"]
        for k, v in r["bodies"].items():
            print(f"  {k}: {v['answer']}")
        print(f"| {r['label']} | {i['p50_ms']} / {i['p99_ms']} ms | {l['p50_ms']} / "
              f"{l['p99_ms']} / {l['max_ms']} ms | {l['probes']} | {b} |")
    out = ROOT / "bench" / "results" / "loop_stall.json"
    out.write_text(json.dumps({"machine": platform.platform(), "root": str(daemon_process.ROOT),
                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
