"""When a decode worker's matmuls may borrow another core: the gate around each step.

On a 2-core box the decode worker streams every weight once a step on its one core, at
that core's memory bandwidth, while the prefill worker's core idles between prompts
(measured on an AMX host at c = 8: prefill ~40% busy, decode 100%). `linear_bf16.c`'s
helper thread, pinned to that core, shares each matmul's weight groups while a step runs;
on that host both cores read ~1.8x what one does. But a helper that competes with the
prompts for their core slows them, and a helper held up mid-group delays the step. So
before each step the gate looks at the core's owner (the lending worker, a sibling
process: running or not, from /proc/PID/stat) and lends the step to the helper only while
the owner sleeps; and after each step it reads the helper's own time spent waiting for
its core (/proc/self/task/TID/schedstat): a step in which it waited more than
`BUSY_WAIT_NS` while the lender sleeps (something else took the core) sends it to sleep
for `PROBE_STEPS` steps, doubling up to `MAX_PROBE_STEPS` while that goes on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["HelperGate", "sibling_pid"]

BUSY_WAIT_NS = 2_000_000    # run-queue wait in one step that says the core is taken
PROBE_STEPS = 8             # steps without the helper before trying it again
MAX_PROBE_STEPS = 128
FIND_EVERY = 256            # steps between looks for a lender not found (not started yet)


@dataclass
class HelperStats:
    steps_with: int = 0     # steps the helper took part in
    owner_busy: int = 0     # steps it sat out because the lender was running
    steps_without: int = 0  # steps it sat out after waiting for its core
    turned_off: int = 0     # times a step found it waiting for its core


def sibling_pid(worker: str) -> int | None:
    """The pid of the daemon's worker process `worker`: a process with our parent whose
    command line carries that worker's spec."""
    parent = os.getppid()
    needle = f'"worker":"{worker}"'.encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read():
                    return int(name)
        except (OSError, ValueError, IndexError):
            continue
    return None


class HelperGate:
    """`begin()` before a step's forward, `end()` after it (`TorchEngine.run_batch`).

    While on, the helper polls between steps (it sleeps by itself after a few idle
    milliseconds), so its run-queue wait during a step is time something else took on
    its core; a step in which it had to be woken first is not judged (the wake-up shows
    as wait)."""

    def __init__(self, kernel, cpu: int, lender: str = "") -> None:
        self.kernel = kernel
        self.cpu = cpu
        self.lender = lender
        self.stats = HelperStats()
        self._judge = False             # this step's wait says whether the core is busy
        self._in_step = False
        self._wait_before = 0
        self._skip = 0                  # steps left to sit out
        self._backoff = PROBE_STEPS
        self._path = ""
        self._lender_stat = ""          # /proc/PID/stat of the lender, once found
        self._find_in = 0

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

    def lender_running(self) -> bool:
        """Whether the lending worker is running or runnable now (False when unknown)."""
        if not self.lender:
            return False
        if not self._lender_stat:
            if self._find_in:
                self._find_in -= 1
                return False
            pid = sibling_pid(self.lender)
            if pid is None:
                self._find_in = FIND_EVERY
                return False
            self._lender_stat = f"/proc/{pid}/stat"
        try:
            with open(self._lender_stat, "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
        except (OSError, IndexError):
            self._lender_stat = ""      # gone (restarted): look for it again
            return False

    def begin(self) -> None:
        if self._skip:
            self._skip -= 1
            self.stats.steps_without += 1
            return
        if self.lender_running():
            self.kernel.helper_spin(False)
            self.stats.owner_busy += 1
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
            if self._lender_stat and self.lender_running():
                return                  # the lender woke: `begin` sees to it step by step
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_PROBE_STEPS)
        else:
            self._backoff = PROBE_STEPS
