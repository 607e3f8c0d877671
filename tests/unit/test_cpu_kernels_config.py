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


def test_the_ride_rows_setting_reaches_the_decode_worker_that_can_ride():
    """`engine.cpu_decode_ride_rows`: checked when read, carried in every spec; a worker
    rides only as a decode worker whose decode steps run in one C call (auto: the matmul
    kernel's 8 rows, on a CPU without AMX)."""
    from types import SimpleNamespace

    from appliance.engines.torch_engine import AUTO_RIDE_ROWS, decode_ride_rows
    assert Config().engine.cpu_decode_ride_rows == -1
    with pytest.raises(ConfigError, match="engine.cpu_decode_ride_rows must be -1 .auto., "
                                          "0 .off. or positive, got -2"):
        parse("[engine]\ncpu_decode_ride_rows = -2\n")
    cfg = parse("[engine]\ncpu_decode_ride_rows = 6\n")
    inv = _cpu_box()
    specs = worker_specs(cfg, inv, plan_partition(inv), "torch", Path("/m"), [0, 1])
    assert WorkerSpec.from_json(specs[1].to_json()).cpu_decode_ride_rows == 6
    one_call, layered = SimpleNamespace(decode_layers=object()), SimpleNamespace(decode_layers=None)
    assert decode_ride_rows(-1, "decode", one_call) == AUTO_RIDE_ROWS == 8
    assert decode_ride_rows(6, "decode", one_call) == 6
    assert decode_ride_rows(0, "decode", one_call) == 0
    assert decode_ride_rows(-1, "decode", layered) == 0      # mixed steps layer by layer
    assert decode_ride_rows(-1, "prefill", one_call) == 0
    assert decode_ride_rows(-1, "agg", one_call) == 0
    # auto leaves it off where AMX runs the prompts; a number asks for it anyway
    assert decode_ride_rows(-1, "decode", one_call, amx=True) == 0
    assert decode_ride_rows(6, "decode", one_call, amx=True) == 6
