"""Helpers never outlive the worker they served: after torch workers are killed again
and again, no torch_shm_manager of a dead worker is left, and handoffs still work."""
from __future__ import annotations

import os
import signal
import time

import psutil

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import start_daemon


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shm_managers_of(pids: set[int]) -> list[psutil.Process]:
    """The torch_shm_manager processes started by these workers (their children)."""
    out = []
    for p in psutil.process_iter(["name", "ppid"]):
        if p.info["name"] == "torch_shm_manager" and p.info["ppid"] in pids:
            out.append(p)
    return out


def test_killed_torch_workers_leave_no_shm_manager_behind(tiny_model, tmp_path):
    tok = ServedTokenizer(tiny_model)
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "torch",
                     config="[workers]\nrestart_backoff_s = 0.1\n")
    try:
        for victim in ("prefill0", "decode0", "prefill0"):       # three crashes in a row
            workers = {w["worker"]: w["pid"] for w in d.status()["workers"]}
            managers = shm_managers_of(set(workers.values()))
            # one per prefill worker: only its pool is shared (a decode worker's is its own)
            assert sorted(m.ppid() for m in managers) == [workers["prefill0"]], managers
            orphan_to_be = [m for m in managers if m.ppid() == workers[victim]]
            assert len(orphan_to_be) == (victim == "prefill0")
            os.kill(workers[victim], signal.SIGKILL)
            d.wait_for(lambda s: all(w["state"] == "ready" and w["pid"] not in (None, workers[victim])
                                     for w in s["workers"]),
                       timeout=90, what=f"{victim} restarted")
            # The peer attached the new pool: a prefill -> decode handoff works.
            r = d.client().completions.create(model="tiny-llama", prompt=tok.encode("Hello"),
                                              max_tokens=4, temperature=0)
            assert r.usage.completion_tokens >= 1
            # The dead worker's manager exits (torch_shm_manager waits 2 s for clients).
            deadline = time.monotonic() + 20
            while any(alive(m) for m in orphan_to_be) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(alive(m) for m in orphan_to_be), (
                f"torch_shm_manager {orphan_to_be[0].pid} of the killed {victim} is still running")
        workers = {w["worker"]: w["pid"] for w in d.status()["workers"]}
        managers = shm_managers_of(set(workers.values()))       # bounded: one per prefill worker
        assert [m.ppid() for m in managers] == [workers["prefill0"]]
    finally:
        d.stop()
