"""A long CPU prefill step runs its dense MLP `MLP_ROWS` rows at a time (so its gate/up
output stays in the caches): the multiplies see slices of at most that many rows, and
the result is bit for bit what one pass over every row gives, in fp32 and bf16, for the
MLP alone and for a whole forward (greedy token and logits) of a prompt longer than a
slice."""
from __future__ import annotations

import pytest
import torch

from appliance.engines.layers.attention import AttnBatch
from appliance.engines.layers.linear import Linear
from appliance.engines.loader import load_model
from appliance.engines.models import llama
from appliance.engines.models.llama import DenseMLP

torch.set_num_threads(1)


class RecordingLinear(Linear):
    """The engine's own Linear, noting how many rows each call multiplies."""

    __slots__ = ("rows",)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return super().__call__(x)


def mlp(dtype: torch.dtype, hidden: int = 64, inter: int = 96) -> DenseMLP:
    g = torch.Generator().manual_seed(0)
    return DenseMLP(RecordingLinear((torch.randn(2 * inter, hidden, generator=g) * 0.1).to(dtype)),
                    RecordingLinear((torch.randn(hidden, inter, generator=g) * 0.1).to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_steps_run_the_mlp_in_slices_with_the_same_result(monkeypatch, dtype):
    monkeypatch.setattr(llama, "MLP_ROWS", 32)
    m = mlp(dtype)
    x = torch.randn(32 * 3 + 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = m(x)
    assert m.gate_up.rows == [32, 32, 32, 5] and m.down.rows == [32, 32, 32, 5]
    m.gate_up.rows.clear()
    monkeypatch.setattr(llama, "MLP_ROWS", 1 << 20)       # one pass over every row
    want = m(x)
    assert m.gate_up.rows == [x.shape[0]]
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


def test_short_steps_are_one_pass(monkeypatch):
    monkeypatch.setattr(llama, "MLP_ROWS", 32)
    m = mlp(torch.float32)
    m(torch.randn(32, 64))
    assert m.gate_up.rows == [32]


def test_a_prompt_longer_than_a_slice_gives_the_same_logits(monkeypatch, tiny_model):
    model = load_model(tiny_model, device=torch.device("cpu"), dtype=torch.float32)
    s = model.shape
    n, bs = 300, 16
    blocks = -(-n // bs)
    kv = torch.zeros((2, s.num_layers, blocks, bs, s.num_kv_heads, s.head_dim))
    ids = torch.randint(3, s.vocab_size, (n,), generator=torch.Generator().manual_seed(2))

    def forward() -> torch.Tensor:
        batch = AttnBatch(True, [n], [n], [list(range(blocks))], torch.arange(n))
        return model(ids, torch.arange(n), batch, kv.zero_())

    monkeypatch.setattr(llama, "MLP_ROWS", 1 << 20)
    whole = forward()
    monkeypatch.setattr(llama, "MLP_ROWS", 64)            # 300 rows: five slices
    sliced = forward()
    assert torch.equal(sliced, whole)
    assert int(sliced.argmax()) == int(whole.argmax())
