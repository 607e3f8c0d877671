"""`[engine] cpu_kernels`: checked when the config is read, and handed to every worker's
spec (the kernel itself is built and tested in tests/integration/test_cpu_kernels.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config import Config, ConfigError, parse
from appliance.daemon.setup import worker_specs
from appliance.partitions import Device, Inventory, plan_partition
from appliance.worker.spec import WorkerSpec


def _cpu_box() -> Inventory:
    return Inventory((Device("cpu0", "cpu", "cpu", False, 0, None),), {}, "cpu", None)


@pytest.mark.parametrize("text, want", [("", "auto"), ('cpu_kernels = "off"', "off"),
                                        ('cpu_kernels = "auto"', "auto")])
def test_the_setting_reaches_every_worker(text, want):
    cfg = parse(f"[engine]\n{text}\n")
    assert cfg.engine.cpu_kernels == want
    inv = _cpu_box()
    specs = worker_specs(cfg, inv, plan_partition(inv), "torch", Path("/m"), [0, 1])
    assert [s.role for s in specs] == ["prefill", "decode"]
    assert {s.cpu_kernels for s in specs} == {want}
    # through the process boundary as it goes (JSON on the worker's command line)
    assert WorkerSpec.from_json(specs[1].to_json()).cpu_kernels == want


def test_a_bad_value_is_one_clear_error():
    with pytest.raises(ConfigError, match="engine.cpu_kernels must be auto or off, got 'on'"):
        parse('[engine]\ncpu_kernels = "on"\n')
    # a spec made outside the daemon (benches, tests) stays on torch's path unless asked
    assert WorkerSpec(worker="w", role="decode", engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir="/m").cpu_kernels == "off"
    assert Config().engine.cpu_kernels == "auto"


def test_the_decode_helper_setting_is_checked():
    assert Config().engine.cpu_decode_helper == "auto"
    assert parse('[engine]\ncpu_decode_helper = "off"\n').engine.cpu_decode_helper == "off"
    assert parse('[engine]\ncpu_decode_helper = "on"\n').engine.cpu_decode_helper == "on"
    with pytest.raises(ConfigError,
                       match="engine.cpu_decode_helper must be auto, on or off, got 'yes'"):
        parse('[engine]\ncpu_decode_helper = "yes"\n')
