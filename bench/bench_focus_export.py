"""Time of a FOCUS export (issue 22 §5): a ledger written by the real accountant with
one request a minute over H hours (8 simulated H100s, three tenants, idle policy
`idle`), then `focus.rows` + `focus.to_csv` over the whole span, one allocation report
per UTC hour. Prints rows, seconds and ms per charge hour. ~25 s for 24 h (most of it
building the ledger).

    .venv/bin/python bench/bench_focus_export.py [--hours 24]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.ledger_scene import T0, ledger_with, method  # noqa: E402  (the tests' ledger scene)

from appliance.accounting import focus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    h = ap.parse_args().hours
    runs = [(f"R{i}", ("ta", "tb", "tc")[i % 3], T0 + 1 + i * 60, 0.5, 2.0)
            for i in range(int(h * 60))]
    t = time.perf_counter()
    led = ledger_with(Path(tempfile.mkdtemp()), runs, end=T0 + h * 3600)
    built = time.perf_counter() - t
    m = method("idle")
    m.tenant_tags = {"ta": {"team": "search"}}
    t = time.perf_counter()
    rows = focus.rows(led, T0, T0 + h * 3600, m, focus.Source("app1", "8xH100-SXM", "s1"))
    text = focus.to_csv(rows)
    dt = time.perf_counter() - t
    periods = len(focus.hours(T0, T0 + h * 3600))
    print(f"ledger: {len(runs)} requests over {h:g} h (built in {built:.1f} s)")
    print(f"FOCUS export: {len(rows)} rows, {len(text)} bytes, {dt:.3f} s "
          f"({dt / periods * 1000:.1f} ms per charge hour, {periods} hours)")
    led.stop()


if __name__ == "__main__":
    main()
