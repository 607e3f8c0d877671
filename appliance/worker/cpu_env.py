"""The OpenMP wait policy a CPU worker runs with, unless the operator chose one.

torch's CPU build uses GNU OpenMP (libgomp), whose threads by default spin for up to
300,000 iterations after each parallel region before they sleep. A worker's step is
hundreds of small parallel regions with Python between them, so a worker with two or
more threads keeps every core it has busy spinning while its main thread dispatches the
next op: CPU time that the daemon (on the same cores) and the other worker need, and
on a loaded box a spinning thread also waits out whole time slices for a preempted
sibling. On the 2-core development machine under load this made one 2-thread agg
worker collapse (0.06 req/s at C = 8); passive waiting (sleep at once on a futex) cost
the same toy step 5.7x less CPU and ran it 16x faster (docs/engines/torch.md). A
single-threaded worker opens no parallel region, so the setting changes nothing there.
"""
from __future__ import annotations

from collections.abc import Mapping

# Either one set by the operator means they chose how OpenMP threads wait: keep theirs.
OPERATOR_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def cpu_worker_env(base: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a CPU worker's environment (read by libgomp at load, so
    they must be in the environment the worker process starts with)."""
    if any(base.get(var) for var in OPERATOR_VARS):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}
