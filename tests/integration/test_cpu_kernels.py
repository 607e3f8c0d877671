"""The C decode-attention kernel (`engines.cpu_kernels`): built here with the host's
compiler (a subprocess, hence an integration test), the same numbers as torch's path on
every shape and window it takes, greedy parity with transformers through it, and one
clear line and torch's path where it cannot be built."""
from __future__ import annotations

import os
import random
import shutil
import time

import pytest
import torch

from appliance.engines import cpu_kernels
from appliance.engines.cpu_kernels import builder as kernel_build
from appliance.engines.kv_pool import allocate_kv_pool
from appliance.engines.layers import attention
from appliance.engines.layers.attention import AttnBatch, PagedAttention
from appliance.engines.layers.linear import Linear
from appliance.engines.loader import load_model
from appliance.engines.torch_engine import build_torch_engine, dense_linears
from appliance.models.shape import LlamaShape
from appliance.worker.spec import WorkerSpec
from helpers import bf16_parity
from helpers.memory_maps import vm_flags

torch.set_num_threads(1)


def _has_avx512() -> bool:
    from appliance.engines.dtypes import cpu_flags
    return "avx512f" in cpu_flags()


needs_kernel = pytest.mark.skipif(kernel_build.compiler() is None or not _has_avx512(),
                                  reason="the kernel needs a C compiler and AVX-512F")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return cpu_kernels.load_paged_decode(str(tmp_path_factory.mktemp("kernels")))


def _shape(heads: int, kv_heads: int, head_dim: int, sinks: bool = False) -> LlamaShape:
    return LlamaShape(architecture="LlamaForCausalLM", vocab_size=64,
                      hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e4,
                      rope_scaling=None, tie_word_embeddings=False, qkv_bias=False,
                      o_bias=False, attention_sinks=sinks)


def _attend(attn: PagedAttention, q, kv, batch: AttnBatch, window, k_new, v_new):
    plan = attn.begin(batch, q.shape[0], kv)
    k_cache = kv[0, 0].view(-1, *kv.shape[-2:])
    v_cache = kv[1, 0].view(-1, *kv.shape[-2:])
    return attn(0, q, k_new, v_new, kv, k_cache, v_cache, batch, plan, window=window)


CASES = [
    # heads, kv heads, head_dim, block size, contexts, window, scale
    (12, 4, 64, 16, [1, 15, 16, 17, 300], None, None),
    (8, 8, 64, 16, [40, 3, 129], None, None),            # no GQA
    (16, 2, 128, 16, [200, 77], None, None),             # 8 query heads per KV head, hd 128
    (6, 1, 32, 5, [1, 9, 64], None, 0.3),                # odd block size, custom scale
    (12, 4, 64, 16, [5, 100, 300, 33], 64, None),        # sliding window
    (4, 2, 16, 8, [12, 13, 40], 12, 0.25),               # Gemma-sized heads, window
]


@pytest.fixture(scope="module")
def kernel_without_bf16(tmp_path_factory):
    """The decode kernel as a CPU with AVX-512F but not AVX512-BF16 builds it (Skylake,
    Cascade Lake): its scores then run on fp32 FMAs, a path this CPU would not take."""
    path = kernel_build.build("paged_decode", tmp_path_factory.mktemp("no-bf16"),
                              flags=(*kernel_build.FLAGS, "-mno-avx512bf16"))
    return cpu_kernels.PagedDecode(path)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,hd,bs,ctx,window,scale", CASES)
def test_kernel_without_bf16_matches_torch_path(kernel_without_bf16, heads, kv_heads, hd, bs,
                                                ctx, window, scale):
    test_kernel_matches_torch_path(kernel_without_bf16, heads, kv_heads, hd, bs, ctx, window,
                                   scale)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,hd,bs,ctx,window,scale", CASES)
