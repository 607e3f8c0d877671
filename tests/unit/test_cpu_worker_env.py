"""A CPU worker's OpenMP threads sleep between ops unless the operator chose otherwise
(appliance/worker/cpu_env.py: spinning threads starved the daemon and a 2-thread agg
worker collapsed on a loaded 2-core box)."""
from appliance.daemon.workers import worker_env
from appliance.worker.spec import WorkerSpec


def _cpu(threads: int) -> WorkerSpec:
    return WorkerSpec(worker="agg0", role="agg", engine="torch", devices=["cpu0"],
                      device_kind="cpu", model_dir="/m", cpu_cores=[0, 1], cpu_threads=threads)


def test_cpu_worker_waits_passively_by_default():
    env = worker_env(_cpu(2), {"HOME": "/root"})
    assert env == {"HOME": "/root", "OMP_WAIT_POLICY": "PASSIVE"}


def test_operator_wait_policy_or_spin_count_is_kept():
    assert worker_env(_cpu(2), {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    env = worker_env(_cpu(2), {"GOMP_SPINCOUNT": "10000"})
    assert env == {"GOMP_SPINCOUNT": "10000"}          # their spin count alone decides
    # an empty value is libgomp's "invalid, use the default": not a choice to keep
    assert worker_env(_cpu(2), {"OMP_WAIT_POLICY": ""})["OMP_WAIT_POLICY"] == "PASSIVE"


def test_gpu_worker_gets_no_wait_policy():
    gpu = WorkerSpec(worker="decode0", role="decode", engine="torch", devices=["gpu0"],
                     device_kind="gpu", model_dir="/m", device_uuids=["GPU-a"])
    assert "OMP_WAIT_POLICY" not in worker_env(gpu, {})
