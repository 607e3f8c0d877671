"""`[engine] compile` and the decode step's glue (`layers.glue`): the eager glue is the
forward's own arithmetic, a bad mode is refused, and where inductor cannot build (no C++
compiler) the engine says so in one line and runs eager. Compiled glue against eager:
tests/integration/test_decode_compile.py (inductor runs a compiler subprocess)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance import config
from appliance.engines.layers import glue
from appliance.engines.loader import load_model
from appliance.engines.torch_engine import TorchEngine


def test_eager_glue_is_add_then_rms_norm():
    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    w = torch.randn(32, generator=g)
    new_h, x = glue.eager_glue().add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(new_h, h + d)
    assert torch.equal(x, F.rms_norm(h + d, (32,), w, 1e-5))
    assert torch.equal(glue.eager_glue().rms_norm(h, w, 1e-6), F.rms_norm(h, (32,), w, 1e-6))


def test_no_compiler_means_one_line_and_eager(monkeypatch, capsys):
    monkeypatch.setattr(glue, "compiler_missing", lambda: "no C++ compiler found (test)")
    out = glue.compile_glue(torch.device("cpu"), torch.float32, 16, 1e-5, worker="w0")
    assert out.compiled is False
    assert out.add_rms_norm is glue.eager_glue().add_rms_norm
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['applianced worker w0: engine.compile = "decode" unavailable '
                   '(no C++ compiler found (test)): running eager']


def test_compiler_missing_reads_the_path(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert glue.compiler_missing() is not None
    monkeypatch.setenv("CXX", "/bin/sh")     # any executable named by $CXX counts
    assert glue.compiler_missing() is None


def test_engine_without_compiler_serves_eager(tiny_model, monkeypatch):
    monkeypatch.setattr(glue, "compiler_missing", lambda: "no C++ compiler found (test)")
    model = load_model(tiny_model)
    eng = TorchEngine(model=model, worker="w", devices=("cpu",), num_blocks=32, block_size=16,
                      max_batch_tokens=512, max_seqs=4, max_context=256, eos_token_ids=(),
                      share_pool=False)
    eng.set_compile("decode")
    assert model.decode_glue.compiled is False
    with pytest.raises(ValueError, match="engine.compile must be one of off, decode"):
        eng.set_compile("fast")


def test_config_refuses_an_unknown_compile_mode():
    assert config.parse('[engine]\ncompile = "decode"\n').engine.compile == "decode"
    assert config.parse("").engine.compile == "off"
    with pytest.raises(config.ConfigError, match="engine.compile must be off or decode"):
        config.parse('[engine]\ncompile = "max"\n')
