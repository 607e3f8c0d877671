"""Where the daemon's own threads run on a CPU box: off its CPU decode workers' cores.

On a box whose workers are pinned one per core set (`setup.cpu_core_sets`), the daemon
(HTTP, tokenizing, streaming, the accounting process) runs wherever the kernel puts it,
and every token a decode worker sends wakes the daemon, which then preempts whatever runs
on that core: often the decode worker itself, which every decoding sequence waits on.
Measured on the 2-core benchmark host (docs/benchmarks.md, session 25): a decode worker's
`sendall` of ~300 bytes took 160-380 us on average (the daemon's turn on its core), 40-47
us with the daemon kept to the prefill worker's core; the ITL at 32 clients fell ~25% at
the same request rate. A prompt step absorbs the daemon's slices as a little TTFT; a
decode step makes every sequence wait for them.

So with `engine.daemon_cores = "auto"`, once the CPU decode workers are known, every thread
of the daemon and its helper processes (the accounting process, the tokenizer pool) is
kept to the allowed cores that no CPU decode worker is pinned to, when there are any. The
workers pin themselves (`worker.main.pin`); a worker's affinity is not bounded by its
parent's, only by the cpuset. GPU boxes are left alone (not measured there).
"""
from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger("applianced")

_original: list[int] | None = None   # this process's cores before it narrowed them


def allowed_cores() -> list[int]:
    """The CPU ids this process may run on (its cpuset / affinity) as it started: workers
    are pinned within these even after the daemon kept itself to fewer."""
    if _original is not None:
        return list(_original)
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def daemon_cores(specs, allowed: list[int]) -> list[int] | None:
    """The cores the daemon keeps to: `allowed` minus every torch decode worker's, when all
    workers are pinned CPU workers and that leaves some; None: run anywhere. (The
    simulator's workers sleep through their steps: there the daemon is the bound.)"""
    if not specs or not all(s.device_kind == "cpu" and s.cpu_cores for s in specs):
        return None
    decode = {c for s in specs if s.role == "decode" and s.engine == "torch"
              for c in s.cpu_cores}
    rest = [c for c in allowed if c not in decode]
    return rest if decode and rest else None


def _set(pid: int, cores: list[int]) -> bool:
    try:
        os.sched_setaffinity(pid, cores)
        return True
    except (OSError, ValueError):   # a thread or process that ended meanwhile
        return False


def keep_daemon_to(cores: list[int], worker_pids: set[int]) -> int:
    """Every thread of this process, and every process below it that is not a worker (or
    a worker's child), to `cores`. Returns how many threads and processes were set.
    Idempotent: call it again when workers change (threads inherit their creator's
    affinity; processes started later inherit the daemon's)."""
    global _original
    if _original is None:
        _original = allowed_cores()
    done = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        done += _set(tid, cores)
    try:
        me = psutil.Process()
        children = me.children()
    except psutil.Error:
        return done
    for child in children:
        if child.pid in worker_pids:
            continue
        try:
            family = [child] + child.children(recursive=True)
        except psutil.Error:
            continue
        for proc in family:
            try:
                threads = [t.id for t in proc.threads()]
            except psutil.Error:
                continue
            for tid in threads:
                done += _set(tid, cores)
    return done


class DaemonAffinity:
    """`engine.daemon_cores` applied: `update(specs, pids)` whenever the workers change
    (start-up, a restart, a repartition); a no-op while the cores it would pick stay the
    same and no new helper process appeared."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.cores: list[int] | None = None

    def update(self, specs, worker_pids: set[int]) -> list[int] | None:
        if self.setting != "auto":
            return None
        cores = daemon_cores(list(specs), allowed_cores())
        if cores is None:
            if self.cores is not None:      # decode workers moved away: anywhere again
                keep_daemon_to(allowed_cores(), worker_pids)
                log.info("daemon threads: any of cores %s", allowed_cores())
            self.cores = None
            return None
        keep_daemon_to(cores, worker_pids)
        if cores != self.cores:
            log.info("daemon threads kept to cores %s (off the CPU decode workers')", cores)
        self.cores = cores
        return cores
