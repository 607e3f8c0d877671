"""How fast is the daemon itself? The sim engine at a speed where its step time is
negligible, so what is measured is HTTP + tokenization + routing + IPC + SSE.

    .venv/bin/python bench/bench_serving.py [--seconds 5] [--devices cpu] [--mode disagg]
    .venv/bin/python bench/bench_serving.py --accounting compare [--repeats 3]
    .venv/bin/python bench/bench_serving.py --fair-queuing off     # arrival order throughout

`--accounting compare` measures what chargeback costs: daemons with `[accounting]
enabled = false` and `true` take turns at concurrency 64 and with 32 streams, in pairs
ordered off/on, on/off, off/on, ... (so a drift of the machine's speed during the run
falls on both sides alike), and each pair's loss is kept: the summary gives the medians
of each side and the pairs' mean loss with its standard error
(bench/results/accounting_overhead.json).

Starts a real daemon on a loopback port, drives it with an aiohttp client in this
process (the load generator shares the machine's cores with the daemon and its
workers: on a 2-core box that is part of what is measured), prints a Markdown table
and writes bench/results/serving.json. Bounded: each level runs for --seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from daemon_process import ROOT, pct, start_daemon
MODEL = "tiny-llama"


async def chat_level(url: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Say something short."}]})
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one() -> bool:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                data = await r.read()
            if r.status != 200:
                return False
            assert json.loads(data)["usage"]["completion_tokens"] == max_tokens
            latencies.append(time.perf_counter() - t0)
            return True

        async def worker(stop_at: float) -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                if not await one():
                    errors += 1

        warm = time.perf_counter() + min(1.0, seconds / 4)
        await asyncio.gather(*(worker(warm) for _ in range(concurrency)))
        latencies.clear()
        errors = 0
        start = time.perf_counter()
        await asyncio.gather(*(worker(start + seconds) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(latencies), "errors": errors,
            "req_per_s": len(latencies) / elapsed, "p50_ms": 1000 * pct(latencies, 0.50),
            "p99_ms": 1000 * pct(latencies, 0.99)}


async def paced_level(url: str, rate: float, seconds: float, max_tokens: int,
                      limit: int = 64) -> dict:
    """Open loop: a request every 1/`rate` s (at most `limit` in flight), so that the
    daemon does the same work per second whatever it costs: its CPU per request is then
    its own cost, not how much batching a closed loop's backlog happened to give it
    (a closed loop's CPU per request falls as throughput rises: more requests share
    each event-loop turn, each socket write to a worker, each worker frame)."""
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Say something short."}]})
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    slots = asyncio.Semaphore(limit)
    conn = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one() -> None:
            nonlocal errors
            async with slots:
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers=headers) as r:
                    await r.read()
                if r.status != 200:
                    errors += 1
                    return
                latencies.append(time.perf_counter() - t0)

        tasks = []
        start = time.perf_counter()
        i = 0
        while (due := start + i / rate) < start + seconds:
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one()))
            i += 1
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"rate": rate, "requests": len(latencies), "errors": errors,
            "req_per_s": len(latencies) / elapsed, "p50_ms": 1000 * pct(latencies, 0.50),
            "p99_ms": 1000 * pct(latencies, 0.99)}


async def stream_level(url: str, streams: int, tokens: int, rounds: int) -> dict:
    body = json.dumps({"model": MODEL, "max_tokens": tokens, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": "Write a long answer."}]})
    headers = {"Content-Type": "application/json"}
    total = 0
    events = 0
    conn = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one() -> None:
            nonlocal total, events
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        events += 1
                        if b'"choices":[]' in line:
                            total += json.loads(line[6:])["usage"]["completion_tokens"]

        await asyncio.gather(*(one() for _ in range(streams)))   # warm-up round
        total = events = 0
        start = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(streams)))
        elapsed = time.perf_counter() - start
    return {"streams": streams, "tokens_each": tokens, "rounds": rounds, "tokens": total,
            "sse_events": events, "tokens_per_s": total / elapsed, "seconds": elapsed}


def _accounting_cpu(daemon: psutil.Process) -> float:
    """CPU seconds of the accounting process (the daemon's `applianced accountant` child:
    the window arithmetic, the rows, the ledger's writer, unpickling what it is sent)."""
    for child in daemon.children():
        if "accountant" in child.cmdline():
            return sum(child.cpu_times()[:2])
    raise SystemExit("the daemon has no accounting process")


def _daemon(tmp: Path, args, accounting: bool, fair: bool | None = None,
            root: Path = ROOT, profile: Path | None = None):
    """A daemon of `root`'s tree. `fair` None: the config leaves `[engine] fair_queuing`
    out (a tree from before fair queuing refuses the key); else as given."""
    if fair is None and root == ROOT:
        fair = args.fair_queuing == "on"
    cfg = tmp / f"accounting-{accounting}.toml"
    # 1 s windows so the measured level's windows close within it
    cfg.write_text(f"[accounting]\nenabled = {'true' if accounting else 'false'}\nwindow_s = 1.0\n"
                   + (f"[engine]\nfair_queuing = {'true' if fair else 'false'}\n"
                      if fair is not None else ""))
    global MODEL
    spec = ["--model-spec", args.model_spec] if args.model_spec else []
    proc, url = start_daemon(tmp, ["--engine", "sim", "--sim-speed", str(args.sim_speed),
                                   "--devices", args.devices, "--mode", args.mode,
                                   "--config", str(cfg), *spec], root=root, profile=profile)
    import urllib.request
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        MODEL = json.loads(r.read())["data"][0]["id"]       # --model-spec renames it
    return proc, url


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _workers(daemon: psutil.Process) -> list[psutil.Process]:
    """The daemon's engine workers (not its prepare pool or accounting process)."""
    return [c for c in daemon.children(recursive=True) if " worker" in " ".join(c.cmdline())]


def measured_level(url: str, proc, concurrency: int, seconds: float,
                   profile: Path | None = None, rate: float = 0.0) -> dict:
    """One chat level after a warm-up, with the daemon's own CPU per request (all its
    threads; the workers, accounting and prepare processes are others) and its workers':
    CPU per request is steadier than req/s on a shared machine, which gives the daemon
    fewer cycles when others run, but not more work per request."""
    daemon = psutil.Process(proc.pid)
    level = ((lambda secs: paced_level(url, rate, secs, 16)) if rate > 0 else
             (lambda secs: chat_level(url, concurrency, secs, 16)))
    asyncio.run(level(1.0))         # warm the daemon up
    workers = _workers(daemon)
    if profile is not None:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
    cpu0, w0 = _cpu(daemon), sum(_cpu(w) for w in workers)
    chat = asyncio.run(level(seconds))
    cpu1, w1 = _cpu(daemon), sum(_cpu(w) for w in workers)
    if profile is not None:
        proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not profile.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)     # (the file is written in one go; let it finish)
    n = max(chat["requests"], 1)
    return {**chat, "daemon_cpu_us_per_request": 1e6 * (cpu1 - cpu0) / n,
            "workers_cpu_us_per_request": 1e6 * (w1 - w0) / n,
            "load_average": os.getloadavg()[0]}


