"""The soak with faults, short: 30 s of streaming clients on a simulated 8xH100 while workers
are killed, clients hang up mid-stream and a repartition runs (bench/bench_soak.py is the
5-minute version whose numbers the docs show)."""
from __future__ import annotations

import json
import subprocess
import sys

from helpers.daemons import ROOT


def test_short_soak_with_kills_disconnects_and_a_repartition(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_soak.py", "--seconds", "30", "--clients", "24",
         "--kill-every", "9", "--repartition", "5+3", "--max-words", "800",
         "--max-tokens", "120", "--hang-after", "45", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    # The faults happened: at least two kills and the repartition was accepted.
    kills = [f for f in r["faults"] if "kill -9" in f]
    assert len(kills) >= 2, r["faults"]
    assert any("repartition 5+3: 201" in f for f in r["faults"]), r["faults"]
    # Every request is accounted for, and the load was real.
    assert r["completed"] + r["failed_clean"] + r["disconnected"] + r["broken"] + r["hung"] \
        == r["requests"]
    assert r["completed"] >= 50 and r["disconnected"] >= 5, r
    # The goals: nothing hung or cut without an error, no KV leaked after the drain,
    # each completed request in the ledger exactly once, the daemon alive.
    assert r["hung"] == 0 and r["broken"] == 0, r["examples"]
    assert not any(r["kv_blocks_leaked"].values()), r["kv_blocks_leaked"]
    assert r["ledger"]["missing"] == 0 and r["ledger"]["more_than_once"] == 0, r["ledger"]
    assert r["ledger"]["completed"] == r["completed"]
    assert r["daemon_alive"] and all(r["goals"].values()), r["goals"]
    assert proc.returncode == 0, proc.stdout[-2000:]
