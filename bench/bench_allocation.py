"""The scene of issue 22 §2-3 on a live daemon: 8 simulated H100s priced at $3.60/h,
llama-3.1-70b-fp8, one request, then a 20-s query window holding it and an idle 10-s
window. Prints the devices' capacity cost of the window beside the rows' allocation,
and the carbon rows beside measured energy × PUE × intensity + embodied over wall time
(before query-time allocation: $0.020 of $0.160, 0.054 g of 2.703 g). ~45 s.

    .venv/bin/python bench/bench_allocation.py
"""
from __future__ import annotations

import json
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from daemon_process import start_daemon


def main() -> None:
    state = Path(tempfile.mkdtemp())
    (state / "c.toml").write_text('[accounting]\nusd_per_gpu_hour = { "H100-SXM" = 3.60 }\n')
    proc, url = start_daemon(state, ["--devices", "sim:8xH100", "--model-spec",
                                     "llama-3.1-70b-fp8", "--config", str(state / "c.toml")])

    def get(path: str, **q) -> dict:
        with urllib.request.urlopen(url + path + "?" + urllib.parse.urlencode(q)) as r:
            return json.loads(r.read())

    try:
        now = time.time()
        t = (int(now // 10) + 1) * 10          # the next window boundary
        time.sleep(t - now + 0.5)
        body = json.dumps({"model": "llama-3.1-70b-fp8", "prompt": [1] * 1500, "max_tokens": 40,
                           "ignore_eos": True}).encode()
        urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", body, {"Content-Type": "application/json"})).read()
        time.sleep(max(0.0, t + 20 + 13 - time.time()))     # both windows closed, rows final
        u = get("/admin/v1/usage", group_by="tenant", since=str(t), until=str(t + 20))
        c = get("/admin/v1/carbon", group_by="tenant", since=str(t), until=str(t + 20))
        tot = c["totals"]
        pue, grid = c["site"]["pue"], 480.0
        print(f"capacity cost {u['totals']['capacity_cost']:.3f} {u['currency']}, rows' "
              f"cost_allocation {sum(r['cost_allocation'] for r in u['rows']):.3f}")
        print(f"carbon rows {sum(r['co2e_grams'] for r in c['rows']):.3f} g, measured energy x "
              f"PUE x I + embodied over wall time "
              f"{tot['energy_joules'] / 3.6e6 * pue * grid + tot['co2e_embodied_grams']:.3f} g, "
              f"SCI {tot['sci_grams_per_request']:.3f} g/request")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