def _together(args, variants, concurrency: int, order=(0, 1)) -> dict[int, dict]:
    """Both daemons at once, each driven at `concurrency` by this process over the same
    seconds: whatever else the machine runs then weighs on both alike (alternating runs
    see the machine's load change between them: on a busy box the pairs scatter by
    tens of percent). Each daemon's CPU per request counts its own work only. `order`:
    which starts (and is driven) first; alternated per pair, so that neither side
    always has the first place."""
    with tempfile.TemporaryDirectory() as tmp_a, tempfile.TemporaryDirectory() as tmp_b:
        daemons = []
        try:
            for v, tmp in zip(order, (tmp_a, tmp_b)):
                _label, root, fair = variants[v]
                daemons.append(_daemon(Path(tmp), args, args.accounting != "off", fair, root))
            procs = [psutil.Process(p.pid) for p, _ in daemons]

            async def both(seconds: float) -> list[dict]:
                return await asyncio.gather(*(
                    paced_level(url, args.rate, seconds, 16) if args.rate > 0 else
                    chat_level(url, concurrency, seconds, 16) for _, url in daemons))

            asyncio.run(both(1.0))          # warm both up
            workers = [_workers(p) for p in procs]
            cpu0 = [_cpu(p) for p in procs]
            w0 = [sum(_cpu(w) for w in ws) for ws in workers]
            chats = asyncio.run(both(args.seconds))
            cpu1 = [_cpu(p) for p in procs]
            w1 = [sum(_cpu(w) for w in ws) for ws in workers]
        finally:
            for proc, _ in daemons:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in daemons:
                proc.wait(60)
    out = {}
    for i, v in enumerate(order):
        n = max(chats[i]["requests"], 1)
        out[v] = {**chats[i], "daemon_cpu_us_per_request": 1e6 * (cpu1[i] - cpu0[i]) / n,
                  "workers_cpu_us_per_request": 1e6 * (w1[i] - w0[i]) / n,
                  "load_average": os.getloadavg()[0], "first": i == 0}
    return out


