"""A mixture of experts' SwiGLU experts in one C call (`cpu_kernels.MoeExperts`,
moe_experts.c; `MoeExpertsF32` on a CPU without AVX-512): built here with the host's
compiler (a subprocess, hence an integration test), the numbers of `SparseMoE`'s Python
loop through the same kernels bit for bit, within bf16 of torch's own path, what it
refuses, and which workers run their MoE layers through it."""
from __future__ import annotations

import pytest
import torch

from appliance.engines import cpu_kernels, dtypes
from appliance.engines.cpu_kernels import builder as kernel_build
from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.layers.linear import Linear
from appliance.engines.layers.moe import Router, SparseMoE, clamped_swiglu, swiglu
from appliance.engines.torch_engine import build_torch_engine
from appliance.worker.spec import WorkerSpec

torch.set_num_threads(1)

needs_avx512 = pytest.mark.skipif(
    kernel_build.compiler() is None or "avx512f" not in dtypes.cpu_flags(),
    reason="the bf16 kernels need a C compiler and AVX-512F")
needs_avx2 = pytest.mark.skipif(
    kernel_build.compiler() is None or not {"avx2", "fma"} <= dtypes.cpu_flags(),
    reason="the fp32 kernels need a C compiler, AVX2 and FMA")


def _built(loader, where):
    try:
        return loader(str(where))
    except cpu_kernels.KernelUnavailable as exc:        # no AVX512-BF16 here
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def bf16_kernels(tmp_path_factory):
    where = tmp_path_factory.mktemp("kernels")
    linear = _built(cpu_kernels.load_linear_bf16, where)
    glue = _built(cpu_kernels.load_layer_glue, where)
    moe = _built(cpu_kernels.load_moe_experts, where)
    moe.bind(linear, glue)
    return linear, glue, moe


@pytest.fixture(scope="module")
def f32_kernels(tmp_path_factory):
    where = tmp_path_factory.mktemp("kernels-f32")
    linear = cpu_kernels.load_linear_f32(str(where))
    glue = cpu_kernels.load_layer_glue_f32(str(where))
    moe = cpu_kernels.load_moe_experts_f32(str(where))
    moe.bind(linear, glue)
    return linear, glue, moe


def _moe(dtype, hidden: int, inter: int, experts: int, k: int, *, fp32_weights: bool,
         seed: int = 0) -> SparseMoE:
    """Random experts; `fp32_weights`: the routing weights kept in fp32 (Mixtral), else
    cast to the activations' dtype (Qwen3-MoE)."""
    g = torch.Generator().manual_seed(seed)

    def w(o, i):
        return (torch.randn(o, i, generator=g) * 0.1).to(dtype)
    router = Router(Linear(w(experts, hidden)), k, renormalize=True,
                    weights_in_input_dtype=not fp32_weights)
    return SparseMoE(router, [Linear(w(2 * inter, hidden)) for _ in range(experts)],
                     [Linear(w(hidden, inter)) for _ in range(experts)])


def _glue_act(glue):
    """SwiGLU's activation through the glue kernel, as the one call computes it (torch's
    `silu` then `mul_`, its exp within an ulp of torch's)."""
    return lambda gate, up: glue.silu_mul(torch.cat([gate, up], dim=-1))


def _one_call_equals_the_loop(kernels, dtype, fp32_weights: bool, rows: int, experts: int):
    linear, glue, moe_kernel = kernels
    moe = _moe(dtype, 96, 40, experts, 2, fp32_weights=fp32_weights, seed=rows)
    for lin in moe.gate_up + moe.down:
        assert lin.use_kernel(linear)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
    moe.act = _glue_act(glue)
    want = moe(x)                               # Python's loop over the experts
    assert not moe.use_kernel(moe_kernel)       # an activation it does not compute
    moe.act = swiglu
    calls = []
    fn = moe_kernel._fn
    moe_kernel._fn = lambda *a: calls.append(1) or fn(*a)
    try:
        assert moe.use_kernel(moe_kernel)
        got = moe(x)
    finally:
        moe_kernel._fn = fn
    assert calls == [1]
    assert got.dtype == dtype and torch.equal(got, want)
    return moe, x, got


# rows: a decode step's few, and a prompt's many with few experts, so that one expert has
# more rows than one matmul call takes (moe_experts.c's MOE_CHUNK, 128)
@needs_avx512
@pytest.mark.parametrize("rows,experts", [(1, 8), (5, 8), (300, 3)])
@pytest.mark.parametrize("fp32_weights", [False, True], ids=["qwen3-moe", "mixtral"])
def test_bf16_experts_in_one_call_equal_the_loop_through_the_same_kernels(
        bf16_kernels, rows, experts, fp32_weights):
    _one_call_equals_the_loop(bf16_kernels, torch.bfloat16, fp32_weights, rows, experts)


@needs_avx2
@pytest.mark.parametrize("rows,experts", [(1, 8), (5, 8), (300, 3)])
@pytest.mark.parametrize("fp32_weights", [False, True], ids=["qwen3-moe", "mixtral"])
def test_fp32_experts_in_one_call_equal_the_loop_through_the_same_kernels(
        f32_kernels, rows, experts, fp32_weights):
    _one_call_equals_the_loop(f32_kernels, torch.float32, fp32_weights, rows, experts)


