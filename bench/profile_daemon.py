"""Run `applianced` (any checkout's: the working directory's `appliance`) under cProfile,
switched on and off by signals, so that only a benchmark's measured minutes are profiled:

    python bench/profile_daemon.py OUT.prof -m appliance serve ...   (cwd: the checkout)

SIGUSR1 starts profiling the daemon's main thread (its event loop: HTTP, routing,
responses); SIGUSR2 stops it and writes the stats to OUT.prof (pstats format). Used by
`bench/daemon_process.py` when `BENCH_PROFILE` is set, and by `bench_serving.py
--profile`; it is a bench tool, not part of the product (the daemon knows nothing of it).
cProfile counts every call exactly (the counts do not depend on the machine's load) and
adds its own cost to each, so compare calls per request first, times second.
"""
from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys


def main() -> None:
    out = sys.argv[1]
    if sys.argv[2:3] != ["-m"] or len(sys.argv) < 4:
        raise SystemExit("usage: profile_daemon.py OUT.prof -m MODULE [ARGS...]")
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    sys.path[0] = os.getcwd()       # as `python -m` would: the checkout first
    prof = cProfile.Profile()

    def start(*_) -> None:
        prof.enable()

    def stop(*_) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