def compare_pairs(args) -> int:
    """Two daemons taking turns, A/B then B/A and so on, each measured at one chat level
    (--levels' first): `--compare-root DIR` (DIR's tree, e.g. a `git archive` of an older
    commit, against this one) or `--fair-queuing compare` (off against on, this tree).
    Each pair's change (B/A - 1) is kept; the summary is the pairs' mean ± standard error
    for the daemon's CPU per request (the measure to trust on a shared machine) and req/s.
    With `--profile DIR` each daemon's measured level is profiled instead (cProfile, one
    pair: the counts, not the times, are the point): `bench/profile_diff.py` reads them."""
    if args.compare_root:
        other = Path(args.compare_root).resolve()
        variants = [(f"{other.name}", other, None), ("this tree", ROOT, None)]
    else:
        variants = [("fair off", ROOT, False), ("fair on", ROOT, True)]
    concurrency = int(args.levels.split(",")[0])
    prof_dir = Path(args.profile) if args.profile else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    runs: list[list[dict]] = [[], []]
    for i in range(args.pairs):
        if args.together:
            order = (0, 1) if i % 2 == 0 else (1, 0)
            results = _together(args, variants, concurrency, order)
        else:
            results = {}
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for v in order:
                _label, root, fair = variants[v]
                profile = prof_dir / f"{'ab'[v]}{i}.prof" if prof_dir else None
                with tempfile.TemporaryDirectory() as tmp:
                    proc, url = _daemon(Path(tmp), args, args.accounting != "off", fair,
                                        root, profile)
                    try:
                        results[v] = measured_level(url, proc, concurrency, args.seconds,
                                                    profile, args.rate)
                    finally:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait(60)
                if profile:
                    profile.with_suffix(".json").write_text(json.dumps(
                        {"label": _label, "root": str(root), **results[v]}) + "\n")
        for v in order:
            r = results[v]
            runs[v].append(r)
            print(f"pair {i + 1} {variants[v][0]:>12}: {r['req_per_s']:7.0f} req/s, daemon "
                  f"{r['daemon_cpu_us_per_request']:6.1f} us CPU/request, workers "
                  f"{r['workers_cpu_us_per_request']:6.1f}, load {r['load_average']:.1f}",
                  flush=True)
    summary = {}
    for key in ("daemon_cpu_us_per_request", "workers_cpu_us_per_request", "req_per_s"):
        a, b = [r[key] for r in runs[0]], [r[key] for r in runs[1]]
        change = [y / x - 1 for x, y in zip(a, b)]
        n = len(change)
        se = statistics.stdev(change) / n ** 0.5 if n > 1 else float("nan")
        summary[key] = {"a_median": statistics.median(a), "b_median": statistics.median(b),
                        "mean_change": statistics.fmean(change), "se": se, "changes": change}
        if args.together and n >= 4:
            # Simultaneous daemons are not placed alike: the one started (and driven)
            # first costs a few percent less CPU per request, whichever tree it is. The
            # order alternates, so the mean of the two orders' means cancels that out,
            # and its standard error leaves the order's effect out of the scatter.
            by_order = [[c for c, r in zip(change, runs[1]) if r["first"] is first]
                        for first in (True, False)]
            means = [statistics.fmean(g) for g in by_order]
            ses = [statistics.stdev(g) / len(g) ** 0.5 if len(g) > 1 else float("nan")
                   for g in by_order]
            summary[key].update(
                mean_change=(means[0] + means[1]) / 2,
                se=0.5 * (ses[0] ** 2 + ses[1] ** 2) ** 0.5,
                b_first=means[0], b_second=means[1], order_effect=(means[1] - means[0]) / 2)
    result = {"a": variants[0][0], "b": variants[1][0], "pairs": args.pairs,
              "together": args.together, "rate": args.rate,
              "concurrency": concurrency, "seconds": args.seconds,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "runs": {"a": runs[0], "b": runs[1]}, "summary": summary,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    level = f"{args.rate:g} req/s offered" if args.rate > 0 else f"c = {concurrency}"
    print(f"\n| {level}, {args.pairs} pairs | {variants[0][0]} (median) | "
          f"{variants[1][0]} (median) | change per pair (mean ± se) |\n|---|---:|---:|---:|")
    for key, label in (("daemon_cpu_us_per_request", "daemon CPU us per request"),
                       ("workers_cpu_us_per_request", "workers' CPU us per request"),
                       ("req_per_s", "req/s")):
        m = summary[key]
        print(f"| {label} | {m['a_median']:,.1f} | {m['b_median']:,.1f} | "
              f"{m['mean_change']:+.1%} ± {m['se']:.1%} |")
    if args.together and "order_effect" in summary["daemon_cpu_us_per_request"]:
        m = summary["daemon_cpu_us_per_request"]
        print(f"\n(daemon CPU: {variants[1][0]} started first {m['b_first']:+.1%}, second "
              f"{m['b_second']:+.1%}: the order's own effect ±{abs(m['order_effect']):.1%}, "
              f"balanced out above)")
    return 0


def compare_accounting(args) -> int:
    """Accounting off vs on, alternating so drift on a shared machine hits both."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(args.repeats):
        for accounting in ((False, True) if i % 2 == 0 else (True, False)):
            with tempfile.TemporaryDirectory() as tmp:
                proc, url = _daemon(Path(tmp), args, accounting)
                daemon = psutil.Process(proc.pid)
                try:
                    asyncio.run(chat_level(url, 64, 1.0, 16))         # warm the daemon up
                    acc0 = _accounting_cpu(daemon) if accounting else 0.0
                    cpu0 = sum(daemon.cpu_times()[:2])
                    chat = asyncio.run(chat_level(url, 64, args.seconds, 16))
                    cpu1 = sum(daemon.cpu_times()[:2])
                    time.sleep(2.0)     # let the level's windows close (window_s below)
                    acc1 = _accounting_cpu(daemon) if accounting else 0.0
                    stream = (asyncio.run(stream_level(url, 32, 256, args.stream_rounds))
                              if args.stream_rounds > 0 else {"tokens_per_s": None})
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
            # the daemon's own CPU per request (its event loop; the workers and the
            # accounting are other processes): steadier than req/s on a shared machine
            us = 1e6 * (cpu1 - cpu0) / max(chat["requests"], 1)
            acc_us = 1e6 * (acc1 - acc0) / max(chat["requests"], 1)
            runs[accounting].append({"req_per_s": chat["req_per_s"], "p99_ms": chat["p99_ms"],
                                     "tokens_per_s": stream["tokens_per_s"],
                                     "daemon_cpu_us_per_request": us,
                                     "accounting_process_cpu_us_per_request": acc_us})
            streamed = (f", {stream['tokens_per_s']:.0f} streamed tokens/s"
                        if stream["tokens_per_s"] is not None else "")
            print(f"accounting {'on ' if accounting else 'off'}: {chat['req_per_s']:.0f} req/s "
                  f"(c=64), daemon {us:.0f} us CPU/request{streamed}"
                  + (f", accounting process {acc_us:.0f} us CPU/request" if accounting else ""),
                  flush=True)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    summary = {}
    keys = ["req_per_s", "daemon_cpu_us_per_request"] + (
        ["tokens_per_s"] if args.stream_rounds > 0 else [])
    for key in keys:
        off, on = median([r[key] for r in runs[False]]), median([r[key] for r in runs[True]])
        summary[key] = {"off": off, "on": on, "loss": 1 - on / off}
    summary["daemon_cpu_us_per_request"]["loss"] *= -1      # more CPU is the loss
    summary["accounting_process_cpu_us_per_request"] = median(
        [r["accounting_process_cpu_us_per_request"] for r in runs[True]])
    summary["pairs"] = paired_loss([r["req_per_s"] for r in runs[False]],
                                   [r["req_per_s"] for r in runs[True]])
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "devices": args.devices, "mode": args.mode, "repeats": args.repeats,
              "sim_speed": args.sim_speed, "model_spec": args.model_spec,
              "seconds": args.seconds, "runs": {"off": runs[False], "on": runs[True]},
              "median": summary, "date": time.strftime("%Y-%m-%d")}
    out = ROOT / "bench" / "results" / ("accounting_overhead.json" if args.sim_speed >= 1e5 else
                                         "accounting_overhead_gpu_bound.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| | accounting off | accounting on | loss |\n|---|---:|---:|---:|")
    for key, label in (("req_per_s", "chat req/s, c=64"), ("tokens_per_s", "streamed tokens/s, 32x256"),
                       ("daemon_cpu_us_per_request", "daemon CPU us per request, c=64")):
        if key not in summary:
            continue
        m = summary[key]
        print(f"| {label} | {m['off']:,.0f} | {m['on']:,.0f} | {m['loss']:.1%} |")
    pr = summary["pairs"]
    print(f"\nchat req/s lost per off/on pair ({pr['n']} pairs): mean {pr['mean']:.1%} "
          f"± {pr['se']:.1%} (standard error; ±2 se: {pr['low']:.1%} to {pr['high']:.1%}), "
          f"median {pr['median']:.1%}, standard deviation {pr['sd']:.1%}")
    print(f"the accounting process (nice 19, beside the daemon): "
          f"{summary['accounting_process_cpu_us_per_request']:.1f} us CPU per request")
    return 0


def paired_loss(off: list[float], on: list[float]) -> dict:
    """Each pair's loss 1 - on/off; on a shared machine the pairs scatter by several
    percent, so the mean comes with its standard error, and ±2 standard errors (about
    95% for 20 or more pairs) is the range the true loss is claimed to lie in."""
    losses = [1 - b / a for a, b in zip(off, on)]
    n = len(losses)
    mean = statistics.fmean(losses)
    sd = statistics.stdev(losses) if n > 1 else 0.0
    se = sd / n ** 0.5
    return {"n": n, "losses": losses, "mean": mean, "median": statistics.median(losses),
            "sd": sd, "se": se, "low": mean - 2 * se, "high": mean + 2 * se}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per concurrency level")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--mode", default="disagg", choices=["disagg", "agg"])
    p.add_argument("--levels", default="1,16,64")
    p.add_argument("--sim-speed", type=float, default=1e6,
                   help="simulated time's speed-up: 1e6 (default) makes the engine cost "
                        "nothing, so the daemon is what is measured; 1 runs the simulated "
                        "GPUs in real time (with --devices sim:8xH100 --model-spec ...)")
    p.add_argument("--model-spec", default="", help="simulated model shape, e.g. llama-3.1-70b-fp8")
    p.add_argument("--stream-rounds", type=int, default=3,
                   help="rounds of 32 streams x 256 tokens; with --accounting compare, 0 skips them")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving.json"))
    p.add_argument("--accounting", choices=["on", "off", "compare"], default="on",
                   help="chargeback in the daemon (default on, as shipped); compare: off vs on")
    p.add_argument("--repeats", type=int, default=3, help="--accounting compare: rounds of off+on")
    p.add_argument("--fair-queuing", choices=["on", "off", "compare"], default="on",
                   help="[engine] fair_queuing: the engines' and the router's fair queues "
                        "(default on, as shipped); off: arrival order; compare: off against "
                        "on in alternating pairs (--pairs, at --levels' first level)")
    p.add_argument("--compare-root", default="",
                   help="another checkout (e.g. a git archive of an older commit): its daemon "
                        "against this tree's, in alternating pairs at --levels' first level")
    p.add_argument("--pairs", type=int, default=10, help="pairs for --compare-root / "
                   "--fair-queuing compare")
    p.add_argument("--rate", type=float, default=0.0,
                   help="with --compare-root or --fair-queuing compare: an open loop of this "
                        "many requests per second instead of --levels' closed loop (the same "
                        "work per second on both sides, so CPU per request is not skewed by "
                        "batching)")
    p.add_argument("--together", action="store_true",
                   help="with --compare-root or --fair-queuing compare: run each pair's two "
                        "daemons at the same time (the same load on both) instead of in turn")
    p.add_argument("--profile", default="", help="with --compare-root or --fair-queuing "
                   "compare: profile each daemon's measured level into this directory "
                   "(bench/profile_diff.py compares them)")
    args = p.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    if args.accounting == "compare":
        return compare_accounting(args)
    if args.compare_root or args.fair_queuing == "compare":
        if args.out == str(ROOT / "bench" / "results" / "serving.json"):
            args.out = str(ROOT / "bench" / "results" / (
                "serving_pairs.json" if args.compare_root else "serving_fair_pairs.json"))
        return compare_pairs(args)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _daemon(Path(tmp), args, args.accounting == "on")
        try:
            daemon = psutil.Process(proc.pid)
            chat = []
            for c in args.levels.split(","):
                cpu0 = _cpu(daemon)
                r = asyncio.run(chat_level(url, int(c), args.seconds, 16))
                # (the CPU includes the level's warm-up, whose requests are not counted:
                # scaled by time, as if it ran at the measured rate; an estimate, the
                # paired modes below measure it exactly)
                r["daemon_cpu_us_per_request"] = 1e6 * (_cpu(daemon) - cpu0) / max(
                    r["requests"], 1) * args.seconds / (args.seconds + min(1.0, args.seconds / 4))
                chat.append(r)
            stream = asyncio.run(stream_level(url, 32, 256, args.stream_rounds))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()},
              "devices": args.devices, "mode": args.mode, "fair_queuing": args.fair_queuing,
              "chat_16_tokens": chat,
              "stream_32x256": stream, "date": time.strftime("%Y-%m-%d")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| concurrency | req/s | p50 ms | p99 ms | errors | daemon CPU µs/request |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for r in chat:
        print(f"| {r['concurrency']} | {r['req_per_s']:.0f} | {r['p50_ms']:.1f} | "
              f"{r['p99_ms']:.1f} | {r['errors']} | {r['daemon_cpu_us_per_request']:.0f} |")
    print(f"\nstreamed: {stream['tokens_per_s']:.0f} tokens/s "
          f"(32 streams x 256 tokens x {stream['rounds']} rounds, "
          f"{stream['sse_events']} SSE events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
