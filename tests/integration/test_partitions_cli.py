"""Partition planning as `applianced serve` applies it: a plan it cannot run is refused in
one line before anything starts."""
from __future__ import annotations

import os
from pathlib import Path


def test_serve_refuses_torch_with_tp_2_in_one_line(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "appliance", "serve", "--devices", "sim:4xH100",
                        "--tp", "2", "--engine", "torch", "--state-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("applianced:")]
    assert len(lines) == 1 and "engine = torch runs one GPU per worker" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
