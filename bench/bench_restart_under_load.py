"""kill -9 of a daemon while other processes keep the cores busy: how long until the
restarted daemon answers `/ready`.

The accounting process outlives its daemon to commit the last window, and the restarted
daemon's accounting process waits for that (a lock beside the ledger) before the daemon
goes on. Both used to run at nice 19 from their first instruction, so beside busy
processes they got almost no CPU; now the process lowers itself only once started and
goes back to its daemon's priority when the daemon is gone (docs/operations/chargeback.md,
"The accounting process"). Root, or LimitNICE=+0 as in the systemd unit, is needed to go
back up; without it the old figure is what you measure.

    .venv/bin/python bench/bench_restart_under_load.py                 # 2 busy loops
    .venv/bin/python bench/bench_restart_under_load.py --hogs 0 --runs 3

The torch engine on the generated tiny model, disaggregated, 1-s accounting windows;
a few requests served before the kill so that there is a last window to commit.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.daemons import start_daemon  # noqa: E402

from appliance.models.tiny import init_tiny  # noqa: E402

ARGS = ["--devices", "cpu", "--engine", "torch", "--mode", "disagg"]
CONFIG = "[accounting]\nwindow_s = 1.0\nflush_interval_s = 0.2\n"


def one_run(tmp: Path, model: Path, hogs: int) -> float:
    d = start_daemon(tmp, model, *ARGS, config=CONFIG)
    name = d.status()["model"]
    for _ in range(5):
        code, _, body = d.post("/v1/completions", {"model": name, "prompt": "hi there",
                                                    "max_tokens": 20})
        assert code == 200, body
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        time.sleep(1)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        again = start_daemon(tmp, model, *ARGS, config=CONFIG, port=d.port, timeout=600)
        took = time.monotonic() - t0
    finally:
        for p in busy:
            p.kill()
    again.stop()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=2, help="nice-0 busy loops during the restart")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny-llama", seed=0)
        for i in range(a.runs):
            took = one_run(Path(tmp) / f"run{i}", model, a.hogs)
            print(f"busy loops {a.hogs}: kill -9 to the restart's /ready {took:.1f} s", flush=True)


if __name__ == "__main__":
    main()
