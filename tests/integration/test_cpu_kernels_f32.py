"""The fp32 decode kernels of a CPU without AVX-512 (`cpu_kernels.LinearF32`,
`PagedDecodeF32`): built here with the host's compiler (a subprocess, hence an integration
test), torch's numbers on every shape and window they take, greedy parity with transformers
through them, and which workers use them."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from appliance.engines import cpu_kernels, dtypes
from appliance.engines.cpu_kernels import builder as kernel_build
from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers.attention import AttnBatch, PagedAttention
from appliance.engines.loader import load_model
from appliance.engines.torch_engine import build_torch_engine, dense_linears
from appliance.worker.spec import WorkerSpec
from helpers import bf16_parity
from test_cpu_kernels import CASES as BF16_CASES
from test_cpu_kernels import _shape

torch.set_num_threads(1)

needs_avx2 = pytest.mark.skipif(
    kernel_build.compiler() is None or not {"avx2", "fma"} <= dtypes.cpu_flags(),
    reason="the fp32 kernels need a C compiler, AVX2 and FMA")


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    return cpu_kernels.load_linear_f32(str(tmp_path_factory.mktemp("kernels")))


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    return cpu_kernels.load_paged_decode_f32(str(tmp_path_factory.mktemp("kernels")))


@needs_avx2
@pytest.mark.parametrize("rows,cols", [(1280, 768), (37, 64), (768, 2048), (2, 8), (4, 16),
                                       (20, 12), (33, 520), (9, 777)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernel_matches_torch(linear, rows, cols, bias):
    """Every way a call splits (groups of 1-6 input rows, one group or two sharing the
    prefetches, or more; a last panel of 1-15 columns; a last block of K under 256, odd
    too; at K = 2048 more rows than the input buffer holds, in blocks),
    a strided and a 3-D input: a float64 reference's results within fp32 summation order
    (sums of `cols` unit-scale products: ~1e-7 * sqrt(cols) apart, as torch's own are)."""
    g = torch.Generator().manual_seed(rows + cols)
    tol = {"rtol": 1e-5, "atol": 4e-6 * cols ** 0.5}

    def want(x):
        return F.linear(x.double(), w.double(), b.double() if bias else None).float()
    w = torch.randn(rows, cols, generator=g)
    b = torch.randn(rows, generator=g) if bias else None
    packed = linear.pack(w)
    assert torch.equal(linear.unpack(packed, rows), w)
    assert torch.equal(linear.pack(w.t().contiguous().t()), packed)   # strides of a view
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 33, 48, 85, 130):
        x = torch.randn(m, cols, generator=g)
        torch.testing.assert_close(linear(packed, rows, x, b), want(x), **tol)
    wide = torch.randn(5, 2 * cols, generator=g)[:, ::2]            # a column stride of 2
    torch.testing.assert_close(linear(packed, rows, wide, b), want(wide), **tol)
    x3 = torch.randn(2, 3, cols, generator=g)
    assert linear(packed, rows, x3, b).shape == (2, 3, rows)
    torch.testing.assert_close(linear(packed, rows, x3, b), want(x3), **tol)
    assert linear(packed, rows, torch.empty(0, cols), b).shape == (0, rows)


