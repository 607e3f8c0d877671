"""The daemon starts its CPU workers with OpenMP's passive wait policy (spinning threads
made one 2-thread agg worker collapse on a loaded 2-core box; appliance/worker/cpu_env.py),
and a worker whose environment the operator gave a policy keeps theirs."""
from __future__ import annotations

import psutil

from helpers.daemons import start_daemon

AGG_2_THREADS = '[devices]\nmode = "agg"\n[engine]\ncpu_threads = 2\n'


def _policies(d) -> dict[str, str | None]:
    out = {}
    for w in d.status()["workers"]:
        env = psutil.Process(w["pid"]).environ()
        out[w["worker"]] = env.get("OMP_WAIT_POLICY")
    return out


def test_cpu_workers_wait_passively_and_serve(tiny_model, tmp_path):
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "torch",
                     config=AGG_2_THREADS)
    try:
        assert set(_policies(d).values()) == {"PASSIVE"} and _policies(d)
        assert all(w["worker"].startswith("agg") for w in d.status()["workers"])   # 2 threads each
        out = d.client().completions.create(model=d.status()["model"],
                                            prompt="hello", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
    finally:
        d.stop()


def test_an_operator_policy_is_kept(tiny_model, tmp_path):
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "torch",
                     config=AGG_2_THREADS, env={"OMP_WAIT_POLICY": "ACTIVE"})
    try:
        assert set(_policies(d).values()) == {"ACTIVE"}
    finally:
        d.stop()
