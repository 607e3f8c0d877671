"""When a decode worker's matmuls may borrow another core: the gate around each step.

On a 2-core box the decode worker streams every weight once a step on its one core, at
that core's memory bandwidth, while the prefill worker's core idles between prompts
(measured on an AMX host at c = 8: prefill ~40% busy, decode 100%). `linear_bf16.c`'s
helper thread, pinned to that core at SCHED_IDLE, shares each matmul's weight groups
(and each layer's attention) while a step runs; on that host both cores read ~1.8x what
one does. At SCHED_IDLE it takes nothing from what else runs there (the prompts, the
daemon, a load generator), and the prefill worker takes its core back at a group's
boundary (`core_lending`). So the gate only spares the helper the steps it would spend
polling for nothing, and guards against a core it cannot get: before each step it looks
at the core's owner (the lending worker, a sibling process: running or not, from
/proc/PID/stat) and lends the step only while the owner sleeps; after the step it asks
the kernel how long a call waited for the helper's groups (the helper preempted inside
one by something that is not the owner, say a process spinning there). A wait over
`HELD_NS` keeps the helper out for `PROBE_STEPS` steps, doubling up to
`MAX_PROBE_STEPS` while that goes on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["HelperGate", "sibling_pid"]

HELD_NS = 8_000_000         # a call's wait for the helper that says the core is taken
PROBE_STEPS = 8             # steps without the helper before trying it again
MAX_PROBE_STEPS = 128
FIND_EVERY = 256            # steps between looks for a lender not found (not started yet)


@dataclass
class HelperStats:
    steps_with: int = 0     # steps the helper took part in
    owner_busy: int = 0     # steps it sat out because the lender was running
    steps_without: int = 0  # steps it sat out after it held a step up
    turned_off: int = 0     # times a step waited for it


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
    """`begin()` before a step's forward, `end()` after it (`TorchEngine.run_batch`)."""

    def __init__(self, kernel, cpu: int, lender: str = "") -> None:
        self.kernel = kernel
        self.cpu = cpu
        self.lender = lender
        self.page = None                # the lender's `core_lending.LendPage`, kept mapped
        self.stats = HelperStats()
        self._in_step = False
        self._skip = 0                  # steps left to sit out
        self._backoff = PROBE_STEPS
        self._lender_stat = ""          # /proc/PID/stat of the lender, once found
        self._find_in = 0

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
        if self.page is None and self.lender_running():
            self.kernel.helper_spin(False)
            self.stats.owner_busy += 1
            return
        self.kernel.helper_spin(True)
        self.kernel.helper_held_ns()    # from this step on
        self._in_step = True
        self.stats.steps_with += 1

    def end(self) -> None:
        if not self._in_step:
            return
        self._in_step = False
        if self.kernel.helper_held_ns() > HELD_NS:
            self.kernel.helper_spin(False)
            self.stats.turned_off += 1
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_PROBE_STEPS)
        else:
            self._backoff = PROBE_STEPS
