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
from test_cpu_kernels import _attend, _shape

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


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    return cpu_kernels.load_causal_prefill_f32(str(tmp_path_factory.mktemp("kernels")))


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    return cpu_kernels.load_layer_glue_f32(str(tmp_path_factory.mktemp("kernels")))


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 4) -> None:
    """fp32 values a few units in the last place apart at most: a norm's sum in another
    order moves its scale by an ulp and with it most of a row; exp's last ulp."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    step = torch.finfo(torch.float32).eps * want.abs().clamp_min(1e-30)
    assert ((got - want).abs() <= ulps * step).all(), float(((got - want).abs() / step).max())


@needs_avx2
@pytest.mark.parametrize("rows,cols", [(1280, 768), (37, 64), (768, 2048), (2, 8), (4, 16),
                                       (20, 12), (33, 520), (9, 777),
                                       (64, 272), (48, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernel_matches_torch(linear, rows, cols, bias):
    """Every way a call splits (groups of 1-6 input rows, one to six groups sharing the
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
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 19, 25, 33, 48, 85, 130):
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
         (5, 5, 80, 16, [70, 7], None, None),             # head_dim 80: 10 vectors
         (8, 2, 256, 16, [1, 2, 3, 4, 5, 66, 91], None, None),    # Gemma 3's 256: four streams
         (12, 4, 64, 16, [8, 9, 250, 251], 17, None)]     # windows that start mid-block


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
@pytest.mark.parametrize("one_call", [False, True], ids=["one-by-one", "one-call"])
def test_fp32_greedy_parity_with_transformers_through_the_kernels(linear, attention, glue,
                                                                  prefill, tmp_path, one_call):
    """Five prompts of different lengths, then 12 greedy decode steps of all five in
    one batch (a tile of 4 rows and one of 1), attention and matmuls through the kernels
    (and the glue and prompt attention kernels, each decode step's layers in one call):
    transformers' tokens for each, and logits within fp32 summation order."""
    ref = _transformers_llama(tmp_path / "m")
    if one_call:
        one = cpu_kernels.load_decode_layers_f32(str(tmp_path / "kernels"))
        one.bind(linear, attention, glue)
        model = _f32_model_on_the_kernels(tmp_path / "m", linear, attention, glue, one)
        assert model.attn.set_prefill_kernel(prefill)
        calls = []
        fn = one._fn
        one._fn = lambda *a: calls.append(1) or fn(*a)
    else:
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
    if one_call:
        assert len(calls) == 12


def _fp32_worker(role: str, model_dir, kernel_dir, kernels: str = "auto",
                 threads: int = 1) -> WorkerSpec:
    """A one-core fp32 torch worker's spec, its kernels built into `kernel_dir`."""
    return WorkerSpec(worker=f"{role}0", role=role, engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(model_dir), block_size=16,
                      kv_cache_bytes=8 << 20, max_batch_tokens=256, dtype="float32",
                      cpu_kernels=kernels, kernel_dir=str(kernel_dir), cpu_threads=threads)

@needs_avx2
def test_worker_uses_the_fp32_kernels_where_the_cpu_has_no_avx512(tiny_model, tmp_path,
                                                                   monkeypatch, capfd):
    """An fp32 decode or agg worker on a CPU without AVX-512F builds the five kernels and
    decodes through them, each decode step's layers in one call; a prefill worker takes the
    glue, prompt attention and matmul kernels (it never decodes); a CPU with AVX-512F,
    `cpu_kernels = off` and a worker of two threads keep torch's path (the last said in
    one line)."""
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2", "fma"}))

    def spec(role: str, where: str, kernels: str = "auto", threads: int = 1) -> WorkerSpec:
        return _fp32_worker(role, tiny_model, tmp_path / where, kernels, threads)

    def matmuls_in_c(e) -> bool:
        on = [isinstance(layer.kernel, cpu_kernels.LinearF32) for layer in dense_linears(e.model)]
        assert all(on) or not any(on)
        return all(on)

    def uses_kernels(e) -> bool:
        return isinstance(e.model.attn.decode_kernel, cpu_kernels.PagedDecodeF32) and matmuls_in_c(e)

    def glued(e) -> bool:
        return isinstance(e.model.glue_kernel, cpu_kernels.LayerGlueF32)
    for role in ("decode", "agg"):
        e = build_torch_engine(spec(role, "a"), tiny_model)
        assert uses_kernels(e) and glued(e)
        assert isinstance(e.model.decode_layers, cpu_kernels.DecodeLayersF32)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "a").iterdir()) == [
        "causal_prefill_f32", "decode_layers_f32", "layer_glue_f32", "linear_f32",
        "paged_decode_f32"]
    e = build_torch_engine(spec("prefill", "p"), tiny_model)
    assert matmuls_in_c(e) and glued(e) and e.model.decode_layers is None
    assert e.model.attn.decode_kernel is None
    assert isinstance(e.model.attn.prefill_kernel, cpu_kernels.CausalPrefillF32)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "p").iterdir()) == [
        "causal_prefill_f32", "layer_glue_f32", "linear_f32"]
    e = build_torch_engine(spec("decode", "o", kernels="off"), tiny_model)
    assert not matmuls_in_c(e) and not glued(e)
    assert not (tmp_path / "o").exists()
    capfd.readouterr()
    try:
        e = build_torch_engine(spec("decode", "t", threads=2), tiny_model)
        assert not matmuls_in_c(e) and not glued(e)
        assert capfd.readouterr().err.strip().splitlines() == [
            "applianced worker decode0: norms, attention and matmuls on torch's path "
            "(the fp32 kernels are single-threaded; this worker has 2 threads)"]
    finally:
        torch.set_num_threads(1)
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2", "fma", "avx512f"}))
    assert not matmuls_in_c(build_torch_engine(spec("decode", "x"), tiny_model))


