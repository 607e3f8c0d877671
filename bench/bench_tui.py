"""`applianced tui` in a real terminal (tmux, TERM=xterm-256color): the issue's contract
check and the console's idle CPU.

    .venv/bin/python bench/bench_tui.py                 # ~1 min: starts a sim:8xH100 daemon
    .venv/bin/python bench/bench_tui.py --url URL       # against a running daemon
    .venv/bin/python bench/bench_tui.py --size 200x60 --seconds 30
    .venv/bin/python bench/bench_tui.py --capture docs/tui-overview.txt   # the manual's capture

1. Starts the console at the given size and waits for its first screen to show PREFILL,
   DECODE, the eight devices, SIMULATED and a ratio `N:1` (a few seconds of mixed load
   are sent first, so a daemon without a live ratio still has one to show); prints how
   long that took.
2. Measures the console process's CPU with psutil over `--seconds` on the overview,
   with the daemon idle: once against the daemon as it is (SSE if it has
   /admin/v1/stream, else polling once a second), and once against the test suite's
   contract fixture streaming 4 snapshots a second (the most the console redraws).
3. Presses q and checks the exit status is 0.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def load(url: str, seconds: float) -> None:
    """A few requests of both shapes, so the prefill and decode groups both work."""
    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]

    def one(prompt: str, max_tokens: int):
        end = time.time() + seconds
        while time.time() < end:
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()
    threads = [threading.Thread(target=one, args=a) for a in
               [("word " * 3000, 1)] * 2 + [("hi", 200)] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def contract_ok(screen: str) -> list[str]:
    missing = [w for w in ("PREFILL", "DECODE", "SIMULATED") if w not in screen]
    missing += [f"sim{i}" for i in range(8) if not re.search(rf"\bsim{i}\b", screen)]
    if not re.search(r"\d+(\.\d+)?:1|\d×", screen):
        missing.append("ratio")
    return missing


def run_console(url: str, size: str, seconds: float, wait_contract: bool) -> dict:
    cols, rows = size.split("x")
    session = f"bench-tui-{int(time.time() * 1000) % 100000}"
    rc_file = Path(tempfile.mkdtemp()) / "rc"
    cmd = (f"TERM=xterm-256color {shlex.quote(sys.executable)} -m appliance tui "
           f"--url {shlex.quote(url)}; echo $? > {rc_file}")
    tmux("new-session", "-d", "-s", session, "-x", cols, "-y", rows,
         f"cd {shlex.quote(str(ROOT))} && PYTHONPATH={shlex.quote(str(ROOT))} {cmd}")
    out: dict = {"size": size}
    try:
        started = time.monotonic()
        screen, missing = "", ["everything"]
        while time.monotonic() - started < 30:
            screen = tmux("capture-pane", "-p", "-t", session)
            missing = contract_ok(screen)
            if not missing or (not wait_contract and "sim7" in screen):
                break
            time.sleep(0.1)
        out["first_screen_s"] = round(time.monotonic() - started, 2)
        out["contract_missing"] = missing
        out["screen"] = screen
        pane_pid = int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())
        console = next(p for p in psutil.Process(pane_pid).children(recursive=True)
                       if "tui" in " ".join(p.cmdline()))
        time.sleep(2)                                   # past the start-up work
        t0 = console.cpu_times()
        w0 = time.monotonic()
        time.sleep(seconds)
        t1 = console.cpu_times()
        wall = time.monotonic() - w0
        out["cpu_percent_of_one_core"] = round(
            100 * ((t1.user - t0.user) + (t1.system - t0.system)) / wall, 2)
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        out["exit_status"] = int(rc_file.read_text()) if rc_file.exists() else None
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running daemon (default: start sim:8xH100)")
    ap.add_argument("--size", default="80x24")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--load-seconds", type=float, default=6.0)
    ap.add_argument("--capture", help="write the first screen (under load) to this file")
    args = ap.parse_args()

    from helpers.daemons import start_daemon     # the test suite's own daemon launcher
    from helpers.admin_fixture import FixtureAdmin, contract_status
    daemon = None
    url = args.url
    if url is None:
        daemon = start_daemon(Path(tempfile.mkdtemp()), None, "--devices", "sim:8xH100",
                              "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "10")
        url = daemon.url
    results = {}
    try:
        loader = threading.Thread(target=load, args=(url, args.load_seconds))
        loader.start()
        time.sleep(1)
        first = run_console(url, args.size, 0.5, wait_contract=True)   # contract, under load
        loader.join()
        time.sleep(11)                       # the 10 s windows empty: the daemon is idle
        idle = run_console(url, args.size, args.seconds, wait_contract=False)
        with FixtureAdmin(contract_status(0.9, 0.5), sse_interval=0.25) as fx:
            streamed = run_console(fx.url, args.size, args.seconds, wait_contract=True)
        results = {"contract": {k: first[k] for k in ("first_screen_s", "contract_missing",
                                                      "exit_status")},
                   "idle_daemon": {k: idle[k] for k in ("cpu_percent_of_one_core", "exit_status")},
                   "fixture_sse_4_per_s": {k: streamed[k] for k in ("cpu_percent_of_one_core",
                                                                     "exit_status")}}
        print(first["screen"])
        if args.capture:
            Path(args.capture).write_text("\n".join(ln.rstrip() for ln in
                                                    first["screen"].rstrip().splitlines()) + "\n")
        print(json.dumps(results, indent=2))
    finally:
        if daemon is not None:
            daemon.stop()
    ok = (not results["contract"]["contract_missing"]
          and all(r["exit_status"] == 0 for r in results.values()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