@needs_avx512
@pytest.mark.parametrize("rows", [1, 6, 64])
def test_bf16_experts_in_one_call_are_within_bf16_of_torchs_own_path(bf16_kernels, rows):
    """Against oneDNN's matmuls and torch's activation (what a worker without the kernels
    runs): the same tokens' outputs within bf16's rounding of a few roundings apart."""
    linear, _, moe_kernel = bf16_kernels
    moe = _moe(torch.bfloat16, 128, 64, 16, 4, fp32_weights=False, seed=rows)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = moe(x).float()
    for lin in moe.gate_up + moe.down:
        lin.use_kernel(linear)
    assert moe.use_kernel(moe_kernel)
    got = moe(x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert (got - want).abs().mean() <= 0.002 * want.abs().mean() + 1e-6


@needs_avx512
def test_the_one_call_refuses_what_it_does_not_take(bf16_kernels):
    linear, _, moe_kernel = bf16_kernels
    moe = _moe(torch.bfloat16, 64, 32, 4, 2, fp32_weights=False)
    assert not moe.use_kernel(moe_kernel)       # experts still on oneDNN
    for lin in moe.gate_up + moe.down:
        lin.use_kernel(linear)
    biased = SparseMoE(moe.router, [Linear(g.dense(), torch.zeros(g.rows, dtype=torch.bfloat16))
                                    for g in moe.gate_up], moe.down)
    for lin in biased.gate_up:
        lin.use_kernel(linear)
    assert not biased.use_kernel(moe_kernel)    # gpt-oss's experts have biases
    clamped = SparseMoE(moe.router, moe.gate_up, moe.down, act=clamped_swiglu(7.0, 1.702))
    assert not clamped.use_kernel(moe_kernel)
    assert moe.kernel is None and moe.use_kernel(moe_kernel)
    gate_up, down, inter = moe._packed
    x = torch.randn(3, 64).bfloat16()
    weights = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="expert id out of range"):
        moe_kernel(gate_up, down, 64, inter, x, weights, torch.tensor([[0, 1], [2, 4], [3, 0]]))
    with pytest.raises(ValueError, match="x must be CPU"):
        moe_kernel(gate_up, down, 64, inter, x.float(), weights, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        moe_kernel(gate_up, down, 64, inter, x, weights[:2], torch.zeros(3, 2, dtype=torch.long))
    assert moe.use_kernel(None) and moe.kernel is None
    assert torch.equal(moe(x), moe(x))          # the loop again, on the kernel's matmuls


def _qwen3_moe_checkpoint(path, transformers):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _logits(model, prompt: list[int], follow: list[int]) -> list[torch.Tensor]:
    """A prefill, then a decode step for each token of `follow`, through `model`'s
    forward; every step's logits."""
    block = 16
    blocks = -(-(len(prompt) + len(follow)) // block)
    kv = allocate_kv_pool(model.shape, blocks, block, dtype=model.dtype)
    table = list(range(blocks))
    n = len(prompt)
    batch = AttnBatch(True, [n], [n], [table], torch.arange(n))
    out = [model(torch.tensor(prompt), torch.arange(n), batch, kv)]
    for s, token in enumerate(follow):
        pos = n + s
        batch = AttnBatch(False, [1], [pos + 1], [table], torch.tensor([pos]))
        out.append(model(torch.tensor([token]), torch.tensor([pos]), batch, kv))
    return out


@needs_avx512
def test_a_bf16_worker_runs_its_moe_layers_in_one_call(bf16_kernels, tmp_path, monkeypatch):
    """A bf16 decode worker and a prefill worker without AMX put a Qwen3-MoE's experts on
    the matmul kernel and each MoE layer through the one call; a prefill and four decode
    steps of the same tokens give logits within bf16 of the same checkpoint on torch's
    path (`cpu_kernels = "off"`)."""
    transformers = pytest.importorskip("transformers")
    ckpt = _qwen3_moe_checkpoint(tmp_path / "qwen3-moe", transformers)
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512f", "avx512_bf16"}))

    def spec(role: str, kernels: str) -> WorkerSpec:
        return WorkerSpec(worker=f"{role}0", role=role, engine="torch", devices=["cpu"],
                          device_kind="cpu", model_dir=str(ckpt), block_size=16,
                          kv_cache_bytes=8 << 20, max_batch_tokens=256, dtype="bfloat16",
                          cpu_kernels=kernels, kernel_dir=str(tmp_path / "k"))
    plain = build_torch_engine(spec("decode", "off"), ckpt).model
    assert all(layer.mlp.kernel is None for layer in plain.layers)
    prompt = [(7 * i + 3) % 300 for i in range(40)]
    follow = [5, 77, 123, 250]
    want = _logits(plain, prompt, follow)
    for role in ("decode", "prefill"):
        model = build_torch_engine(spec(role, "auto"), ckpt).model
        moes = [layer.mlp for layer in model.layers]
        assert all(isinstance(m, SparseMoE) and m.kernel is not None for m in moes)
        assert all(lin.pairs is not None for m in moes for lin in m.gate_up + m.down)
        for got, ref in zip(_logits(model, prompt, follow), want, strict=True):
            spread = float(ref.max() - ref.min())
            assert float((got - ref).abs().max()) <= 0.03 * spread
    assert "moe_experts" in {p.name.split("-")[0] for p in (tmp_path / "k").iterdir()}
