"""Two daemons' profiles of the same load, function by function, per request:

    .venv/bin/python bench/profile_diff.py PROFILE_DIR [--top 40]

reads the `a*.prof` / `b*.prof` files (and the `.json` beside each: its request count)
that `bench_serving.py --compare-root DIR --profile PROFILE_DIR` (or `--fair-queuing
compare --profile ...`) wrote, and prints, for every function whose calls per request
or own time per request differ, both sides and the difference, biggest first. Functions
are named by path inside the checkout (`appliance/daemon/router.py:generate`), so two
checkouts' profiles line up; a function that moved lines is still the same function.
Calls per request are exact (cProfile counts every call); times carry cProfile's own
cost per call, so a function called more often looks dearer than it is.
"""
from __future__ import annotations

import argparse
import json
import pstats
import re
from collections import defaultdict
from pathlib import Path


def _name(file: str, func: str) -> str:
    m = re.search(r"(appliance/.*|aiohttp/.*|asyncio/.*|site-packages/(.*))$", file)
    path = (m.group(2) or m.group(1)) if m else file.rsplit("/", 1)[-1]
    return f"{path}:{func}"


# Called once per chat request in every version (a plain function: cProfile counts each
# resumption of a coroutine as a call): the profiles' request count (the
# profile also spans the level's warm-up second, which the bench's count leaves out).
ONCE = "appliance/daemon/completion.py:prepare_prompt"


def per_request(prof_files: list[Path]) -> tuple[dict[str, list[float]], int]:
    """name -> [calls, own seconds, cumulative seconds] per request, over the files."""
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for f in prof_files:
        st = pstats.Stats(str(f))
        for (file, _line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
            row = total[_name(file, func)]
            row[0] += nc
            row[1] += tt
            row[2] += ct
    requests = int(total[ONCE][0])
    return {k: [v[0] / requests, v[1] / requests, v[2] / requests] for k, v in total.items()}, requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--by", choices=["calls", "time"], default="time")
    args = p.parse_args()
    d = Path(args.dir)
    a, na = per_request(sorted(d.glob("a*.prof")))
    b, nb = per_request(sorted(d.glob("b*.prof")))
    label = lambda side: json.loads(next(d.glob(f"{side}*.json")).read_text())["label"]
    calls_a = sum(v[0] for v in a.values())
    calls_b = sum(v[0] for v in b.values())
    time_a = sum(v[1] for v in a.values())
    time_b = sum(v[1] for v in b.values())
    print(f"A = {label('a')} ({na} requests), B = {label('b')} ({nb} requests)")
    print(f"calls per request: A {calls_a:.1f}, B {calls_b:.1f} ({calls_b - calls_a:+.1f}); "
          f"profiled own time per request: A {1e6 * time_a:.1f} us, B {1e6 * time_b:.1f} us\n")
    names = set(a) | set(b)
    zero = [0.0, 0.0, 0.0]
    key = (lambda n: abs(b.get(n, zero)[0] - a.get(n, zero)[0])) if args.by == "calls" else \
        (lambda n: abs(b.get(n, zero)[1] - a.get(n, zero)[1]))
    print("| function | calls/req A | B | own us/req A | B | diff us |\n|---|---:|---:|---:|---:|---:|")
    for n in sorted(names, key=key, reverse=True)[:args.top]:
        ra, rb = a.get(n, zero), b.get(n, zero)
        print(f"| {n} | {ra[0]:.2f} | {rb[0]:.2f} | {1e6 * ra[1]:.2f} | {1e6 * rb[1]:.2f} | "
              f"{1e6 * (rb[1] - ra[1]):+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