@needs_avx2
@pytest.mark.parametrize("rows,width", [(1, 768), (5, 2048), (33, 40), (3, 17)])
def test_fp32_layer_glue_matches_the_torch_ops_it_replaces(glue, rows, width):
    """Residual add + RMSNorm against `layers.glue`'s eager functions, Qwen3's per-head
    norm against `layers.norm`'s, and SwiGLU's activation against `DenseMLP`'s ops, in
    fp32: the add exact, the rest within a few ulps, on widths that are and are not
    multiples of 8; other heads untouched, and bf16 refused."""
    from appliance.engines.layers.glue import eager_glue
    from appliance.engines.layers.norm import head_rms_norm_
    g = torch.Generator().manual_seed(rows * width)
    h = 3 * torch.randn(rows, width, generator=g)
    delta = torch.randn(rows, width, generator=g)
    w = 1 + 0.5 * torch.randn(width, generator=g)
    want_h, want_x = eager_glue().add_rms_norm(h, delta, w, 1e-5)
    got_h, got_x = glue.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(got_h, want_h)
    _within_ulps(got_x, want_x)
    _within_ulps(glue.rms_norm(h, w, 1e-6), eager_glue().rms_norm(h, w, 1e-6))
    gate_up = 3 * torch.randn(rows, 2 * width, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    _within_ulps(glue.silu_mul(gate_up), F.silu(gate).mul_(up))
    hd = {768: 64, 2048: 128, 40: 48, 17: 12}[width]
    qkv = torch.randn(rows, 7, hd, generator=g)
    qw = 1 + 0.1 * torch.randn(hd, generator=g)
    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    head_rms_norm_(want_qkv[:, 1:5], qw, 1e-6)
    glue.head_rms_norm_(got_qkv, 1, 4, qw, 1e-6)
    _within_ulps(got_qkv, want_qkv)
    assert torch.equal(got_qkv[:, [0, 5, 6]], qkv[:, [0, 5, 6]])
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        glue.rms_norm(h.bfloat16(), w.bfloat16(), 1e-6)


@needs_avx2
@pytest.mark.parametrize("heads,kv_heads,hd", [(12, 4, 64), (4, 4, 16), (8, 1, 128), (2, 1, 24)])
def test_fp32_rope_kernel_rotates_and_writes_the_cache_as_the_forward_does(glue, heads,
                                                                          kv_heads, hd):
    """RoPE on q and k with the K/V write against the forward's fp32 torch ops (`mul_`,
    `addcmul_`, `index_copy_`): the same bits (half a head of 12 takes a masked tail); a
    position or slot out of range is refused before anything is written."""
    T, slots_n = 5, 40
    ang = torch.rand(4096, hd // 2, generator=torch.Generator().manual_seed(hd)) * 6
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((-ang.sin(), ang.sin()), -1)
    qkv = torch.randn(T, heads + 2 * kv_heads, hd, generator=torch.Generator().manual_seed(heads))
    positions = torch.tensor([0, 7, 4095, 300, 300])
    slots = torch.tensor([3, 0, 39, 17, 18])
    want = qkv.clone()
    qk = want[:, :heads + kv_heads]
    swapped = qk.view(T, heads + kv_heads, 2, hd // 2).flip(2).view(T, heads + kv_heads, hd)
    qk.mul_(cos[positions].unsqueeze(1)).addcmul_(swapped, sin[positions].unsqueeze(1))
    want_k = torch.zeros(slots_n, kv_heads, hd)
    want_v = torch.zeros_like(want_k)
    want_k.index_copy_(0, slots, want[:, heads:heads + kv_heads])
    want_v.index_copy_(0, slots, want[:, heads + kv_heads:])
    got, k_cache, v_cache = qkv.clone(), torch.zeros_like(want_k), torch.zeros_like(want_v)
    glue.rope_kv(got, heads, kv_heads, cos, sin, positions, slots, k_cache, v_cache)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = qkv.clone()
    for pos, slot in (([0, 1, 2, 3, 4096], slots), (positions, [0, 1, 2, 3, 40])):
        with pytest.raises(ValueError, match="past the"):
            glue.rope_kv(qkv, heads, kv_heads, cos, sin, torch.as_tensor(pos),
                         torch.as_tensor(slot), torch.zeros_like(want_k), torch.zeros_like(want_v))
        assert torch.equal(qkv, before)


def _f32_model_on_the_kernels(where, linear, attention, glue, one):
    model = load_model(where, dtype=torch.float32)
    assert model.attn.set_decode_kernel(attention)
    assert not model.set_decode_layers(one)             # no glue kernel yet
    assert model.set_glue_kernel(glue)
    assert not model.set_decode_layers(one)             # matmuls not on the kernel yet
    for layer in dense_linears(model):
        assert layer.use_kernel(linear)
    assert model.set_decode_layers(one)
    return model


@needs_avx2
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp32_decode_layers_in_one_call_match_the_kernels_called_one_by_one(
        linear, attention, glue, tiny_model, tmp_path, family):
    """Decode steps of three sequences of different lengths in fp32, every layer in one C
    call (`cpu_kernels.DecodeLayersF32`) and with the same kernels called one by one from
    the forward: the same logits and the same KV pool bit for bit (a Qwen3's q/k norms
    included); prompts never take the one call; a bf16 glue kernel is refused."""
    from test_cpu_kernels import _tiny_qwen3
    where = tiny_model if family == "llama" else _tiny_qwen3(tmp_path / family)
    one = cpu_kernels.load_decode_layers_f32(str(tmp_path / "kernels"))
    one.bind(linear, attention, glue)
    model = _f32_model_on_the_kernels(where, linear, attention, glue, one)
    calls = []
    fn = one._fn
    one._fn = lambda *a: calls.append(1) or fn(*a)
    bs = 16
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    kv = allocate_kv_pool(model.shape, 12, bs, dtype=torch.float32)
    seqs = []
    for n, table in zip((20, 5, 33), tables):
        prompt = [3 + (7 * i) % 50 for i in range(n)]
        slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
        logits = model(torch.tensor(prompt), torch.arange(n),
                       AttnBatch(True, [n], [n], [table], slots), kv)
        seqs.append(prompt + [int(logits[0].argmax())])
    assert calls == []
    pools = {"one by one": kv.clone(), "one call": kv.clone()}
    for _ in range(5):
        pos = [len(seq) - 1 for seq in seqs]
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)])
        out = {}
        for name, pool in pools.items():
            assert model.set_decode_layers(one if name == "one call" else None)
            batch = AttnBatch(False, [1] * 3, [len(seq) for seq in seqs], tables, slots)
            out[name] = model(torch.tensor([seq[-1] for seq in seqs]), torch.tensor(pos),
                              batch, pool)
        assert torch.equal(out["one call"], out["one by one"])
        for seq, row in zip(seqs, out["one by one"]):
            seq.append(int(row.argmax()))
    assert len(calls) == 5
    assert torch.equal(pools["one call"], pools["one by one"])
    bf16 = load_model(where, dtype=torch.bfloat16)
    assert not bf16.set_glue_kernel(glue) and bf16.glue_kernel is None


