"""CPU per request of the accounting process's own path: the accountant filing a
request and its iterations, closing windows, building rows, and the ledger's writer
committing them (no daemon, no sockets). What a change to the row or window code costs
shows here in µs per request, within a minute, on a machine too busy for the serving
comparison (bench_serving.py --accounting compare) to resolve 1%.

    .venv/bin/python bench/bench_accounting_cpu.py [--requests 40000] [--tree PATH]

`--tree` runs another checkout's `appliance` package (e.g. a `git archive` of the
commit before a change) for a side-by-side number.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40000)
    p.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    args = p.parse_args()
    sys.path.insert(0, args.tree)
    from appliance.accounting.accountant import Accountant, Site
    from appliance.accounting.attribution import DeviceInfo
    from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon
    from appliance.accounting.cost import PriceBook
    from appliance.accounting.ledger import Ledger
    from appliance.accounting.records import RequestRecord
    from appliance.engines.messages import IterationRecord

    t0 = 1_700_000_000.0
    tmp = Path(tempfile.mkdtemp())
    devs = [DeviceInfo(f"g{i}", "H100-SXM", "sim", True) for i in range(2)]
    ledger = Ledger(tmp / "ledger.db", flush_interval_s=0.2, retention_days=0)
    ledger.start()
    acc = Accountant(devs, "m", Site("s", "a", "DE", 1.5, CarbonIntensity(400.0)), ledger,
                     PriceBook({}, 0.1, "share"), EmbodiedCarbon({}, {}), window_s=10.0,
                     start=t0)
    rate, batch = 1000.0, 32            # requests per simulated second, per batch
    cpu0 = time.process_time()
    t = t0
    for k in range(0, args.requests, batch):
        ids = [f"r{k + j}" for j in range(batch)]
        acc.iteration(IterationRecord("p0", "prefill", t, 0.01, ("g0",), False,
                                      [(r, 100, 100) for r in ids], False))
        for step in range(4):
            acc.iteration(IterationRecord("d0", "decode", t + 0.01 + step * 0.002, 0.002, ("g1",),
                                          False, [(r, 1, 100 + step) for r in ids], False))
        for j, r in enumerate(ids):
            acc.request(RequestRecord(r, f"t{j % 4}", "m", "chat", 100, 4, 0, t, t + 0.01,
                                      t + 0.02, "p0", "d0", "ok", "stop"))
        t += batch / rate
        if int(t) != int(t - batch / rate):
            acc.tick(now=t)
    acc.stop(now=t + 20)
    cpu = time.process_time() - cpu0
    print(f"{args.tree}: {args.requests} requests, {cpu / args.requests * 1e6:.1f} µs CPU per "
          f"request (accountant + ledger writer)")


if __name__ == "__main__":
    main()
