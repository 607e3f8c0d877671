"""The page through which a prefill worker takes its core back from a decode worker's
helper thread (`engine.cpu_decode_helper`).

The helper (linear_bf16.c) runs on the prefill worker's core at SCHED_IDLE, so a prompt
preempts it at once; preempted inside a weight group, though, it would hold the decode
step up for the whole prompt. So before each of its steps the prefill worker sets a word
in this page and sleeps until no helper is inside a group (well under a millisecond: a
group is a few microseconds of weights, an attention item a few hundred of KV), and the
helpers claim nothing while that word is set. The daemon makes the page (a memfd, gone
with the daemon) and passes it to both workers; each decode worker borrowing the core
has its own slot in it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

__all__ = ["LendPage", "Lender", "PAGE_BYTES", "TAKE_MAX_NS"]

PAGE_BYTES = 4096           # linear_bf16.c's struct lend_page
TAKE_MAX_NS = 3_000_000     # the longest a prompt waits for a helper to leave its group


class LendPage:
    """The page mapped into this process; `address` is what the kernel takes."""

    def __init__(self, fd: int):
        if os.fstat(fd).st_size < PAGE_BYTES:
            raise ValueError(f"the lent core's page (fd {fd}) is smaller than {PAGE_BYTES} bytes")
        self._map = mmap.mmap(fd, PAGE_BYTES)
        self._view = ctypes.c_char.from_buffer(self._map)   # keeps the mapping alive
        self.address = ctypes.addressof(self._view)


@dataclass
class LenderStats:
    takes: int = 0          # steps that took the core back
    waited: int = 0         # of which had to wait for a helper to leave its group
    waited_ns: int = 0      # total wait
    gave_up: int = 0        # waits that ran out (a helper held up by something else; the
                            # words of borrowers that died inside a group are cleared)


class Lender:
    """The prefill worker's side: `take()` before a step, `give()` after it."""

    def __init__(self, kernel, page: LendPage, max_ns: int = TAKE_MAX_NS):
        self.kernel = kernel
        self.page = page
        self.max_ns = max_ns
        self.stats = LenderStats()
        self.give()     # a worker before us may have died holding the core

    def take(self) -> None:
        waited = self.kernel.lender_take(self.page.address, self.max_ns)
        self.stats.takes += 1
        if waited:
            self.stats.waited += 1
            self.stats.waited_ns += self.max_ns if waited < 0 else waited
            self.stats.gave_up += waited < 0

    def give(self) -> None:
        self.kernel.lender_give(self.page.address)