@needs_avx2
def test_linear_kernel_refuses_what_it_does_not_take(linear):
    assert not linear.supports(torch.zeros(2, linear.MAX_K + 1))   # past its input buffer
    assert linear.supports(torch.zeros(3, 12))                      # any N and K under it
    assert not linear.supports(torch.zeros(8, 16, dtype=torch.bfloat16))
    packed = linear.pack(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="float32"):
        linear(packed, 8, torch.zeros(2, 16, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="16"):
        linear(packed, 8, torch.zeros(2, 24), None)


# the bf16 decode kernel's cases, and head sizes that are multiples of 8 but not of 16
CASES = [*BF16_CASES,
         (4, 2, 8, 8, [12, 13, 40], 12, 0.25),            # heads of one vector, window
         (5, 5, 80, 16, [70, 7], None, None)]             # head_dim 80: 10 vectors


@needs_avx2
@pytest.mark.parametrize("heads,kv_heads,hd,bs,ctx,window,scale", CASES)
def test_attention_kernel_matches_torch_path(attention, heads, kv_heads, hd, bs, ctx, window,
                                             scale):
    """Decode rows after a prompt in one step, from scattered blocks, through the kernel
    and through torch's fp32 path (gather + SDPA): the prompt's rows equal, the decode rows
    within fp32 summation order."""
    shape = _shape(heads, kv_heads, hd)
    rnd = random.Random(heads * 1000 + hd + bs)
    prompt = 7
    blocks = sum(-(-c // bs) for c in ctx) + -(-prompt // bs)
    kv = torch.randn(2, 1, blocks, bs, kv_heads, hd)
    free = list(range(blocks))
    rnd.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    tables = [[free.pop() for _ in range(-(-prompt // bs))]] + tables
    batch = AttnBatch(False, [prompt] + [1] * len(ctx), [prompt] + ctx, tables,
                      torch.zeros(prompt + len(ctx), dtype=torch.long), num_prefill=1)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(prompt + len(ctx), heads, hd, generator=g)
    k_new = torch.randn(prompt, kv_heads, hd, generator=g)
    v_new = torch.randn(prompt, kv_heads, hd, generator=g)
    outs = {}
    for name, k in (("torch", None), ("kernel", attention)):
        attn = PagedAttention(shape, torch.device("cpu"), torch.float32, scale=scale)
        assert attn.set_decode_kernel(k) is (k is not None)
        plan = attn.begin(batch, q.shape[0], kv)
        outs[name] = attn(0, q, k_new, v_new, kv, kv[0, 0].view(-1, kv_heads, hd),
                          kv[1, 0].view(-1, kv_heads, hd), batch, plan, window=window)
    a, b = outs["torch"], outs["kernel"]
    assert torch.equal(a[:prompt], b[:prompt])
    torch.testing.assert_close(b[prompt:], a[prompt:], rtol=1e-5, atol=2e-6)


@needs_avx2
def test_attention_kernel_takes_fp32_only(attention):
    assert attention.supports(12, 4, 64) and attention.supports(4, 2, 8)
    assert not attention.supports(4, 2, 12)             # head_dim not a multiple of 8
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    pool = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="float32"):
        attention(q, pool, pool, torch.zeros(1, 1, dtype=torch.int64),
                  torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1.0,
                  torch.zeros(64), q)


def _transformers_llama(path):
    transformers = pytest.importorskip("transformers")
    cls, cfg, _ = bf16_parity.llama(transformers)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    ref.save_pretrained(path, safe_serialization=True)
    return ref


@needs_avx2
def test_fp32_greedy_parity_with_transformers_through_the_kernels(linear, attention, tmp_path):
    """Five prompts of different lengths, then 12 greedy decode steps of all five in
    one batch (a tile of 4 rows and one of 1), attention and matmuls through
    the kernels: transformers' tokens for each, and logits within fp32 summation order."""
    ref = _transformers_llama(tmp_path / "m")
    model = load_model(tmp_path / "m", dtype=torch.float32)
    assert model.attn.set_decode_kernel(attention)
    taken = [layer.use_kernel(linear) for layer in dense_linears(model)]
    assert taken and all(taken)
    block = 16
    prompts = [[3, 17, 92, 5, 250, 11, 7], list(range(40, 75)), [9, 9, 8], [1],
               list(range(100, 300, 11))]
    kv = allocate_kv_pool(model.shape, 64, block, dtype=torch.float32)
    tables = [[i * 10 + j for j in range(10)] for i in range(len(prompts))]

    def slot(seq: int, pos: int) -> int:
        return tables[seq][pos // block] * block + pos % block
    seqs, logits_ours = [], []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            batch = AttnBatch(True, [len(p)], [len(p)], [tables[i]],
                              torch.tensor([slot(i, t) for t in range(len(p))]))
            out = model(torch.tensor(p), torch.arange(len(p)), batch, kv)
            seqs.append(list(p) + [int(out[0].argmax())])
            logits_ours.append([out[0]])
        for _ in range(12):
            pos = [len(s) - 1 for s in seqs]
            batch = AttnBatch(False, [1] * len(seqs), [len(s) for s in seqs], tables,
                              torch.tensor([slot(i, p) for i, p in enumerate(pos)]))
            out = model(torch.tensor([s[-1] for s in seqs]), torch.tensor(pos), batch, kv)
            for i, s in enumerate(seqs):
                s.append(int(out[i].argmax()))
                logits_ours[i].append(out[i])
        for i, p in enumerate(prompts):
            want = ref.generate(torch.tensor([p]), max_new_tokens=13, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
            assert seqs[i] == want.sequences[0].tolist()
            torch.testing.assert_close(torch.stack(logits_ours[i]),
                                       torch.cat(want.logits), rtol=1e-4, atol=1e-4)


@needs_avx2
def test_worker_uses_the_fp32_kernels_where_the_cpu_has_no_avx512(tiny_model, tmp_path,
                                                                   monkeypatch, capfd):
    """An fp32 decode or agg worker on a CPU without AVX-512F builds both kernels and
    decodes through them; a prefill worker, a CPU with AVX-512F, `cpu_kernels = off` and
    a worker of two threads keep torch's path (the last said in one line)."""
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2", "fma"}))

    def spec(role: str, where: str, kernels: str = "auto", threads: int = 1) -> WorkerSpec:
        return WorkerSpec(worker=f"{role}0", role=role, engine="torch", devices=["cpu"],
                          device_kind="cpu", model_dir=str(tiny_model), block_size=16,
                          kv_cache_bytes=8 << 20, max_batch_tokens=256, dtype="float32",
                          cpu_kernels=kernels, kernel_dir=str(tmp_path / where),
                          cpu_threads=threads)

    def uses_kernels(e) -> bool:
        linears = dense_linears(e.model)
        on = [isinstance(layer.kernel, cpu_kernels.LinearF32) for layer in linears]
        assert all(on) or not any(on)
        return isinstance(e.model.attn.decode_kernel, cpu_kernels.PagedDecodeF32) and all(on)
    for role in ("decode", "agg"):
        assert uses_kernels(build_torch_engine(spec(role, "a"), tiny_model))
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "a").iterdir()) == [
        "linear_f32", "paged_decode_f32"]
    assert not uses_kernels(build_torch_engine(spec("prefill", "p"), tiny_model))
    assert not uses_kernels(build_torch_engine(spec("decode", "o", kernels="off"), tiny_model))
    assert not (tmp_path / "p").exists() and not (tmp_path / "o").exists()
    capfd.readouterr()
    try:
        assert not uses_kernels(build_torch_engine(spec("decode", "t", threads=2), tiny_model))
        assert capfd.readouterr().err.strip().splitlines() == [
            "applianced worker decode0: decode attention and matmuls on torch's path (the fp32 "
            "kernels are single-threaded; this worker has 2 threads)"]
    finally:
        torch.set_num_threads(1)
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2", "fma", "avx512f"}))
    assert not uses_kernels(build_torch_engine(spec("decode", "x"), tiny_model))
