"""Keep a CPU worker's freed scratch memory mapped, so each step does not page-fault it in.

Every forward pass allocates and frees the same large temporaries (the gathered K/V of a
decode batch, a prefill's activations). With glibc's defaults, blocks from 128 KiB up
are served by ``mmap`` (the dynamic threshold only grows when such a block is freed) and
freed heap tops are returned to the kernel once 128 KiB sit unused. Either way the next
step touches fresh pages, and every 4 KiB page costs a fault: measured on the dev VM, a
decode step of 32 sequences at 600 tokens of context on the 20m model took 57,500 faults
and 226 ms; with the settings below, 0 faults and 90 ms. A 2,048-token prefill went
from 1,366 to 1,234 ms.

The price is resident memory: up to ``TRIM_THRESHOLD`` of freed heap stays with the
worker process instead of going back to the system. Blocks larger than
``MMAP_THRESHOLD`` (glibc's ceiling on 64-bit) are still mapped per use, which is why the
model also keeps its decode gather buffers between steps.

A worker's KV pool is the other memory its steps would fault in: reserved at start, its
pages are only committed as blocks are first written, and the block manager hands out the
longest-free block first (to keep prefix-cache entries), so a fresh worker writes to a new
block on every allocation until it has gone through the whole pool. `PoolPopulator` faults
the pool in behind the worker's back instead (see there).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20   # the largest value glibc accepts on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_done: bool | None = None


def _malloc_function(name: str, argtypes: tuple):
    """glibc's malloc tunable `name` (`mallopt`, `malloc_trim`), typed; None off Linux or
    where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse freed memory rather than unmap it (once per process).

    Returns whether the settings took effect; False (and nothing changed) where the C
    library is not glibc or refuses a value.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    mallopt = _malloc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        log.debug("no mallopt in this C library; heap left at its defaults")
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    ))
    if not ok:
        log.warning("mallopt refused a setting; CPU steps may page-fault their scratch memory")
    _done = ok
    return ok


def release_freed() -> bool:
    """Give the heap's free pages back to the system, once a worker's model is loaded.

    Why: with `keep_freed_memory` the freed heap stays with the process, and a load frees
    about as much as it keeps: each weight as read, then cast or packed into the layout its
    kernel reads. Every matrix under ``MMAP_THRESHOLD`` lives on the heap, so those copies
    stay resident for the worker's life. Measured on a Qwen3-MoE checkpoint of 0.93B
    parameters in bf16 (3,072 expert matrices of 0.4-0.8 MB): a decode worker held 4.3 GB
    of anonymous memory after its load where its tensors held 1.9 GB, and two such servers
    beside vLLM on a 24 GiB box had their decode workers killed for memory; after
    ``malloc_trim(0)`` it held 2.05 GB. The steps' own scratch is allocated after this,
    and stays kept as before. Returns whether glibc released anything (False where the C
    library is not glibc)."""
    trim = _malloc_function("malloc_trim", (ctypes.c_size_t,))
    return trim is not None and trim(0) == 1


_MADV_POPULATE_WRITE = 23     # <linux/mman.h>, Linux 5.14+


class PoolPopulator:
    """Faults a CPU KV pool's pages in from a thread at SCHED_IDLE, after the worker starts.

    Why: until then each block a fresh worker writes for the first time page-faults, and
    on a decode worker's huge-page pool every 2 MB fault zeroes the page. Measured on the
    dev VM (a Firecracker guest, where the host backs guest memory as it is first
    touched): faulting in a 1 GiB huge-page pool took 9 s of CPU, 1.3-9.5 s a GiB across
    runs, the shared-memory pool of a prefill worker 0.4 s; under load at 32 clients
    that was 8-12% of the decode worker's CPU (`perf`: `clear_page_erms`) for as long as
    the pool's first round lasted. Done at start it would add those seconds to every
    worker's start; at SCHED_IDLE it takes only time the worker's core would idle.

    `madvise(MADV_POPULATE_WRITE)` faults pages in writable without touching what they
    hold, so the worker may write blocks meanwhile. A few MB a call: the call holds the
    process's memory-map lock, which an allocation that maps memory waits for. The thread
    never holds the pool: it stops at the next call once the pool is freed (or the
    interpreter exits), and stops quietly where the kernel lacks the advice (before 5.14):
    pages then fault as before. Holding it, even for the length of a call, made the thread
    the one to free a pool its worker had dropped. Freeing a tensor over an `mmap`
    releases the GIL and takes it again to give the buffer back; a thread that takes the
    GIL while the interpreter finalizes is made to exit, here inside a C++ destructor, and
    the process aborted (SIGABRT at exit, seen with several engines in one process). A
    call over a range freed meanwhile only fails (ENOMEM) or prefaults pages that are not
    the pool's: the advice never changes what a page holds.
    """

    CHUNK = 4 << 20

    def __init__(self, pool: torch.Tensor):
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        start = pool.data_ptr()
        self._first = -(-start // page) * page                 # whole pages only
        self._end = (start + pool.numel() * pool.element_size()) // page * page
        self._freed = threading.Event()
        # (called where the pool's last reference goes, or at exit: never in the thread)
        weakref.finalize(pool, self._freed.set)
        self.done = 0                  # bytes faulted in so far
        self.cpu_s = 0.0               # the thread's CPU time
        self.error: str | None = None  # why it stopped early (None: it has not)
        self.finished = threading.Event()
        threading.Thread(target=self._run, name="kv-pool-populate", daemon=True).start()

    @property
    def share(self) -> float:
        """How much of the pool is faulted in, 0 to 1."""
        total = self._end - self._first
        return 1.0 if total <= 0 else min(1.0, self.done / total)

    def _run(self) -> None:
        try:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # this thread
            except (AttributeError, OSError):
                pass            # (no SCHED_IDLE here: it runs at the worker's priority)
            madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                  use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            madvise.restype = ctypes.c_int
            for at in range(self._first, self._end, self.CHUNK):
                if self._freed.is_set():
                    self.error = "the pool was freed"
                    return
                span = min(self.CHUNK, self._end - at)
                if madvise(at, span, _MADV_POPULATE_WRITE) != 0:
                    self.error = ("the pool was freed" if self._freed.is_set()
                                  else os.strerror(ctypes.get_errno()))
                    return
                self.done += span
        except OSError as exc:        # no C library to call
            self.error = str(exc)
        finally:
            self.cpu_s = time.thread_time()
            self.finished.set()
