"""When a decode worker's matmuls may borrow another core: the gate around each step.

On a 2-core box the decode worker streams every weight once a step on its one core, at
that core's memory bandwidth, while the prefill worker's core idles between prompts
(measured on an AMX host at c = 8: prefill ~35% busy, decode 100%). `linear_bf16.c`'s
helper thread, pinned to that core, shares each matmul's weight groups while a step runs;
on that host both cores read ~1.8× what one does. But a helper that competes with the
prompts for their core slows them, and a helper held up mid-group delays the step: so
the gate watches the helper's time waiting for its core (the kernel's schedstat for the
thread, in ns), and after a step in which it waited more than `BUSY_WAIT_NS` it keeps the
helper asleep, trying again after `PROBE_STEPS` steps, doubling up to `MAX_PROBE_STEPS`
while the core stays busy.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HelperGate"]

BUSY_WAIT_NS = 2_000_000    # run-queue wait in one step that says the core is taken
PROBE_STEPS = 8             # steps without the helper before trying it again
MAX_PROBE_STEPS = 128


@dataclass
class HelperStats:
    steps_with: int = 0     # steps the helper took part in
    steps_without: int = 0  # steps it sat out (its core was busy)
    turned_off: int = 0     # times a step found its core busy


class HelperGate:
    """`begin()` before a step's forward, `end()` after it (`TorchEngine.run_batch`).

    While on, the helper polls between steps (it sleeps by itself after a few idle
    milliseconds), so its run-queue wait during a step is time the core's owner took; a
    step in which it had to be woken first is not judged (the wake-up shows as wait)."""

    def __init__(self, kernel, cpu: int) -> None:
        self.kernel = kernel
        self.cpu = cpu
        self.stats = HelperStats()
        self._judge = False             # this step's wait says whether the core is busy
        self._in_step = False
        self._wait_before = 0
        self._skip = 0                  # steps left to sit out
        self._backoff = PROBE_STEPS
        self._path = ""

    def _waited_ns(self) -> int | None:
        """The helper thread's total run-queue wait (ns), None while it is unknown."""
        if not self._path:
            tid = self.kernel.helper_tid()
            if not tid:
                return None
            self._path = f"/proc/self/task/{tid}/schedstat"
        try:
            with open(self._path, "rb") as f:
                return int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def begin(self) -> None:
        if self._skip:
            self._skip -= 1
            self.stats.steps_without += 1
            return
        woke = self.kernel.helper_spin(True)
        before = self._waited_ns()
        self._in_step = True
        self._judge = not woke and before is not None
        self._wait_before = before or 0
        self.stats.steps_with += 1

    def end(self) -> None:
        if not self._in_step:
            return
        self._in_step = False
        if not self._judge:
            return
        waited = self._waited_ns()
        if waited is None or waited - self._wait_before > BUSY_WAIT_NS:
            self.kernel.helper_spin(False)
            self.stats.turned_off += 1
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_PROBE_STEPS)
        else:
            self._backoff = PROBE_STEPS
