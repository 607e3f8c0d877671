"""A soak with faults: does the appliance stay correct while clients misbehave and workers die?

    .venv/bin/python bench/bench_soak.py                       # 5 min, 256 streams, the README's run
    .venv/bin/python bench/bench_soak.py --seconds 30 --clients 32 --kill-every 10

A real daemon on a loopback port (by default `sim:8xH100` serving `llama-3.1-70b-fp8` at
real-time speed, accounting on) takes `--clients` concurrent streaming chat clients for
`--seconds`. Meanwhile:
- a share of the requests (`--disconnect`, 20%) close their connection mid-stream;
- every `--kill-every` seconds a random worker gets SIGKILL (the daemon restarts it);
- half-way through, one repartition workflow (`--repartition`, e.g. 5+3) runs.

What a request can end as, and what each means:
- `completed`: the stream ended with a finish_reason and `[DONE]`;
- `failed_clean`: an OpenAI error, as an HTTP status with the error JSON, or as an SSE
  `event: error` followed by `[DONE]` (a worker died under it, the box was draining ...);
- `disconnected`: the client closed it on purpose;
- `broken`: the connection ended in any other way (no error, no `[DONE]`): never expected;
- `hung`: no byte for `--hang-after` seconds: never expected.

After the load it waits for the box to drain and reports, per worker, the KV blocks still
in use (goal 0 leaked), each completed request's row in the ledger (goal: exactly one,
with a final status), the daemon's RSS before and after, and TTFT p99 for requests that
started within `--fault-window` seconds after a fault versus the rest. The JSON goes to
`--out` (bench/results/soak.json by default); the exit status is 1 when a goal fails.

Bounded: every request has a deadline, the load stops at `--seconds`, the drain waits at
most `--drain-timeout`. Loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_process import ROOT, pct, start_daemon  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 10) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class Outcome:
    __slots__ = ("start", "ttft", "end", "kind", "rid", "detail")

    def __init__(self, start: float):
        self.start, self.ttft, self.end = start, None, None
        self.kind, self.rid, self.detail = "broken", None, ""


async def one_request(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random,
                      args) -> Outcome:
    out = Outcome(time.monotonic())
    words = rng.randint(args.min_words, args.max_words)
    body = {"model": model, "stream": True, "max_tokens": rng.randint(16, args.max_tokens),
            "messages": [{"role": "user",
                          "content": " ".join(rng.choice(WORDS) for _ in range(words))}]}
    leave_after = rng.randint(1, 8) if rng.random() < args.disconnect else None
    events = 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                err = await asyncio.wait_for(r.json(content_type=None), args.hang_after)
                ok = isinstance(err, dict) and isinstance(err.get("error"), dict) \
                    and "message" in err["error"]
                out.kind = "failed_clean" if ok else "broken"
                out.detail = f"HTTP {r.status} {err.get('error', {}).get('code') if ok else err}"
                return out
            pending_error = False
            while True:
                line = await asyncio.wait_for(r.content.readline(), args.hang_after)
                if not line:
                    out.detail = f"EOF after {events} events"
                    return out                      # broken: ended without [DONE]
                line = line.strip()
                if line == b"event: error":
                    pending_error = True
                    continue
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    if out.kind == "completed" or pending_error:
                        return out
                    out.kind, out.detail = "broken", "[DONE] without a finish_reason"
                    return out
                chunk = json.loads(data)
                if pending_error or "error" in chunk:
                    out.kind = "failed_clean"
                    out.detail = "SSE error: " + str(chunk.get("error", {}).get("code"))
                    pending_error = True
                    continue
                out.rid = out.rid or chunk.get("id")
                events += 1
                if out.ttft is None:
                    out.ttft = time.monotonic() - out.start
                if any(c.get("finish_reason") for c in chunk.get("choices", ())):
                    out.kind = "completed"
                if leave_after is not None and events >= leave_after and out.kind != "completed":
                    out.kind = "disconnected"
                    r.close()                       # drop the connection mid-stream
                    return out
    except asyncio.TimeoutError:
        out.kind, out.detail = "hung", f"no byte for {args.hang_after} s after {events} events"
        return out
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.kind, out.detail = "broken", f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out.end = time.monotonic()


async def load(url: str, model: str, args, faults: list[tuple[float, str]],
               rss: list[tuple[float, float]], daemon: psutil.Process) -> list[Outcome]:
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    stop_at = time.monotonic() + args.seconds
    conn = aiohttp.TCPConnector(limit=args.clients)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.hang_after)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def client(k: int) -> None:
            crng = random.Random(rng.random())
            while time.monotonic() < stop_at:
                outcomes.append(await one_request(session, url, model, crng, args))

        async def sample_rss() -> None:
            # A leak grows with time; a working set levels off: keep the curve, not two points.
            t0 = time.monotonic()
            while time.monotonic() < stop_at:
                rss.append((round(time.monotonic() - t0, 1),
                            round(daemon.memory_info().rss / 2**20, 1)))
                await asyncio.sleep(args.seconds / 20)

        await asyncio.gather(fault_loop(url, args, faults, stop_at), sample_rss(),
                             *(client(k) for k in range(args.clients)))
    return outcomes


async def fault_loop(url: str, args, faults: list[tuple[float, str]], stop_at: float) -> None:
    """Kill a random worker every --kill-every s; start the repartition half-way."""
    rng = random.Random(args.seed + 1)
    t0 = time.monotonic()
    next_kill = t0 + args.kill_every
    repartition_at = t0 + args.seconds / 2 if args.repartition else None
    loop = asyncio.get_running_loop()
    while time.monotonic() < stop_at:
        await asyncio.sleep(0.2)
        now = time.monotonic()
        if repartition_at is not None and now >= repartition_at:
            repartition_at = None
            code, body = await loop.run_in_executor(None, post_json, url + "/admin/v1/workflows",
                                                    {"kind": "repartition",
                                                     "params": {"split": args.repartition}})
            faults.append((now, f"repartition {args.repartition}: {code} {body.get('id')}"))
        if args.kill_every and now >= next_kill:
            next_kill = now + args.kill_every
            status = await loop.run_in_executor(None, get_json, url + "/admin/v1/status")
            alive = [w for w in status["workers"] if w.get("pid") and w["state"] == "ready"]
            if alive:
                w = rng.choice(alive)
                try:
                    os.kill(w["pid"], signal.SIGKILL)
                    faults.append((now, f"kill -9 {w['worker']} (pid {w['pid']})"))
                except ProcessLookupError:
                    pass


def wait_drained(url: str, timeout: float) -> tuple[dict, float]:
    """The box once no request is in flight, every worker ready and its KV free."""
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    while True:
        st = get_json(url + "/admin/v1/status")
        busy = st["inflight"] or any(
            w["state"] != "ready" or w.get("kv_blocks_free") != w.get("kv_blocks_total")
            or w.get("kv_blocks_handed_off") or w.get("running") or w.get("waiting")
            for w in st["workers"])
        running_wf = bool((st.get("workflows") or {}).get("active"))
        if (not busy and not running_wf) or time.monotonic() > deadline:
            return st, time.monotonic() - t0
        time.sleep(0.5)


def ledger_rows(state: Path, timeout: float, want: set[str]) -> dict[str, list[tuple]]:
    """request_id -> its ledger rows (status, final), once every wanted id has a final row
    or the timeout passes (the accounting process commits on its own cadence)."""
    deadline = time.monotonic() + timeout
    while True:
        con = sqlite3.connect(f"file:{state / 'ledger.db'}?mode=ro", uri=True, timeout=10)
        try:
            rows: dict[str, list[tuple]] = {}
            for rid, status, final in con.execute(
                    "SELECT request_id, status, final FROM requests"):
                rows.setdefault(rid, []).append((status, final))
        finally:
            con.close()
        if all(any(f for _, f in rows.get(r, ())) for r in want) or time.monotonic() > deadline:
            return rows
        time.sleep(1)


def summarize(outcomes: list[Outcome], faults: list[tuple[float, str]], args) -> dict:
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    fault_times = [t for t, _ in faults]

    def near_fault(o: Outcome) -> bool:
        return any(t <= o.start + (o.ttft or 0) and o.start <= t + args.fault_window
                   for t in fault_times)
    during = [o.ttft for o in outcomes if o.ttft is not None and near_fault(o)]
    outside = [o.ttft for o in outcomes if o.ttft is not None and not near_fault(o)]
    return {"requests": len(outcomes), **{k: kinds.get(k, 0) for k in
            ("completed", "failed_clean", "disconnected", "broken", "hung")},
            "ttft_p99_s": {"during_faults": pct(during, 0.99), "outside_faults": pct(outside, 0.99),
                           "n_during": len(during), "n_outside": len(outside)},
            "ttft_p50_s": {"during_faults": pct(during, 0.5), "outside_faults": pct(outside, 0.5)},
            "examples": {k: [o.detail for o in outcomes if o.kind == k][:5]
                         for k in ("failed_clean", "broken", "hung")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--kill-every", type=float, default=30, help="0: no kills")
    ap.add_argument("--repartition", default="5+3", help="the split half-way ('' for none)")
    ap.add_argument("--devices", default="sim:8xH100")
    ap.add_argument("--model-spec", default="llama-3.1-70b-fp8")
    ap.add_argument("--sim-speed", default="1")
    ap.add_argument("--min-words", type=int, default=20)
    ap.add_argument("--max-words", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--hang-after", type=float, default=60)
    ap.add_argument("--fault-window", type=float, default=10)
    ap.add_argument("--drain-timeout", type=float, default=90)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/soak.json"))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        state = Path(tmp)
        proc, url = start_daemon(state, ["--devices", args.devices, "--model-spec",
                                         args.model_spec, "--sim-speed", args.sim_speed])
        try:
            model = get_json(url + "/v1/models")["data"][0]["id"]
            daemon = psutil.Process(proc.pid)
            rss_before = daemon.memory_info().rss
            faults: list[tuple[float, str]] = []
            t0 = time.monotonic()
            rss: list[tuple[float, float]] = []
            outcomes = asyncio.run(load(url, model, args, faults, rss, daemon))
            elapsed = time.monotonic() - t0
            st, drain_s = wait_drained(url, args.drain_timeout)
            leaked = {w["worker"]: (w.get("kv_blocks_total", 0) - w.get("kv_blocks_free", 0))
                      + (w.get("kv_blocks_handed_off") or 0) for w in st["workers"]}
            completed = {o.rid[o.rid.index("-") + 1:] for o in outcomes
                         if o.kind == "completed" and o.rid}
            rows = ledger_rows(state, 30, completed)
            missing = sorted(r for r in completed if not any(f for _, f in rows.get(r, ())))
            twice = sorted(r for r in completed if len(rows.get(r, ())) > 1)
            rss_after = daemon.memory_info().rss
            alive = proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except Exception:
                proc.kill()
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "seconds": round(elapsed, 1),
        **summarize(outcomes, faults, args),
        "faults": [f"{t - t0:.1f}s {what}" for t, what in faults],
        "drain_s": round(drain_s, 1),
        "kv_blocks_leaked": leaked,
        "ledger": {"completed": len(completed), "missing": len(missing), "more_than_once":
                   len(twice), "rows": sum(len(v) for v in rows.values()),
                   "missing_ids": missing[:5]},
        "daemon_rss_mb": {"before": round(rss_before / 2**20, 1),
                          "after": round(rss_after / 2**20, 1), "during": rss},
        "daemon_alive": alive,
    }
    goals = {"no_hung": result["hung"] == 0, "no_broken": result["broken"] == 0,
             "no_kv_leaked": not any(leaked.values()),
             "each_completed_once_in_ledger": not missing and not twice,
             "daemon_alive": alive}
    result["goals"] = goals
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("seconds", "requests", "completed", "failed_clean",
                                             "disconnected", "broken", "hung", "ttft_p99_s",
                                             "kv_blocks_leaked", "ledger", "daemon_rss_mb",
                                             "faults", "goals")}, indent=2))
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