@pytest.mark.skipif(kernel_build.compiler() is None, reason="needs a C compiler")
def test_a_source_that_includes_another_is_rebuilt_when_that_one_changes(tmp_path, monkeypatch):
    """decode_layers_f32.c is decode_layers.c with fp32 elements: a change to the file it
    includes makes another library, as a change to its own text or a header does."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("decode_layers_f32.c", "decode_layers.c"):
        (src / name).write_text((kernel_build.SOURCE_DIR / name).read_text())
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", src)
    first = kernel_build.build("decode_layers_f32", tmp_path / "k")
    assert kernel_build.build("decode_layers_f32", tmp_path / "k") == first
    (src / "decode_layers.c").write_text((src / "decode_layers.c").read_text() + "\n/* x */\n")
    second = kernel_build.build("decode_layers_f32", tmp_path / "k")
    assert second != first and second.is_file()


@needs_avx2
@pytest.mark.parametrize("heads,kv_heads,hd", [(12, 4, 64), (4, 4, 16), (8, 1, 128), (2, 2, 48),
                                              (4, 2, 256)])
@pytest.mark.parametrize("n", [1, 5, 6, 7, 16, 17, 100, 256])
def test_fp32_prompt_attention_kernel_matches_sdpa(prefill, heads, kv_heads, hd, n):
    """A prompt's causal attention against torch's fp32 SDPA, with q, k and v slices of one
    fused row as the forward hands them: within fp32 summation order, on prompts that fill
    a tile of 6 rows and a panel of 16 keys and do not, GQA and not, head sizes 16-256."""
    g = torch.Generator().manual_seed(n * hd + heads)
    qkv = torch.randn(n, heads + 2 * kv_heads, hd, generator=g)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    scale = hd ** -0.5
    got = prefill(q, k, v, scale)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True, scale=scale)
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=2e-6)


@needs_avx2
def test_fp32_prompts_go_through_the_prefill_kernel_only_where_it_applies(prefill):
    """Through `PagedAttention`: a fresh fp32 prompt is the kernel's; one with a cached
    prefix, or one a sliding window cuts, stays with SDPA; a bf16 model refuses it."""
    shape = _shape(4, 2, 64)
    n = 40
    kv = torch.randn(2, 1, 8, 16, 2, 64)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, 4, 64, generator=g)
    k = torch.randn(n, 2, 64, generator=g)
    v = torch.randn(n, 2, 64, generator=g)
    fresh = AttnBatch(True, [n], [n], [[0, 1, 2]], torch.zeros(n, dtype=torch.long))
    cached = AttnBatch(True, [8], [48], [[0, 1, 2]], torch.zeros(8, dtype=torch.long))
    outs = {}
    for name, kernel in (("sdpa", None), ("kernel", prefill)):
        attn = PagedAttention(shape, torch.device("cpu"), torch.float32)
        assert attn.set_prefill_kernel(kernel) is (kernel is not None)
        outs[name] = [_attend(attn, q, kv, fresh, None, k, v),
                      _attend(attn, q[:8], kv, cached, None, k[:8], v[:8]),
                      _attend(attn, q, kv, fresh, 12, k, v)]
    assert torch.equal(outs["kernel"][0], prefill(q, k, v, 64 ** -0.5).reshape(n, -1))
    assert not torch.equal(outs["kernel"][0], outs["sdpa"][0])     # not SDPA's bits: the kernel's
    torch.testing.assert_close(outs["kernel"][0], outs["sdpa"][0], rtol=1e-5, atol=2e-6)
    assert torch.equal(outs["sdpa"][1], outs["kernel"][1])         # cached prefix: SDPA
    assert torch.equal(outs["sdpa"][2], outs["kernel"][2])         # a window: SDPA
    assert not PagedAttention(shape, torch.device("cpu"), torch.bfloat16).set_prefill_kernel(prefill)
    with pytest.raises(ValueError, match="CPU float32"):
        prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)


@needs_avx2
@pytest.mark.parametrize("make", [bf16_parity.gemma3, bf16_parity.qwen3, bf16_parity.qwen3_moe],
                         ids=["gemma3", "qwen3", "qwen3-moe"])
def test_every_family_starts_its_workers_on_the_fp32_kernels(make, tmp_path, monkeypatch):
    """Each family's prefill and decode workers start on a CPU without AVX-512F (Gemma 3's
    layers hold their matmuls themselves, not in an `mlp`: its workers failed to start),
    take the matmul kernel, and a prompt then a decode step give torch's own logits."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2", "fma"}))
    cls, cfg, norm_mean = make(transformers)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((norm_mean if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape))
    ref.save_pretrained(tmp_path / "m", safe_serialization=True)

    def run(model) -> torch.Tensor:
        kv = allocate_kv_pool(model.shape, 8, 16, dtype=torch.float32)
        prompt = list(range(5, 29))
        table = [3, 1, 6, 0]
        with torch.no_grad():
            first = model(torch.tensor(prompt), torch.arange(len(prompt)),
                          AttnBatch(True, [len(prompt)], [len(prompt)], [table],
                                    torch.tensor([table[p // 16] * 16 + p % 16
                                                  for p in range(len(prompt))])), kv)[0]
            p = len(prompt)
            step = model(first.argmax().view(1), torch.tensor([p]),
                         AttnBatch(False, [1], [p + 1], [table],
                                   torch.tensor([table[p // 16] * 16 + p % 16])), kv)[0]
        return torch.stack([first, step])
    want = run(load_model(tmp_path / "m", dtype=torch.float32))
    for role in ("prefill", "decode"):
        e = build_torch_engine(_fp32_worker(role, tmp_path / "m", tmp_path / "k"), tmp_path / "m")
        assert all(isinstance(layer.kernel, cpu_kernels.LinearF32)
                   for layer in dense_linears(e.model))
        torch.testing.assert_close(run(e.model), want, rtol=1e-4, atol=1e-4)