def test_kernel_matches_torch_path(kernel, heads, kv_heads, hd, bs, ctx, window, scale):
    """Decode rows (and a mixed step: a prompt first) through the kernel and through
    torch's bf16 path (`_grouped_decode`) from the same scattered blocks: the same
    rounding, so all but a few elements are equal and none is over a bf16 step apart;
    both as close to an fp32 reference."""
    shape = _shape(heads, kv_heads, hd)
    rnd = random.Random(heads * 1000 + hd + bs)
    prompt = 7
    blocks = sum(-(-c // bs) for c in ctx) + -(-prompt // bs)
    kv = torch.randn(2, 1, blocks, bs, kv_heads, hd).to(torch.bfloat16)
    free = list(range(blocks))
    rnd.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    tables = [[free.pop() for _ in range(-(-prompt // bs))]] + tables
    lens = [prompt] + ctx
    batch = AttnBatch(False, [prompt] + [1] * len(ctx), lens, tables,
                      torch.zeros(prompt + len(ctx), dtype=torch.long), num_prefill=1)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(prompt + len(ctx), heads, hd, generator=g).to(torch.bfloat16)
    k_new = torch.randn(prompt, kv_heads, hd, generator=g).to(torch.bfloat16)
    v_new = torch.randn(prompt, kv_heads, hd, generator=g).to(torch.bfloat16)
    outs = {}
    for name, k in (("torch", None), ("kernel", kernel)):
        attn = PagedAttention(shape, torch.device("cpu"), torch.bfloat16, scale=scale)
        assert attn.set_decode_kernel(k) is (k is not None)
        outs[name] = _attend(attn, q, kv, batch, window, k_new, v_new).float()
    a, b = outs["torch"], outs["kernel"]
    assert a.shape == b.shape == (prompt + len(ctx), heads * hd)
    assert torch.equal(a[:prompt], b[:prompt])          # the prompt: torch's path both times
    rows_a, rows_b = a[prompt:], b[prompt:]
    same = (rows_a == rows_b).float().mean().item()
    assert same > 0.97, same
    torch.testing.assert_close(rows_b, rows_a, rtol=2 ** -7, atol=2 ** -9)
    # fp32 reference from the same bf16 K/V
    s = hd ** -0.5 if scale is None else scale
    for i, (c, table) in enumerate(zip(ctx, tables[1:])):
        pos = torch.arange(max(0, c - window) if window else 0, c)
        rows = torch.tensor(table)[pos // bs] * bs + pos % bs
        k = kv[0, 0].reshape(-1, kv_heads, hd)[rows].float().repeat_interleave(heads // kv_heads, 1)
        v = kv[1, 0].reshape(-1, kv_heads, hd)[rows].float().repeat_interleave(heads // kv_heads, 1)
        qi = q[prompt + i].float()
        p = torch.softmax(torch.einsum("hd,thd->ht", qi, k) * s, -1)
        want = torch.einsum("ht,thd->hd", p, v).reshape(-1)
        err_kernel = (rows_b[i] - want).abs().max().item()
        err_torch = (rows_a[i] - want).abs().max().item()
        assert err_kernel <= max(2 * err_torch, 2 ** -8), (i, err_kernel, err_torch)


@needs_kernel
def test_kernel_refuses_what_it_does_not_take(kernel):
    assert kernel.supports(64, 8, 128) and kernel.supports(4, 2, 16)
    assert not kernel.supports(12, 4, 24)               # head_dim not a multiple of 16
    assert not kernel.supports(128, 8, 64)              # more heads than it holds
    sinks = _shape(2, 1, 64, sinks=True)
    assert not PagedAttention(sinks, torch.device("cpu"), torch.bfloat16).set_decode_kernel(kernel)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    pool = torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous CPU torch.int32"):
        kernel(q, pool, pool, torch.zeros(1, 1, dtype=torch.long), torch.ones(1),
               torch.zeros(1, dtype=torch.int32), 1.0, torch.empty(64), torch.empty_like(q))
    with pytest.raises(ValueError, match="scratch too small"):
        kernel(q, pool, pool, torch.zeros(1, 1, dtype=torch.long),
               torch.full((1,), 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1.0,
               torch.empty(4), torch.empty_like(q))


def _built(loader, tmp_path_factory):
    try:
        return loader(str(tmp_path_factory.mktemp("kernels")))
    except cpu_kernels.KernelUnavailable as exc:        # no AVX512-BF16 here
        pytest.skip(str(exc))


@pytest.fixture(scope="module", params=["native", "no AMX"])
def linear(request, tmp_path_factory):
    """The matmul kernel as this host builds it (on an AMX CPU: its tile path for K a
    multiple of 32), and built without AMX (VDPBF16PS only, what a CPU without tiles runs)."""
    from appliance.engines.dtypes import cpu_flags
    kernel = _built(cpu_kernels.load_linear_bf16, tmp_path_factory)
    if request.param == "native":
        assert kernel.amx is ("amx_bf16" in cpu_flags())
        return kernel
    path = kernel_build.build("linear_bf16", tmp_path_factory.mktemp("no-amx"),
                              flags=(*kernel_build.FLAGS, "-mno-amx-tile", "-mno-amx-bf16"))
    kernel = cpu_kernels.LinearBf16(path)
    assert not kernel.amx
    return kernel


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    return _built(cpu_kernels.load_causal_prefill, tmp_path_factory)


@pytest.fixture(scope="module", params=["native", "no-amx"])
def prefill_paths(request, tmp_path_factory, prefill):
    """The prompt-attention kernel as this host builds it (on an AMX CPU: its tile path
    for head_dim a multiple of 32), and built without AMX (VDPBF16PS only)."""
    from appliance.engines.dtypes import cpu_flags
    if request.param == "native":
        assert prefill.amx(64) is ("amx_bf16" in cpu_flags())
        assert not prefill.amx(16)                      # not whole tiles: VDPBF16PS
        return prefill
    path = kernel_build.build("causal_prefill", tmp_path_factory.mktemp("no-amx"),
                              flags=(*kernel_build.FLAGS, "-mno-amx-tile", "-mno-amx-bf16"))
    kernel = cpu_kernels.CausalPrefill(path)
    assert not kernel.amx(64)
    return kernel


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    return _built(cpu_kernels.load_layer_glue, tmp_path_factory)


@needs_kernel
@pytest.mark.parametrize("make", [bf16_parity.llama, bf16_parity.gemma3], ids=["llama", "gemma3"])
def test_bf16_greedy_parity_with_transformers_through_the_kernels(kernel, linear, prefill,
                                                                  glue, make, tmp_path):
    bf16_parity.check_bf16_greedy_parity(make, tmp_path / "a", decode_kernel=kernel)
    bf16_parity.check_bf16_greedy_parity(make, tmp_path / "b", decode_kernel=kernel,
                                         linear_kernel=linear, prefill_kernel=prefill,
                                         glue_kernel=glue)


@needs_kernel
@pytest.mark.parametrize("ride,steps", [(3, 7), (16, 2)])
def test_bf16_greedy_parity_with_transformers_for_a_prompt_riding_on_decode_steps(
        kernel, linear, prefill, glue, tmp_path, ride, steps):
    """A CPU decode worker's riding prompt (`engine.cpu_decode_ride_rows`; 16 rows, past
    the matmul kernel's tile of 8, for a setting over auto's 8): its tokens go in `ride`
    at a time as rows of decode steps through the one-call layers, each row attending
    over its own positions; every chunk's logits and the greedy answer are transformers'
    within bf16's rounding, as a whole prompt's are."""
    one = cpu_kernels.load_decode_layers(str(tmp_path / "layers"))
    one.bind(linear, kernel, glue)
    calls = []
    fn = one._fn
    one._fn = lambda *a: calls.append(1) or fn(*a)
    bf16_parity.check_bf16_greedy_parity(bf16_parity.llama, tmp_path / "m", decode_kernel=kernel,
                                         linear_kernel=linear, prefill_kernel=prefill,
                                         glue_kernel=glue, decode_layers=one, ride=ride)
    assert len(calls) == steps + 11     # 20 prompt tokens in chunks, then 11 decode steps


def _sdpa_causal(q, k, v):
    """torch's CPU SDPA (its flash kernel) on [n, heads, hd] rows, causal."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, enable_gqa=True)[0].transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("n,heads,kv_heads,hd", [(256, 12, 4, 64), (1, 4, 2, 16), (37, 8, 8, 64),
                                                 (100, 16, 2, 128), (17, 6, 1, 32),
                                                 (300, 12, 4, 64), (50, 4, 2, 96)])
def test_prefill_kernel_matches_sdpa(prefill_paths, n, heads, kv_heads, hd):
    """A prompt's causal attention through the kernel (both paths on an AMX CPU; rows
    and keys that end mid-tile included), from slices of one fused qkv row as the model
    makes them, against SDPA in bf16 (what it replaces): rounded the same way, so most
    outputs are equal and none is over a bf16 step apart, and it is exactly as close to
    an fp32 reference."""
    prefill = prefill_paths
    g = torch.Generator().manual_seed(n + heads + hd)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g).to(torch.bfloat16)
    q = qkv[:, :heads * hd].view(n, heads, hd)
    k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(n, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd:].view(n, kv_heads, hd)
    got = prefill(q, k, v, hd ** -0.5).float()
    want = _sdpa_causal(q, k, v).float()
    assert got.shape == (n, heads, hd)
    assert (got == want).float().mean().item() > 0.85
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7)
    exact = _sdpa_causal(q.float(), k.float(), v.float())
    err, sdpa_err = (got - exact).abs().max().item(), (want - exact).abs().max().item()
    assert err <= sdpa_err * 1.25 + 1e-6, (err, sdpa_err)


@needs_kernel
def test_onednn_matmuls_are_unchanged_by_the_kernels_use_of_the_tiles(prefill, linear):
    """A prefill worker runs oneDNN's matmuls (on AMX's tiles where the CPU has them)
    between calls of the prompt kernel, and a decode worker the matmul kernel next to
    oneDNN: each kernel loads its own tile configuration and releases the tiles when it
    returns, and oneDNN's results stay the same bit for bit across them."""
    from appliance.engines.layers.linear import Linear
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g).to(torch.bfloat16)
    x = torch.randn(40, 128, generator=g).to(torch.bfloat16)
    onednn = Linear(w.clone(), None)
    first = onednn(x)
    torch.testing.assert_close(first.float(), x.float() @ w.float().T, rtol=2 ** -6, atol=0.1)
    q = torch.randn(48, 4, 64, generator=g).to(torch.bfloat16)
    kv = torch.randn(48, 2, 64, generator=g).to(torch.bfloat16)
    packed = linear.pack(w)
    for _ in range(3):
        prefill(q, kv, kv, 0.125)
        assert torch.equal(onednn(x), first)
        linear(packed, 96, x, None)
        assert torch.equal(onednn(x), first)


@needs_kernel
def test_prompts_go_through_the_prefill_kernel_only_where_it_applies(prefill):
    """Through `PagedAttention`: a fresh prompt is the kernel's; one with a cached prefix,
    or one a sliding window cuts, stays with SDPA (the same output as with no kernel)."""
    shape = _shape(4, 2, 64)
    n = 40
    kv = torch.randn(2, 1, 8, 16, 2, 64).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, 4, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(n, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(n, 2, 64, generator=g).to(torch.bfloat16)
    fresh = AttnBatch(True, [n], [n], [[0, 1, 2]], torch.zeros(n, dtype=torch.long))
    cached = AttnBatch(True, [8], [48], [[0, 1, 2]], torch.zeros(8, dtype=torch.long))
    outs = {}
    for name, kernel in (("sdpa", None), ("kernel", prefill)):
        attn = PagedAttention(shape, torch.device("cpu"), torch.bfloat16)
        assert attn.set_prefill_kernel(kernel) is (kernel is not None)
        outs[name] = [_attend(attn, q, kv, fresh, None, k, v),
                      _attend(attn, q[:8], kv, cached, None, k[:8], v[:8]),
                      _attend(attn, q, kv, fresh, 12, k, v)]
    assert torch.equal(outs["kernel"][0], prefill(q, k, v, 64 ** -0.5).reshape(n, -1))
    torch.testing.assert_close(outs["kernel"][0].float(), outs["sdpa"][0].float(),
                               rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(outs["sdpa"][1], outs["kernel"][1])         # cached prefix: SDPA
    assert torch.equal(outs["sdpa"][2], outs["kernel"][2])         # a window: SDPA


@needs_kernel
@pytest.mark.parametrize("rows,cols", [(1280, 768), (37, 64), (768, 2048), (40, 48), (16, 2)])
def test_linear_kernel_matches_onednn(linear, rows, cols):
    """The matmul kernel against the oneDNN-packed `Linear` it replaces, from 1 to 69 rows
    (the AMX path's chunks of 32 and their halves of 16), with and without a bias, on
    widths that are and are not multiples of 16 (and of 32, which the AMX path needs), an
    odd number of 16-row blocks: equal but for a few outputs one bf16 step apart (the same
    bf16 products, summed in another order), and the weight comes back out exactly."""
    g = torch.Generator().manual_seed(rows + cols)
    weight = (0.05 * torch.randn(rows, cols, generator=g)).to(torch.bfloat16)
    bias = torch.randn(rows, generator=g).to(torch.bfloat16)
    for b in (None, bias):
        ours, theirs = Linear(weight, b), Linear(weight, b)
        assert ours.use_kernel(linear) and ours.packed is None
        assert torch.equal(ours.dense(), weight)
        for m in (1, 3, 8, 9, 17, 33, 69):
            x = torch.randn(m, cols, generator=g).to(torch.bfloat16)
            want, got = theirs(x).float(), ours(x).float()
            assert got.shape == (m, rows)
            assert (want != got).float().mean().item() < 0.005
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7)
        x3 = torch.randn(2, 3, cols, generator=g).to(torch.bfloat16)    # leading dims kept
        assert ours(x3).shape == (2, 3, rows)
        assert ours(x3[:, :, :].transpose(0, 1)).shape == (3, 2, rows)  # a strided input
    odd = Linear(torch.zeros(4, 5, dtype=torch.bfloat16))
    assert not odd.use_kernel(linear) and odd.packed is not None    # odd width: oneDNN keeps it


@needs_kernel
@pytest.mark.parametrize("rows,cols", [(1280, 768), (48, 64), (40, 96), (768, 2048)])
def test_prompt_sized_matmuls_equal_the_same_rows_called_in_small_pieces(linear, rows, cols):
    """A prompt-sized call (a decode worker's own prompts) computes each output as the
    same sum in the same order as a call of a few rows, so it equals the same rows called
    32, 17 or 1 at a time bit for bit: whole 32-row chunks and the rows past them (1, 16
    and 31 left over), groups of two blocks and a last one of one (48 and 40 outputs:
    three blocks, the last padded), with and without a bias. (It guards any reordering
    of the loops for speed, as session 36 tried.)"""
    g = torch.Generator().manual_seed(rows * 7 + cols)
    weight = (0.05 * torch.randn(rows, cols, generator=g)).to(torch.bfloat16)
    bias = torch.randn(rows, generator=g).float()
    packed = linear.pack(weight)
    for b in (None, bias):
        for m in (256, 257, 272, 319, 600):
            x = torch.randn(m, cols, generator=g).to(torch.bfloat16)
            whole = linear(packed, rows, x, b)
            for piece in (32, 17, 1):
                parts = torch.cat([linear(packed, rows, x[i:i + piece], b)
                                   for i in range(0, m, piece)])
                assert torch.equal(whole, parts), (m, piece)
            want = x.float() @ weight.float().T + (0 if b is None else b)
            torch.testing.assert_close(whole.float(), want, rtol=2 ** -7, atol=2 ** -6)


def _own_linear(directory) -> cpu_kernels.LinearBf16:
    """The matmul kernel loaded from a build of its own, so its helper thread (one per
    loaded library) is this test's alone."""
    try:
        return cpu_kernels.LinearBf16(kernel_build.build("linear_bf16", directory))
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(str(exc))


def _eventually(predicate, timeout: float = 20.0) -> bool:
    """Whether `predicate()` holds within `timeout` s (a thread on a loaded machine may
    take a while to be scheduled)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _wait_for_helper(kernel) -> int:
    assert _eventually(lambda: kernel.helper_tid() != 0), "the helper thread never started"
    return kernel.helper_tid()


@needs_kernel
def test_the_helper_thread_shares_calls_and_writes_the_same_outputs(tmp_path):
    """With the helper thread on another core taking part (`helper_spin(True)`), every
    output equals the one-thread call's bit for bit (each weight group is computed the
    same way, whoever takes it), on the AMX and the VDPBF16PS paths (K a multiple of 32
    or not), 1 to 300 rows, with a bias, an odd number of blocks; the helper did take
    groups; it sleeps when told, and by itself once calls stop; a core that does not
    exist is refused."""
    kernel = _own_linear(tmp_path / "a")
    core = sorted(os.sched_getaffinity(0))[-1]
    assert kernel.start_helper(core)
    tid = _wait_for_helper(kernel)
    # it takes only the core's spare time, on that core alone
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    assert os.sched_getaffinity(tid) == {core}
    g = torch.Generator().manual_seed(7)
    layers = []
    for rows, cols in ((4096, 768), (1280, 768), (37, 64), (40, 48), (768, 2048)):
        w = (0.05 * torch.randn(rows, cols, generator=g)).to(torch.bfloat16)
        b = torch.randn(rows, generator=g).to(torch.bfloat16)
        layer = Linear(w, b)
        assert layer.use_kernel(kernel)
        layers.append(layer)
    try:
        for m in (1, 8, 33, 69, 300):
            xs = [torch.randn(m, layer.pairs.shape[1] // 16, generator=g).to(torch.bfloat16)
                  for layer in layers]
            kernel.helper_spin(False)
            want = [layer(x) for layer, x in zip(layers, xs)]
            kernel.helper_spin(True)
            for _ in range(5):
                got = [layer(x) for layer, x in zip(layers, xs)]
                assert all(torch.equal(a, b) for a, b in zip(got, want)), m
        if len(os.sched_getaffinity(0)) > 1:
            # Whether the helper takes a group depends on its core being free during a
            # call: on a loaded box keep calling (the last rows' outputs still checked)
            # until it has.
            def shared() -> bool:
                kernel.helper_spin(True)         # it naps by itself between our calls
                got = [layer(x) for layer, x in zip(layers, xs)]
                assert all(torch.equal(a, b) for a, b in zip(got, want))
                return kernel.helper_groups() > 0
            assert _eventually(shared), "the helper thread never took a group"
        kernel.helper_spin(False)
        assert _eventually(kernel.helper_asleep)          # it goes to sleep when told
        naps = kernel.helper_naps()
        assert kernel.helper_spin(True)                   # is woken (it was asleep)
        # no calls: within a few ms it goes to sleep again by itself
        assert _eventually(lambda: kernel.helper_naps() > naps and kernel.helper_asleep())
    finally:
        kernel.helper_spin(False)
    assert not _own_linear(tmp_path / "b").start_helper(1023)   # no such CPU here


# A process on the helper's core that runs in bursts of `burst` seconds 2 ms apart, as a
# prompt does; with a page (fd) it takes the core back before each burst, as a prefill
# worker does (`core_lending.Lender`), and prints its stats when killed.
_BURSTS = """
import json, os, signal, sys, time
from pathlib import Path
os.sched_setaffinity(0, {{{core}}})
lender = None
if {fd} >= 0:
    from appliance.engines.cpu_kernels import LinearBf16
    from appliance.engines.cpu_kernels.core_lending import LendPage, Lender
    lender = Lender(LinearBf16(Path({so!r})), LendPage({fd}))
def stop(*_):
    print(json.dumps(lender.stats.__dict__ if lender else {{}}), flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
print("bursting", flush=True)
while True:
    if lender:
        lender.take()
    t = time.perf_counter()
    while time.perf_counter() - t < {burst}:
        pass
    if lender:
        lender.give()
    time.sleep(0.002)
"""


def _bursts_beside(kernel, core: int, fd: int = -1, burst: float = 0.03):
    import subprocess
    import sys
    proc = subprocess.Popen(
        [sys.executable, "-c", _BURSTS.format(core=core, fd=fd, so=str(kernel.path), burst=burst)],
        stdout=subprocess.PIPE, pass_fds=(fd,) if fd >= 0 else ())
    assert proc.stdout.readline().strip() == b"bursting"
    return proc


def _held_steps(kernel, layer, x, steps: int, step_s: float = 0.01) -> tuple[int, int]:
    """(steps in which a call waited over 10 ms for the helper, groups it wrote)."""
    g0, held = kernel.helper_groups(), 0
    kernel.helper_held_ns()
    for _ in range(steps):
        kernel.helper_spin(True)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < step_s:
            layer(x)
        held += kernel.helper_held_ns() > 10_000_000
    return held, kernel.helper_groups() - g0


@needs_kernel
def test_the_gate_keeps_the_helper_out_after_it_held_a_step_up(tmp_path):
    """A process that takes the helper's core in 30 ms bursts, without handing it back:
    the helper (at SCHED_IDLE) is preempted inside groups, the step waits, and the gate
    keeps it out for `PROBE_STEPS` steps (then longer) before it tries again."""
    from appliance.engines.cpu_kernels import helper_gate
    kernel = _own_linear(tmp_path)
    core = sorted(os.sched_getaffinity(0))[-1]
    assert kernel.start_helper(core)
    _wait_for_helper(kernel)
    layer = Linear((0.05 * torch.randn(4096, 768)).to(torch.bfloat16))
    assert layer.use_kernel(kernel)
    x = torch.randn(8, 768).to(torch.bfloat16)
    busy = _bursts_beside(kernel, core)
    gate = helper_gate.HelperGate(kernel, core)
    steps = 0

    def kept_out() -> bool:
        # on a loaded box the helper may not run (nor be held) for a while: step until
        # it has been kept out, as asserted below
        nonlocal steps
        gate.begin()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:      # a step of 50 ms of matmuls
            layer(x)
        gate.end()
        steps += 1
        return gate.stats.turned_off >= 1 and gate.stats.steps_without >= helper_gate.PROBE_STEPS
    try:
        assert _eventually(kept_out, timeout=60), gate.stats
    finally:
        busy.kill()
        busy.wait()
        kernel.helper_spin(False)
    assert gate.stats.steps_with < steps


@needs_kernel
def test_a_lender_takes_its_core_back_at_a_group_boundary(tmp_path):
    """The same 30 ms bursts on the helper's core, by a process that shares the lend page
    (`core_lending`): without taking the core back, steps wait for a preempted helper;
    taking it back before each burst, the helper leaves its group first (the burst waits
    for it, and never runs out of time), the steps do not wait, and the helper still
    shares the calls between bursts. A lender that died holding the core keeps the
    helper out until the next one starts. Each borrower has its own slot; a slot out of
    range is refused."""
    import json
    from appliance.engines.cpu_kernels.core_lending import PAGE_BYTES, Lender, LendPage
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a second core for the helper")
    kernel = _own_linear(tmp_path)
    core = sorted(os.sched_getaffinity(0))[-1]
    fd = os.memfd_create("lend-test")
    os.ftruncate(fd, PAGE_BYTES)
    page = LendPage(fd)
    assert not kernel.helper_lend(page.address, 63)
    assert kernel.helper_lend(page.address, 5)
    assert kernel.start_helper(core)
    _wait_for_helper(kernel)
    layer = Linear((0.05 * torch.randn(4096, 768)).to(torch.bfloat16))
    assert layer.use_kernel(kernel)
    x = torch.randn(8, 768).to(torch.bfloat16)
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, own - {core})       # the caller off the helper's core
    try:
        # a lender that died holding the core: no helper claims a group; the next one
        # to start lends it again
        Lender(kernel, page).take()
        assert _held_steps(kernel, layer, x, 20)[1] == 0
        Lender(kernel, page)
        assert _eventually(lambda: _held_steps(kernel, layer, x, 5)[1] > 0)
        busy = _bursts_beside(kernel, core)     # not handing it back
        held_without = 0

        def held_often() -> bool:   # on a loaded box the helper may run (and be held) late
            nonlocal held_without
            held_without += _held_steps(kernel, layer, x, 20)[0]
            return held_without >= 10
        try:
            assert _eventually(held_often, timeout=60), held_without
        finally:
            busy.kill()
            busy.wait()
        # Whether a take finds the helper inside a group is chance (on a loaded box none
        # of a round's ~35 takes sometimes did): rounds of 100 steps until one has, at most 5.
        stats = {"takes": 0, "waited": 0, "waited_ns": 0, "gave_up": 0}
        held_with = groups = rounds = 0
        while rounds < 5 and not (rounds and stats["waited"] and groups):
            rounds += 1
            lender = _bursts_beside(kernel, core, fd)
            try:
                held, more = _held_steps(kernel, layer, x, 100)
                held_with, groups = held_with + held, groups + more

                def shared() -> bool:   # and until the helper has shared calls, as asserted
                    nonlocal held_with, groups
                    held, more = _held_steps(kernel, layer, x, 10)
                    held_with, groups = held_with + held, groups + more
                    return groups > 0
                assert groups > 0 or _eventually(shared, timeout=60)
            finally:
                lender.terminate()
                for key, n in json.loads(lender.communicate(timeout=30)[0]).items():
                    stats[key] += n
    finally:
        kernel.helper_spin(False)
        os.sched_setaffinity(0, own)
        os.close(fd)
    assert held_with <= 2 * rounds, (held_with, rounds, stats)
    # waits ran out only where something else preempted the helper inside a group
    assert stats["takes"] >= 10 * rounds and stats["waited"] >= 1, stats
    assert stats["gave_up"] <= 2 * rounds, stats


@needs_kernel
def test_a_lender_clears_the_word_of_a_borrower_that_died_inside_a_group(tmp_path):
    """A borrower killed inside a group leaves its word set. The lender waits for it at
    most its limit once, finds the process gone and clears the word, so its later steps
    do not wait; a live borrower's word it leaves alone (that wait ran out)."""
    import struct
    import subprocess
    import sys
    from appliance.engines.cpu_kernels.core_lending import PAGE_BYTES, Lender, LendPage
    kernel = _own_linear(tmp_path)
    fd = os.memfd_create("lend-test")
    os.ftruncate(fd, PAGE_BYTES)
    page = LendPage(fd)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def slot(i: int, busy: int, pid: int) -> None:     # linear_bf16.c's struct lend_line
        page._map[64 * (1 + i):64 * (1 + i) + 8] = struct.pack("<Ii", busy, pid)
    try:
        slot(7, 1, dead.pid)
        lender = Lender(kernel, page, max_ns=1_000_000)
        lender.take()
        assert (lender.stats.waited, lender.stats.gave_up) == (1, 0)
        assert struct.unpack_from("<I", page._map, 64 * 8)[0] == 0
        lender.give()
        lender.take()                                   # nothing to wait for now
        assert lender.stats.waited == 1
        lender.give()
        slot(9, 1, os.getpid())                         # alive: its wait runs out
        lender.take()
        assert (lender.stats.waited, lender.stats.gave_up) == (2, 1)
        assert struct.unpack_from("<I", page._map, 64 * 10)[0] == 1
        lender.give()
    finally:
        os.close(fd)


def test_the_gate_sees_whether_the_lending_worker_runs(tmp_path):
    """`HelperGate.lender_running` finds the lending worker among its sibling processes by
    the spec on their command lines, and tells running from sleeping (/proc/PID/stat): a
    lender spinning is running, one blocked in sleep is not, a worker that is not there
    is not (and is looked for again later)."""
    import subprocess
    import sys
    spec = '--spec {{"worker":"{}","role":"prefill"}}'
    ready = "import sys; print('ready', flush=True)\n"
    lenders = [subprocess.Popen([sys.executable, "-c", ready + code,
                                 *spec.format(name).split(" ", 1)], stdout=subprocess.PIPE)
               for name, code in (("prefill8", "import time; time.sleep(60)"),
                                  ("prefill9", "while True: pass"))]
    # The probe polls until it sees what is asserted (a loaded machine may take a while
    # to put the sleeper to sleep), then prints it; a wrong answer shows after 20 s.
    probe = (
        "import time\n"
        "from appliance.engines.cpu_kernels.helper_gate import HelperGate\n"
        "gates = [HelperGate(None, 0, n) for n in ('prefill8', 'prefill9', 'prefill7')]\n"
        "deadline = time.monotonic() + 20\n"
        "while True:\n"
        "    seen = [g.lender_running() for g in gates]\n"
        "    if seen == [False, True, False] or time.monotonic() > deadline: break\n"
        "    time.sleep(0.01)\n"
        "print(seen, [g._lender_stat != '' for g in gates])\n")
    try:
        for p in lenders:
            assert p.stdout.readline().strip() == b"ready"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    finally:
        for p in lenders:
            p.kill()
            p.wait()
    # both lenders found (the sleeper is found too, not just unknown), the third not
    assert out.strip() == "[False, True, False] [True, True, False]"


def _rope_tables(positions: int, hd: int):
    ang = torch.rand(positions, hd // 2, generator=torch.Generator().manual_seed(hd)) * 6
    cos, sin = ang.cos(), ang.sin()
    return (torch.cat((cos, cos), -1).to(torch.bfloat16),
            torch.cat((-sin, sin), -1).to(torch.bfloat16))


def _mostly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare elements one bf16 step apart (a sum's order, exp's last ulp)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    assert (got != want).float().mean().item() < 0.001
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -9)


@needs_kernel
@pytest.mark.parametrize("rows,width", [(1, 768), (5, 2048), (33, 40), (3, 17)])
def test_layer_glue_matches_the_torch_ops_it_replaces(glue, rows, width):
    """Residual add + RMSNorm against `layers.glue`'s eager functions, Qwen3's per-head
    norm against `layers.norm`'s, and SwiGLU's activation against `DenseMLP`'s ops: equal
    element for element but for a rare last step (the norm's sum and exp run in another
    order), on widths that are and are not multiples of 16."""
    from appliance.engines.layers.glue import eager_glue
    g = torch.Generator().manual_seed(rows * width)
    h = (3 * torch.randn(rows, width, generator=g)).to(torch.bfloat16)
    delta = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(width, generator=g)).to(torch.bfloat16)
    want_h, want_x = eager_glue().add_rms_norm(h, delta, w, 1e-5)
    got_h, got_x = glue.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(got_h, want_h)                   # one bf16 add: exact
    _mostly_equal(got_x, want_x)
    _mostly_equal(glue.rms_norm(h, w, 1e-6), eager_glue().rms_norm(h, w, 1e-6))
    gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    _mostly_equal(glue.silu_mul(gate_up), torch.nn.functional.silu(gate).mul_(up))
    from appliance.engines.layers.norm import head_rms_norm_
    hd = {768: 64, 2048: 128, 40: 48, 17: 16}[width]
    qkv = torch.randn(rows, 7, hd, generator=g).to(torch.bfloat16)
    qw = (1 + 0.1 * torch.randn(hd, generator=g)).to(torch.bfloat16)
    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    head_rms_norm_(want_qkv[:, 1:5], qw, 1e-6)
    glue.head_rms_norm_(got_qkv, 1, 4, qw, 1e-6)
    _mostly_equal(got_qkv, want_qkv)
    assert torch.equal(got_qkv[:, [0, 5, 6]], qkv[:, [0, 5, 6]])    # other heads untouched
    with pytest.raises(ValueError, match="not in 7"):
        glue.head_rms_norm_(got_qkv, 4, 4, qw, 1e-6)
    with pytest.raises(ValueError, match="contiguous CPU bfloat16"):
        glue.rms_norm(h.float(), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous CPU bfloat16"):
        glue.add_rms_norm(h, delta, w[:-1], 1e-6)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,hd", [(12, 4, 64), (4, 4, 16), (8, 1, 128), (2, 1, 48)])
def test_rope_kernel_rotates_and_writes_the_cache_as_the_forward_does(glue, heads, kv_heads, hd):
    """RoPE on q and k with the K/V write against the forward's torch ops (`mul_`,
    `addcmul_`, `index_copy_`): the same bits; a position or slot out of range is refused
    before anything is written."""
    T, slots_n = 5, 40
    cos, sin = _rope_tables(4096, hd)
    g = torch.Generator().manual_seed(heads + hd)
    qkv = torch.randn(T, heads + 2 * kv_heads, hd, generator=g).to(torch.bfloat16)
    positions = torch.tensor([0, 7, 4095, 300, 300])
    slots = torch.tensor([3, 0, 39, 17, 18])
    want = qkv.clone()
    qk = want[:, :heads + kv_heads]
    swapped = qk.view(T, heads + kv_heads, 2, hd // 2).flip(2).view(T, heads + kv_heads, hd)
    qk.mul_(cos[positions].unsqueeze(1)).addcmul_(swapped, sin[positions].unsqueeze(1))
    want_k = torch.zeros(slots_n, kv_heads, hd, dtype=torch.bfloat16)
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
            glue.rope_kv(qkv, heads, kv_heads, cos, sin, torch.as_tensor(pos), torch.as_tensor(slot),
                         torch.zeros_like(want_k), torch.zeros_like(want_v))
        assert torch.equal(qkv, before)
    with pytest.raises(ValueError, match="heads"):
        glue.rope_kv(qkv, heads + 1, kv_heads, cos, sin, positions)


def _tiny_qwen3(path):
    """A random tiny Qwen3 (q/k norms) saved by transformers, with norm weights not 1."""
    transformers = pytest.importorskip("transformers")
    cls, cfg, _ = bf16_parity.qwen3(transformers)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape))
    model.save_pretrained(path, safe_serialization=True)
    return path


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_steps_through_the_glue_kernel_keep_torchs_logits(glue, tiny_model, tmp_path,
                                                                 family):
    """A bf16 model's prompt and decode steps with and without the glue kernel (the
    generated Llama; a Qwen3, whose q/k norms it also takes): the same greedy tokens, and
    logits within bf16 rounding; Gemma's forward refuses it."""
    from appliance.engines.models.gemma3 import Gemma3Model
    where = tiny_model if family == "llama" else _tiny_qwen3(tmp_path / "qwen3")
    model = load_model(where, dtype=torch.bfloat16)
    calls = []

    class Counting:
        def __getattr__(self, name):
            fn = getattr(glue, name)
            if not callable(fn):        # DTYPE
                return fn

            def counted(*a, **k):
                calls.append(name)
                return fn(*a, **k)
            return counted
    runs = {}
    for name, k in (("torch", None), ("kernel", Counting())):
        assert model.set_glue_kernel(k)
        kv = allocate_kv_pool(model.shape, 8, 16, dtype=torch.bfloat16)
        prompt = list(range(3, 23))
        batch = AttnBatch(True, [len(prompt)], [len(prompt)], [[5, 2]],
                          torch.tensor([5 * 16 + p if p < 16 else 2 * 16 + p - 16
                                        for p in range(len(prompt))]))
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)), batch, kv)
        assert (calls != []) is (k is not None)         # the prompt went through it too
        seq, out = list(prompt), [logits[0]]
        for _ in range(6):
            seq.append(int(logits[0].argmax()))
            p = len(seq) - 1
            table = [5, 2, 7]
            batch = AttnBatch(False, [1], [len(seq)], [table],
                              torch.tensor([table[p // 16] * 16 + p % 16]))
            logits = model(torch.tensor([seq[-1]]), torch.tensor([p]), batch, kv)
            out.append(logits[0])
        runs[name] = (seq, torch.stack(out))
        if k is not None:
            assert {"rope_kv", "add_rms_norm", "rms_norm", "silu_mul"} <= set(calls)
            assert ("head_rms_norm_" in calls) is (family == "qwen3")
    assert runs["kernel"][0] == runs["torch"][0]
    torch.testing.assert_close(runs["kernel"][1], runs["torch"][1], rtol=0.0,
                               atol=0.02 * float(runs["torch"][1].abs().max()))
    assert not Gemma3Model.set_glue_kernel(model, glue)
    assert model.set_glue_kernel(None) and model.glue_kernel is None


def _tiny_qwen2(path):
    """A random tiny Qwen2 (biases on q, k and v) saved by transformers."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=bf16_parity.VOCAB, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, use_sliding_window=False)
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape))
    model.save_pretrained(path, safe_serialization=True)
    return path


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_decode_layers_in_one_call_match_the_kernels_called_one_by_one(
        kernel, linear, glue, tiny_model, tmp_path, family, monkeypatch):
    """Decode steps of three sequences of different lengths with every layer in one C
    call (`cpu_kernels.DecodeLayers`) and with the kernels called one by one from the
    forward: the same logits and the same KV pool bit for bit (a Qwen3's q/k norms and a
    Qwen2's q/k/v biases included). Prompts never take the one call, and a model it does
    not fit is refused. With the decode kernel, no step builds torch's decode groups."""
    where = {"llama": tiny_model, "qwen3": _tiny_qwen3, "qwen2": _tiny_qwen2}[family]
    model = load_model(where if family == "llama" else where(tmp_path / family),
                       dtype=torch.bfloat16)
    assert model.set_decode_layers(None)
    one = cpu_kernels.load_decode_layers(str(tmp_path / "kernels"))
    one.bind(linear, kernel, glue)
    assert model.attn.set_decode_kernel(kernel)
    assert not model.set_decode_layers(one)             # no glue kernel yet
    assert model.set_glue_kernel(glue)
    assert not model.set_decode_layers(one)             # matmuls not on the kernel yet
    for layer in dense_linears(model):
        assert layer.use_kernel(linear)
    assert model.set_decode_layers(one)
    calls = []
    fn = one._fn
    one._fn = lambda *a: calls.append(1) or fn(*a)
    grouped = []
    groups = attention._decode_groups
    monkeypatch.setattr(attention, "_decode_groups", lambda *a: grouped.append(1) or groups(*a))
    bs = 16
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    kv = allocate_kv_pool(model.shape, 12, bs, dtype=torch.bfloat16)
    seqs = []
    for n, table in zip((20, 5, 33), tables):
        prompt = [3 + (7 * i) % 50 for i in range(n)]
        slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
        logits = model(torch.tensor(prompt), torch.arange(n),
                       AttnBatch(True, [n], [n], [table], slots), kv)
        seqs.append(prompt + [int(logits[0].argmax())])
    assert calls == []                                  # prompts: one by one
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
    assert len(calls) == 5 and grouped == []
    assert torch.equal(pools["one call"], pools["one by one"])
    assert model.set_decode_layers(None) and model.decode_layers is None


def _one_call_model_with_helper(kernel, glue, tiny_model, tmp_path):
    """(matmul kernel of this test's own with its helper started on the last core, that
    core, the tiny model in bf16 with its decode steps in one call through them)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the helper needs a second core")
    linear = _own_linear(tmp_path / "linear")
    core = sorted(os.sched_getaffinity(0))[-1]
    assert linear.start_helper(core)
    _wait_for_helper(linear)
    model = load_model(tiny_model, dtype=torch.bfloat16)
    one = cpu_kernels.DecodeLayers(kernel_build.build("decode_layers", tmp_path / "layers"))
    one.bind(linear, kernel, glue)
    assert model.attn.set_decode_kernel(kernel) and model.set_glue_kernel(glue)
    for layer in dense_linears(model):
        assert layer.use_kernel(linear)
    assert model.set_decode_layers(one)
    return linear, core, model


class _Batch:
    """B sequences of the given prompt lengths prefilled into a pool (blocks of 16 in a
    shuffled order, room for `steps` more tokens), then decoded greedily on two copies of
    the pool: with the helper lent each step and without, which must agree bit for bit."""

    def __init__(self, model, lens: list[int], rng: random.Random, steps: int = 40):
        bs = 16
        blocks = [-(-(n + steps) // bs) for n in lens]
        ids = list(range(1, sum(blocks) + 1))
        rng.shuffle(ids)
        self.model, self.bs, self.tables, at = model, bs, [], 0
        for k in blocks:
            self.tables.append(ids[at:at + k])
            at += k
        kv = allocate_kv_pool(model.shape, len(ids) + 1, bs, dtype=torch.bfloat16)
        self.seqs = []
        for n, table in zip(lens, self.tables):
            prompt = [rng.randrange(3, 60) for _ in range(n)]
            slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
            logits = model(torch.tensor(prompt), torch.arange(n),
                           AttnBatch(True, [n], [n], [table], slots), kv)
            self.seqs.append(prompt + [int(logits[0].argmax())])
        self.pools = {"alone": kv, "shared": kv.clone()}

    def step(self, linear, name: str) -> torch.Tensor:
        bs, B = self.bs, len(self.seqs)
        pos = [len(seq) - 1 for seq in self.seqs]
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(self.tables, pos)])
        linear.helper_spin(name == "shared")
        batch = AttnBatch(False, [1] * B, [len(seq) for seq in self.seqs], self.tables, slots)
        try:
            return self.model(torch.tensor([seq[-1] for seq in self.seqs]), torch.tensor(pos),
                              batch, self.pools[name])
        finally:
            linear.helper_spin(False)

    def both(self, linear) -> None:
        """One step each way: the same logits; each sequence takes its greedy token."""
        alone, shared = self.step(linear, "alone"), self.step(linear, "shared")
        assert torch.equal(shared, alone), len(self.seqs)
        for seq, row in zip(self.seqs, alone):
            seq.append(int(row.argmax()))


@needs_kernel
def test_decode_layers_share_the_attention_with_the_helper_and_keep_every_bit(
        kernel, glue, tiny_model, tmp_path):
    """With the matmul kernel's helper thread lent the step, the one-call decode layers
    split each layer's attention by sequences between the two threads
    (`linear_bf16_parallel`): logits and KV pool equal the one-thread step's bit for bit,
    at batches of 2, 5, 17 and 40 sequences (runs of one, two and three sequences an item,
    a short last one), contexts from 1 to 300; the helper did take part."""
    linear, _, model = _one_call_model_with_helper(kernel, glue, tiny_model, tmp_path)
    rng = random.Random(3)
    for B in (2, 5, 17, 40):
        batch = _Batch(model, [rng.choice((1, 7, 16, 33, 120, 300)) for _ in range(B)], rng)
        for _ in range(4):
            batch.both(linear)
        assert torch.equal(batch.pools["shared"], batch.pools["alone"]), B

    # Whether the helper takes an item depends on its core being free: on a loaded box
    # keep stepping until it has.
    def took_attention() -> bool:
        batch.step(linear, "shared")
        return linear.helper_items() > 0
    assert _eventually(took_attention), "the helper thread never took a sequence"


@needs_kernel
def test_a_step_takes_back_what_a_preempted_helper_holds_and_keeps_every_bit(
        kernel, glue, tiny_model, tmp_path):
    """A process on the helper's core in bursts of 1 ms, 2 ms apart (as a load generator
    or the daemon wakes there), not handing the core back: the helper (at SCHED_IDLE) is
    preempted inside weight groups and attention items, and the one-call step takes them
    back and computes them itself rather than wait (linear_bf16.c, "Taking a group
    back"). The helper's late copies are dropped: logits and KV pool still equal the
    one-thread step's bit for bit, step after step."""
    linear, core, model = _one_call_model_with_helper(kernel, glue, tiny_model, tmp_path)
    rng = random.Random(5)
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, own - {core})       # the caller off the helper's core
    busy = _bursts_beside(linear, core, burst=0.001)
    batches = []
    try:
        def took_back() -> bool:
            # on a loaded box the helper may hardly run (nor be held up): batches of 40
            # steps until one is taken back, each checked bit for bit
            batch = _Batch(model, [rng.choice((20, 90, 300)) for _ in range(17)], rng, steps=50)
            batches.append(batch)
            for _ in range(40):
                batch.both(linear)
                if linear.helper_steals() > 0:
                    return True
            return False
        assert _eventually(took_back, timeout=90), "no step took a group back"
        for _ in range(5):
            batches[-1].both(linear)
    finally:
        busy.kill()
        busy.wait()
        os.sched_setaffinity(0, own)
    for batch in batches:
        assert torch.equal(batch.pools["shared"], batch.pools["alone"])


def test_weights_for_the_matmul_kernel_are_advised_for_huge_pages():
    """`huge_page_empty`: 64-byte aligned slices of one mapping advised MADV_HUGEPAGE (the
    `hg` flag of /proc/self/smaps), writable, and kept apart."""
    import mmap
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    a = cpu_kernels.huge_page_empty(3 << 20, torch.bfloat16)
    b = cpu_kernels.huge_page_empty(100, torch.bfloat16)
    assert a.numel() == 3 << 20 and b.numel() == 100
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() * 2     # not overlapping
    a.fill_(1.5)
    b.fill_(-2)
    assert float(a.float().sum()) == 1.5 * (3 << 20) and float(b.float().sum()) == -200
    flags = vm_flags(a.data_ptr())
    assert flags is not None and " hg" in flags, flags


def test_build_is_cached_per_source_and_says_why_it_cannot(tmp_path, monkeypatch):
    if kernel_build.compiler() is None or not _has_avx512():
        pytest.skip("needs a C compiler and AVX-512F")
    first = kernel_build.build("paged_decode", tmp_path / "k")
    mtime = first.stat().st_mtime_ns
    assert kernel_build.build("paged_decode", tmp_path / "k") == first
    assert first.stat().st_mtime_ns == mtime                  # not compiled again
    assert [p.name for p in (tmp_path / "k").iterdir()] == [first.name]   # no temp left
    # Another source (here: a copy with a comment added) is another library.
    src = tmp_path / "src"
    src.mkdir()
    (src / "paged_decode.c").write_text((kernel_build.SOURCE_DIR / "paged_decode.c").read_text()
                                        + "\n/* changed */\n")
    header = (kernel_build.SOURCE_DIR / "vec_math.h").read_text()
    (src / "vec_math.h").write_text(header)
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", src)
    second = kernel_build.build("paged_decode", tmp_path / "k")
    assert second != first
    # ... and so is another header beside it (what the source includes)
    (src / "vec_math.h").write_text(header + "\n/* changed */\n")
    assert kernel_build.build("paged_decode", tmp_path / "k") not in (first, second)
    # A compiler that fails, and none at all: one line each, nothing left behind.
    (src / "paged_decode.c").write_text("this is not C\n")
    with pytest.raises(cpu_kernels.KernelUnavailable, match="could not build kernel paged_decode: "):
        kernel_build.build("paged_decode", tmp_path / "bad")
    assert list((tmp_path / "bad").iterdir()) == []
    # A cached build that does not load (damaged on disk) is said, removed, and rebuilt.
    monkeypatch.undo()                                      # the real source again
    broken = tmp_path / "broken"
    good = kernel_build.build("paged_decode", broken)
    good.write_bytes(b"not a shared library")
    with pytest.raises(cpu_kernels.KernelUnavailable, match=f"cannot load {good.name}"):
        cpu_kernels.load_paged_decode(str(broken))
    assert not good.exists()
    assert cpu_kernels.load_paged_decode(str(broken)).path == good and good.exists()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert kernel_build.compiler() is None
    with pytest.raises(cpu_kernels.KernelUnavailable, match="no C compiler"):
        kernel_build.build("paged_decode", tmp_path / "none")


def test_worker_uses_the_kernel_or_says_it_cannot(tiny_model, tmp_path, monkeypatch, capfd):
    """A bf16 decode worker (the daemon's spec: cpu_kernels auto) builds the kernels into
    its kernel_dir, attends and multiplies through them (a prefill worker does not decode;
    with AMX, agg and prefill workers leave prompts' matmuls to oneDNN); with
    no compiler, or with more than one thread, it says so in one line and serves on
    torch's path; `off`, and prefill workers, never build them."""
    from appliance.engines import dtypes
    can_build = kernel_build.compiler() is not None and _has_avx512()   # before the patch
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))

    def spec(role: str, kernels: str, where: str, threads: int = 1,
             helper: int = -1) -> WorkerSpec:
        return WorkerSpec(worker=f"{role}0", role=role, engine="torch", devices=["cpu"],
                          device_kind="cpu", model_dir=str(tiny_model), block_size=16,
                          kv_cache_bytes=8 << 20, max_batch_tokens=256, dtype="bfloat16",
                          cpu_kernels=kernels, kernel_dir=str(tmp_path / where),
                          cpu_threads=threads, cpu_helper_core=helper)
    if can_build:
        e = build_torch_engine(spec("decode", "auto", "a"), tiny_model)
        assert e.helper_gate is None
        core = sorted(os.sched_getaffinity(0))[0]
        g = build_torch_engine(spec("decode", "auto", "h", helper=core), tiny_model)
        assert g.helper_gate is not None and g.helper_gate.cpu == core
        assert e.model.attn.decode_kernel is not None
        assert all(layer.pairs is not None and layer.packed is None
                   for layer in dense_linears(e.model))
        assert e.model.attn.prefill_kernel is not None and e.model.glue_kernel is not None
        assert e.model.decode_layers is not None            # decode steps: one call
        assert sorted(p.name.split("-")[0] for p in (tmp_path / "a").iterdir()) == [
            "causal_prefill", "decode_layers", "layer_glue", "linear_bf16", "paged_decode"]
        # an agg worker without AMX: every kernel, its prompts' matmuls too
        e = build_torch_engine(spec("agg", "auto", "a"), tiny_model)
        assert e.model.attn.decode_kernel is not None and e.model.glue_kernel is not None
        assert all(layer.pairs is not None for layer in dense_linears(e.model))
        assert e.model.decode_layers is not None and e.helper_gate is None
        # with AMX, prompts are oneDNN's (its tiles): an agg or prefill worker keeps them
        monkeypatch.setattr(dtypes, "cpu_flags",
                            lambda *a: frozenset({"avx512_bf16", "amx_bf16"}))
        for role in ("agg", "prefill"):
            e = build_torch_engine(spec(role, "auto", "a"), tiny_model)
            assert e.model.glue_kernel is not None and e.model.decode_layers is None
            assert all(layer.pairs is None and layer.packed is not None
                       for layer in dense_linears(e.model))
        # a CPU with AMX whose tiles the kernel cannot use (built without them, or Linux
        # refused them): oneDNN, which has an AMX path, keeps the matmuls, said in one line
        monkeypatch.setattr(cpu_kernels.load_linear_bf16(str(tmp_path / "a")), "amx", False)
        capfd.readouterr()
        e = build_torch_engine(spec("decode", "auto", "a"), tiny_model)
        assert e.model.attn.decode_kernel is not None and e.model.glue_kernel is not None
        assert all(layer.pairs is None and layer.packed is not None
                   for layer in dense_linears(e.model))
        assert [line for line in capfd.readouterr().err.splitlines()
                if "applianced worker" in line] == [
            "applianced worker decode0: decode matmuls on oneDNN (this CPU has AMX, but the "
            "kernel was built without it or Linux did not grant this process the tiles)"]
        monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))
    e = build_torch_engine(spec("decode", "off", "b"), tiny_model)
    assert e.model.attn.decode_kernel is None and e.model.attn.prefill_kernel is None
    assert not (tmp_path / "b").exists()
    if can_build:
        # a prefill worker without AMX: its prompts' attention, glue and matmuls (it never
        # decodes, so no decode attention nor one-call layers)
        e = build_torch_engine(spec("prefill", "auto", "c"), tiny_model)
        assert e.model.attn.prefill_kernel is not None and e.model.attn.decode_kernel is None
        assert e.model.glue_kernel is not None and e.model.decode_layers is None
        assert all(layer.pairs is not None for layer in dense_linears(e.model))
        assert sorted(p.name.split("-")[0] for p in (tmp_path / "c").iterdir()) == [
            "causal_prefill", "layer_glue", "linear_bf16"]
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    capfd.readouterr()
    e = build_torch_engine(spec("decode", "auto", "d"), tiny_model)
    assert e.model.attn.decode_kernel is None
    assert capfd.readouterr().err.strip().splitlines() == [
        "applianced worker decode0: prompt attention on torch's path (no C compiler (cc, gcc "
        "or $CC) on this host)",
        "applianced worker decode0: norms, RoPE and activation on torch's path (no C "
        "compiler (cc, gcc or $CC) on this host)",
        "applianced worker decode0: decode attention on torch's path (no C compiler (cc, gcc "
        "or $CC) on this host)",
        "applianced worker decode0: decode matmuls on oneDNN (no C compiler (cc, gcc or $CC) "
        "on this host)"]
    # More threads than the kernel uses: torch's path, which uses them all.
    try:
        e = build_torch_engine(spec("decode", "auto", "e", threads=2), tiny_model)
        assert e.model.attn.decode_kernel is None and not (tmp_path / "e").exists()
        assert capfd.readouterr().err.strip().splitlines() == [
            "applianced worker decode0: attention, matmuls and norms on torch's path (the C "
            "kernels are single-threaded; this worker has 2 threads)"]
    finally:
        torch.set_num_threads(1)


@needs_kernel
def test_a_bf16_decode_worker_rides_prompts_on_its_decode_steps_in_the_daemon(tmp_path,
                                                                             tiny_model):
    """Bursts of requests on a bf16 disagg daemon (the deep-queue rule out of the way):
    a prompt that would wait behind another on the prefill worker goes to the decode
    worker while it has rows to spare, and rides on its decode steps (/metrics counts the
    decode worker's `mixed` iterations); its request record says it ran there, and every
    answer comes back whole."""
    import asyncio
    import json

    import openai

    from appliance.engines import dtypes
    from helpers.daemons import http, start_daemon
    if not dtypes.cpu_supports(torch.bfloat16, dtypes.cpu_flags()):
        pytest.skip("this CPU has no bf16")
    d = start_daemon(tmp_path, tiny_model, "--engine", "torch", "--log-requests",
                     config='[engine]\ndtype = "bfloat16"\n'
                            "conditional_disagg_queue_tokens = 1000000\n"
                            "cpu_decode_ride_rows = 8\n")      # auto is off on AMX

    async def burst(model: str) -> list:
        client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=60)
        try:
            async def one(i: int):
                # three long answers decode while seven prompts arrive together: one on
                # the prefill worker, the next would wait behind it
                await asyncio.sleep(0 if i < 3 else 0.15)
                return await client.completions.create(
                    model=model, prompt=f"def f{i}(x):" * 8, max_tokens=600 if i < 3 else 40,
                    temperature=0, extra_body={"ignore_eos": True})
            return await asyncio.gather(*(one(i) for i in range(10)))
        finally:
            await client.close()

    def mixed_steps() -> float:
        for line in http("GET", f"{d.url}/metrics")[2].decode().splitlines():
            if line.startswith("applianced_engine_iterations_total{") \
                    and 'worker="decode0"' in line and 'phase="mixed"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    try:
        model = d.status()["model"]
        answers = []
        for _ in range(5):          # bursts until a prompt rode (bounded)
            answers += asyncio.run(burst(model))
            try:        # (the worker's stats reach the daemon every 50 ms)
                d.wait_for(lambda st: mixed_steps() > 0, timeout=2, what="mixed steps")
                break
            except AssertionError:
                continue
        steps = mixed_steps()

        def records() -> list[dict]:
            return [json.loads(line) for line in d.log_text().splitlines()
                    if line.startswith('{"request_id"')]
        # a request's record is written as it ends, after its answer reached the client
        d.wait_for(lambda st: len(records()) >= len(answers), what="every request's record")
        logged = records()
    finally:
        d.stop()
    assert steps > 0
    assert any(r["prefill_worker"] == "decode0" for r in logged)
    assert all(r["status"] == "ok" for r in logged) and len(logged) == len(answers)
    assert sorted({a.usage.completion_tokens for a in answers}) == [40, 600]
    assert len(answers) % 10 == 0


@needs_kernel
def test_daemon_builds_the_kernels_into_its_state_and_serves_transformers_tokens(tmp_path,
                                                                                tiny_model):
    """A bf16 daemon (disagg: prefill and decode workers) builds the kernels into
    <state>/kernels/, and serves with them, as with `cpu_kernels = "off"`, the greedy
    tokens transformers generates in bf16 from the same prompts; so does an agg daemon
    of one-thread workers."""
    from appliance.daemon.tokenizer import ServedTokenizer
    from appliance.engines import dtypes
    from helpers.daemons import http, start_daemon
    transformers = pytest.importorskip("transformers")
    if not dtypes.cpu_supports(torch.bfloat16, dtypes.cpu_flags()):
        pytest.skip("this CPU has no bf16")
    tok = ServedTokenizer(tiny_model)
    prompts = [tok.encode(p) for p in ("def main(", "import os\n", "x = [", "Hello",
                                       "class Parser:\n    def __init__(self")]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.inference_mode():
        want = [tok.decode(ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                        pad_token_id=1)[0, len(ids):].tolist()) for ids in prompts]
    import os
    two_cores = len(os.sched_getaffinity(0)) >= 2

    def greedy(d) -> list[str]:
        client = d.client()
        return [client.completions.create(model=client.models.list().data[0].id, prompt=ids,
                                          max_tokens=24, temperature=0).choices[0].text
                for ids in prompts]
    for kernels in ("auto", "off"):
        # the helper on whatever the CPU ("auto" lends the core only on one with AMX)
        helper = 'cpu_decode_helper = "on"\n' if kernels == "auto" else ""
        d = start_daemon(tmp_path / kernels, tiny_model, "--engine", "torch",
                         config=f'[engine]\ndtype = "bfloat16"\ncpu_kernels = "{kernels}"\n'
                                + helper)
        try:
            got = greedy(d)
            status = d.status()
            if kernels == "auto" and two_cores:     # stats reach the daemon every 50 ms
                status = d.wait_for(lambda st: all(
                    (w["borrowed_core_steps"] or 0) > 0 if w["worker"] == "decode0"
                    else (w["lent_core_steps"] or 0) >= len(prompts)
                    for w in st["workers"]), what="the decode worker's steps on the borrowed "
                    "core, and the prefill worker's taking it back for each prompt")
            workers = {w["worker"]: w for w in status["workers"]}
            metrics = http("GET", f"{d.url}/metrics")[2].decode()
        finally:
            d.stop()
        assert got == want, kernels
        decode, prefill = workers["decode0"], workers["prefill0"]
        if kernels == "auto" and two_cores:
            # the decode worker borrowed the prefill core while prompts were not running
            assert decode["borrowed_core"] == prefill["cpu_cores"][0]
            assert decode["borrowed_core_steps"] > 0, decode
            series = [line for line in metrics.splitlines()
                      if line.startswith("applianced_worker_borrowed_core_steps_total{")]
            assert len(series) == 1 and 'worker="decode0"' in series[0]
            assert float(series[0].rsplit(" ", 1)[1]) >= decode["borrowed_core_steps"] > 0
            # the steps it sat out, by reason, in the status and as one series each
            sat_out = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                       for line in metrics.splitlines()
                       if line.startswith("applianced_worker_unborrowed_core_steps_total{")}
            assert set(sat_out) == {"lender_busy", "core_taken"}, metrics
            assert sat_out["lender_busy"] >= decode["borrowed_core_lender_busy_steps"] >= 0
            assert sat_out["core_taken"] >= decode["borrowed_core_taken_steps"] >= 0
            # groups and items the steps took back from a held-up helper: a count, as a series
            taken_back = [line for line in metrics.splitlines()
                          if line.startswith("applianced_worker_borrowed_core_taken_back_total{")]
            assert len(taken_back) == 1 and 'worker="decode0"' in taken_back[0]
            assert float(taken_back[0].rsplit(" ", 1)[1]) >= decode["borrowed_core_taken_back"] >= 0
            # every decode-worker step went one of the three ways
            assert decode["borrowed_core_steps"] + decode["borrowed_core_lender_busy_steps"] \
                + decode["borrowed_core_taken_steps"] <= decode["iterations"]
            # the prefill worker took its core back before each of its steps
            assert len(prompts) <= prefill["lent_core_steps"] <= prefill["iterations"], prefill
            assert prefill["lent_core_waits"] <= prefill["lent_core_steps"]
        else:
            assert decode["borrowed_core"] is None and decode["borrowed_core_steps"] == 0
            assert decode["borrowed_core_lender_busy_steps"] == 0
            assert decode["borrowed_core_taken_steps"] == 0
            assert decode["borrowed_core_taken_back"] == 0
            assert prefill["lent_core_steps"] == 0
            assert "applianced_worker_borrowed_core_steps_total{" not in metrics
            assert "applianced_worker_unborrowed_core_steps_total{" not in metrics
            assert "applianced_worker_borrowed_core_taken_back_total{" not in metrics
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "auto" / "state" / "kernels").iterdir())
    assert built == ["causal_prefill", "decode_layers", "layer_glue", "linear_bf16", "paged_decode"]
    assert not (tmp_path / "off" / "state" / "kernels").exists()
    # agg workers of one thread each: every kernel (on a CPU without AMX the matmul
    # kernel takes their prompts too, and decode-only steps run in one call)
    d = start_daemon(tmp_path / "agg", tiny_model, "--engine", "torch", config=(
        '[devices]\nmode = "agg"\n[engine]\ndtype = "bfloat16"\ncpu_threads = 1\n'))
    try:
        got = greedy(d)
        roles = {w["role"] for w in d.status()["workers"]}
    finally:
        d.stop()
    assert roles == {"agg"} and got == want
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "agg" / "state" / "kernels").iterdir())
    assert built == (["causal_prefill", "layer_glue", "paged_decode"]
                     if "amx_bf16" in dtypes.cpu_flags() else
                     ["causal_prefill", "decode_layers", "layer_glue", "linear_bf16", "paged_decode"])
