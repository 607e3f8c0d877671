"""C kernels for what torch's CPU build does slowly, loaded through ctypes.

- `PagedDecode`: a decode step's attention read straight from the paged KV pool in bf16
  (paged_decode.c says why and what it computes);
- `LinearBf16`: a bf16 linear layer, its weight stored as the kernel streams it, made for
  a decode step's few rows and used for prompts too where the CPU has no AMX
  (linear_bf16.c);
- `CausalPrefill`: a prompt's causal self-attention in bf16 (causal_prefill.c);
- `LayerGlue`: a step's residual adds with RMSNorms, RoPE with the KV write, SwiGLU's
  activation and Qwen3's q/k norms, each one call (layer_glue.c);
- `DecodeLayers`: a decode step's layers in one call of the three above (decode_layers.c);
- `MoeExperts`: a step's mixture-of-experts SwiGLU experts in one call of the matmul and
  glue kernels (moe_experts.c);
- `LinearF32`, `PagedDecodeF32`, `CausalPrefillF32`, `LayerGlueF32`, `DecodeLayersF32`
  and `MoeExpertsF32`: the same jobs in fp32 on a CPU without AVX-512 (AVX2 and FMA),
  where the kernels above do not build and a worker holds fp32 weights and KV
  (linear_f32.c, paged_decode_f32.c, causal_prefill_f32.c, layer_glue_f32.c,
  decode_layers_f32.c, moe_experts_f32.c).

Torch's ops stay the reference and the fallback: a kernel is only used when it could be
built and loaded here (`load_paged_decode`, `load_linear_bf16`, `load_causal_prefill`),
and for what it `supports`. The wrappers check what they are given (dtype, layout) and
raise ValueError rather than hand a C function memory it would misread.
"""
from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

from appliance.engines.cpu_kernels.builder import KernelUnavailable, build, cache_dir

__all__ = ["CausalPrefill", "CausalPrefillF32", "DecodeLayers", "DecodeLayersF32", "KernelUnavailable",
           "LayerGlue", "LayerGlueF32", "LinearBf16", "LinearF32", "MoeExperts", "MoeExpertsF32",
           "PagedDecodeF32", "load_moe_experts", "load_moe_experts_f32",
           "load_causal_prefill_f32", "load_decode_layers_f32", "load_layer_glue_f32", "load_linear_f32",
           "load_paged_decode_f32",
           "PagedDecode", "huge_page_empty", "huge_page_zeros", "load_causal_prefill",
           "load_decode_layers", "load_layer_glue", "load_linear_bf16", "load_paged_decode"]

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_GROUP = 2              # linear_bf16.c's NT: 16-row blocks read side by side
_HUGE_PAGE = 2 << 20


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D tensor, 64-byte aligned, on memory advised for transparent
    huge pages (`_HugeArena`)."""
    return _arena.take(numel * dtype.itemsize).view(dtype)


class _HugeArena:
    """Memory advised for transparent huge pages, handed out in 64-byte aligned slices.

    Why: a decode step streams every weight once, and on 4 KB pages one core read the 82m
    model's weights ~1.5x slower here than on 2 MB pages (linear_bf16.c). Linux's default
    THP mode is often `madvise`, which leaves ordinary allocations on small pages, so the
    memory is mapped here and advised before it is touched. Weights share chunks: a weight
    alone in its mapping would leave its last partial 2 MB on small pages (half of the 82m
    model's were). Where the advice is not available (not Linux, THP off) the memory is
    plain, as fast as before. Slices are never freed: weights live as long as the worker."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        span = -(-nbytes // 64) * 64    # the next slice starts 64-byte aligned
        if self._chunk is None or self._used + span > self._chunk.numel():
            self._chunk, self._used = self._map(max(self.CHUNK, span)), 0
        out = self._chunk[self._used:self._used + nbytes]
        self._used += span
        return out

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        nbytes = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        # anonymous and private (a shared one is shmem, whose THP setting is separate)
        buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive; not touched yet
        start = -raw.data_ptr() % _HUGE_PAGE
        try:
            buf.madvise(advice, start, nbytes)
        except OSError:     # THP compiled out: small pages
            pass
        return raw[start:start + nbytes]


_arena = _HugeArena()


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D tensor on a fresh mapping of its own, advised for transparent huge
    pages (`_HugeArena._map`). Zero because the kernel hands out zeroed pages; nothing is
    touched here, so memory is only committed as it is written. For a decode worker's
    KV pool: its attention reads each sequence's scattered blocks, which on 4 KB pages took
    one core ~35% longer (`bench/bench_attention_kernel.py --small-pages`)."""
    nbytes = numel * dtype.itemsize
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:   # `_map` would hand out torch.empty
        return torch.zeros(numel, dtype=dtype)
    return _HugeArena._map(nbytes)[:nbytes].view(dtype)


class PagedDecode:
    """``paged_decode_bf16`` of a loaded library (see paged_decode.c for the layout)."""

    MAX_HEADS = 64
    MAX_HEAD_DIM = 256
    DTYPE = torch.bfloat16      # of q, the pools and out
    LANES = 16                  # head_dim a multiple of this
    SYMBOL = "paged_decode_bf16"

    def __init__(self, path: Path):
        self.path = path
        self._fn = getattr(ctypes.CDLL(str(path)), self.SYMBOL)
        self._fn.restype = _I
        self._fn.argtypes = [_P, _P, _P, _P, _L, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float,
                             _P, _L, _P]

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (num_heads <= self.MAX_HEADS and head_dim <= self.MAX_HEAD_DIM
                and head_dim % self.LANES == 0 and num_kv_heads >= 1
                and num_heads % num_kv_heads == 0)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 tables: torch.Tensor, ctx_lens: torch.Tensor, starts: torch.Tensor,
                 scale: float, scratch: torch.Tensor, out: torch.Tensor) -> None:
        """q, out: [B, H, hd] `DTYPE` contiguous; k_pool, v_pool: one layer's
        [blocks, block_size, KVH, hd] `DTYPE` contiguous; tables [B, width] int64;
        ctx_lens, starts [B] int32; scratch: fp32, at least H x the longest span."""
        B, H, hd = q.shape
        d = self.DTYPE
        for name, t, dtype in (("q", q, d), ("k_pool", k_pool, d), ("v_pool", v_pool, d),
                               ("out", out, d),
                               ("tables", tables, torch.int64), ("ctx_lens", ctx_lens, torch.int32),
                               ("starts", starts, torch.int32), ("scratch", scratch, torch.float32)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"paged_decode: {name} must be a contiguous CPU {dtype} tensor")
        if out.shape != q.shape or tables.shape[0] != B or ctx_lens.numel() != B \
                or starts.numel() != B or k_pool.shape != v_pool.shape or k_pool.dim() != 4:
            raise ValueError("paged_decode: shapes disagree")
        rc = self._fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(),
                      tables.shape[1], ctx_lens.data_ptr(), starts.data_ptr(), B, H,
                      k_pool.shape[2], hd, k_pool.shape[1], scale, scratch.data_ptr(),
                      scratch.numel(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"paged_decode: {'scratch too small' if rc == -2 else 'unsupported shape'}"
                             f" (heads {H}, kv heads {k_pool.shape[2]}, head_dim {hd})")


class LinearBf16:
    """``linear_bf16`` of a loaded library: `pack` a weight once, then call with rows."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fn = lib.linear_bf16
        self._fn.restype = _I
        self._fn.argtypes = [_P, _L, _L, _P, _L, _L, _P, _P, _L]
        lib.linear_bf16_amx.restype = _I
        # True: built with AMX and Linux granted this process the tiles, so weights whose
        # K is a multiple of 32 are multiplied on them (linear_bf16.c).
        self.amx = bool(lib.linear_bf16_amx())
        self._start = lib.linear_bf16_helper_start
        self._start.restype, self._start.argtypes = _I, [_I]
        self._spin = lib.linear_bf16_helper_spin
        self._spin.restype, self._spin.argtypes = _I, [_I]
        self._tid = lib.linear_bf16_helper_tid
        self._tid.restype = _I
        self._groups = lib.linear_bf16_helper_groups
        self._groups.restype = _L
        self._asleep = lib.linear_bf16_helper_asleep
        self._asleep.restype = _I
        self._naps = lib.linear_bf16_helper_naps
        self._naps.restype = _L
        self._parallel = lib.linear_bf16_parallel     # for decode_layers.c's attention
        self._steal_begin = lib.linear_bf16_steal_begin     # and its steps' bounds
        self._steal_end = lib.linear_bf16_steal_end
        self._steals = lib.linear_bf16_helper_steals
        self._steals.restype = _L
        self._items = lib.linear_bf16_helper_items
        self._items.restype = _L
        self._held = lib.linear_bf16_helper_held_ns
        self._held.restype = _L
        self._lend = lib.linear_bf16_helper_lend
        self._lend.restype, self._lend.argtypes = _I, [_P, _I]
        self._take = lib.linear_bf16_lender_take
        self._take.restype, self._take.argtypes = _L, [_P, _L]
        self._give = lib.linear_bf16_lender_give
        self._give.argtypes = [_P]

    def start_helper(self, cpu: int) -> bool:
        """A helper thread pinned to `cpu` at SCHED_IDLE that shares each call's weight
        groups while `helper_spin(True)` holds (linear_bf16.c); False when it cannot be
        started."""
        return self._start(cpu) == 0

    def helper_spin(self, on: bool) -> bool:
        """Let the helper take part in calls (waking it), or send it to sleep; True when
        it was asleep."""
        return bool(self._spin(1 if on else 0))

    def helper_tid(self) -> int:
        """The helper's thread id (0 before it runs)."""
        return self._tid()

    def helper_asleep(self) -> bool:
        """Whether the helper is sleeping now (rather than polling for calls)."""
        return bool(self._asleep())

    def helper_naps(self) -> int:
        """How many times the helper has gone to sleep."""
        return self._naps()

    def helper_items(self) -> int:
        """Items of other work (decode_layers.c's attention) the helper has run so far."""
        return self._items()

    def helper_groups(self) -> int:
        """Weight groups (32 output rows of a call) the helper has written so far."""
        return self._groups()

    def helper_steals(self) -> int:
        """Groups and items a one-call decode step took back from a helper held up inside
        them (linear_bf16.c, "Taking a group back"), so far."""
        return self._steals()

    def helper_held_ns(self) -> int:
        """The longest any call waited for the helper's groups since the last ask (ns):
        long when the helper was preempted inside one."""
        return self._held()

    def helper_lend(self, page: int, slot: int) -> bool:
        """Let the core's owner take it back through the shared page at address `page`
        (`core_lending.LendPage`), as borrower `slot`."""
        return self._lend(page, slot) == 0

    def lender_take(self, page: int, max_ns: int) -> int:
        """The core's owner (another process) wants its core: wait until no helper is
        inside a group, at most `max_ns`; the ns waited, -1 when it gave up."""
        return self._take(page, max_ns)

    def lender_give(self, page: int) -> None:
        """The core's owner is done with its core: helpers may claim groups again."""
        self._give(page)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.dim() == 2 and weight.dtype == torch.bfloat16
                and weight.device.type == "cpu" and weight.shape[1] % 2 == 0)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> the kernel's stream (linear_bf16.c, "Layout"), as [ceil(N/16), 16 * K]
        on huge pages: pairs of input columns interleaved across the 32 output rows of
        each group of two 16-row blocks (rows past N are zero)."""
        N, K = weight.shape
        blocks = -(-N // 16)
        out = huge_page_empty(blocks * 16 * K, torch.bfloat16).view(blocks, 16 * K)
        full = blocks - blocks % _GROUP
        if N % 16:
            weight = torch.cat((weight, weight.new_zeros(blocks * 16 - N, K)))
        w = weight.view(blocks, 16, K // 2, 2)
        if full:    # [G, 2, 16, K/2, 2] -> [G, K/2, 2, 16, 2]
            out[:full].view(full // _GROUP, K // 2, _GROUP, 16, 2).copy_(
                w[:full].view(full // _GROUP, _GROUP, 16, K // 2, 2).permute(0, 3, 1, 2, 4))
        if blocks > full:   # a last group of one block
            out[full:].view(K // 2, 16, 2).copy_(w[full].permute(1, 0, 2))
        return out

    @staticmethod
    def unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
        """The [rows, K] weight `pack` was given."""
        blocks, K = packed.shape[0], packed.shape[1] // 16
        full = blocks - blocks % _GROUP
        dense = torch.empty(blocks * 16, K, dtype=packed.dtype).view(blocks * 16, K // 2, 2)
        if full:
            dense[:full * 16].view(full // _GROUP, _GROUP, 16, K // 2, 2).copy_(
                packed[:full].view(full // _GROUP, K // 2, _GROUP, 16, 2).permute(0, 2, 3, 1, 4))
        if blocks > full:
            dense[full * 16:].copy_(packed[full:].view(K // 2, 16, 2).permute(1, 0, 2))
        return dense.view(blocks * 16, K)[:rows].contiguous()

    def __call__(self, packed: torch.Tensor, rows: int, x: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16 -> [..., rows] bf16; `bias`: fp32 [rows] or None."""
        K = packed.shape[1] // 16
        if x.dtype != torch.bfloat16 or x.shape[-1] != K or x.device.type != "cpu":
            raise ValueError(f"linear_bf16: x must be CPU bfloat16 [..., {K}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        x2 = x.reshape(-1, K)
        if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < K):
            x2 = x2.contiguous()
        M = x2.shape[0]
        y = torch.empty(M, rows, dtype=torch.bfloat16)
        if M:
            self._fn(packed.data_ptr(), rows, K, x2.data_ptr(), M, x2.stride(0) if M > 1 else K,
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), rows)
        return y.view(*x.shape[:-1], rows)


class PagedDecodeF32(PagedDecode):
    """``paged_decode_f32`` (paged_decode_f32.c): the same job in fp32 with AVX2 and FMA,
    for a CPU without AVX-512, whose workers hold fp32 KV."""

    DTYPE = torch.float32
    LANES = 8
    SYMBOL = "paged_decode_f32"


class LinearF32:
    """``linear_f32`` of a loaded library (AVX2 and FMA), with `LinearBf16`'s interface.

    The weight is packed into panels of 16 output columns (linear_f32.c says why), on huge
    pages, and every call goes to the kernel: a decode step's rows, and a decode worker's
    own prompts, where it runs about as fast as torch's linear did on the plain weight.
    Measured on an AMD EPYC Zen 3 core, the 82m model's layer weights: 1, 8 and 32 rows in
    22, 36 and 78 ms against oneDNN's packed 29, 50 and 109 (bench/bench_f32_kernels.py)."""

    PANEL = 16
    MAX_K = 64 * 1024

    def __init__(self, path: Path):
        self.path = path
        self._fn = ctypes.CDLL(str(path)).linear_f32
        self._fn.restype = _I
        self._fn.argtypes = [_P, _L, _L, _P, _L, _L, _P, _P, _L]

    @classmethod
    def supports(cls, weight: torch.Tensor) -> bool:
        return (weight.dim() == 2 and weight.dtype == torch.float32
                and weight.device.type == "cpu" and 1 <= weight.shape[1] <= cls.MAX_K)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [ceil(N/16), K, 16] on huge pages, the last panel zero-padded."""
        n, k = weight.shape
        panels = -(-n // cls.PANEL)
        out = huge_page_empty(panels * k * cls.PANEL, torch.float32).view(panels, k, cls.PANEL)
        full = n // cls.PANEL
        if full:
            out[:full].copy_(weight[:full * cls.PANEL].reshape(full, cls.PANEL, k).transpose(1, 2))
        if full < panels:
            out[full].zero_()
            out[full, :, :n - full * cls.PANEL].copy_(weight[full * cls.PANEL:].t())
        return out

    @classmethod
    def unpack(cls, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """The [rows, K] weight `pack` was given (a copy)."""
        panels, k, _ = packed.shape
        return packed.transpose(1, 2).reshape(panels * cls.PANEL, k)[:rows].contiguous()

    def __call__(self, packed: torch.Tensor, rows: int, x: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 -> [..., rows] fp32; `bias`: fp32 [rows] or None."""
        K = packed.shape[1]
        if x.dtype != torch.float32 or x.shape[-1] != K or x.device.type != "cpu":
            raise ValueError(f"linear_f32: x must be CPU float32 [..., {K}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        if x2.stride(1) != 1 or (M > 1 and x2.stride(0) < K):
            x2 = x2.contiguous()
        y = torch.empty(M, rows, dtype=torch.float32)
        if M:
            self._fn(packed.data_ptr(), rows, K, x2.data_ptr(), M, x2.stride(0) if M > 1 else K,
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), rows)
        return y.view(*x.shape[:-1], rows)


class CausalPrefill:
    """``causal_prefill_bf16`` of a loaded library: one prompt, no cached prefix, no window."""

    MAX_HEAD_DIM = 256
    DTYPE = torch.bfloat16      # of q, k, v and out
    SYMBOL = "causal_prefill_bf16"
    SCRATCH = "causal_prefill_scratch"

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fn = getattr(lib, self.SYMBOL)
        self._fn.restype = _I
        self._fn.argtypes = [_P, _L, _P, _P, _L, _L, _I, _I, _I, ctypes.c_float, _P, _P]
        self._scratch_bytes = getattr(lib, self.SCRATCH)
        self._scratch_bytes.restype = _L
        self._scratch_bytes.argtypes = [_L, _I]
        self._amx = getattr(lib, "causal_prefill_amx", None)
        if self._amx is not None:
            self._amx.restype = _I
            self._amx.argtypes = [_I]
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def amx(self, head_dim: int) -> bool:
        """Whether prompts of this head_dim run on AMX's tiles here (causal_prefill.c)."""
        return self._amx is not None and bool(self._amx(head_dim))

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (head_dim <= self.MAX_HEAD_DIM and head_dim % 16 == 0 and num_kv_heads >= 1
                and num_heads % num_kv_heads == 0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q [n, H, hd], k and v [n, KVH, hd], `DTYPE` on the CPU, each row's heads dense
        (rows may be strided, as slices of a fused qkv are); returns [n, H, hd]."""
        n, H, hd = q.shape
        KVH = k.shape[1]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != self.DTYPE or t.device.type != "cpu" or t.dim() != 3 \
                    or t.shape[0] != n or t.shape[2] != hd:
                kind = str(self.DTYPE).removeprefix("torch.")
                raise ValueError(f"causal_prefill: {name} must be CPU {kind} [{n}, heads, "
                                 f"{hd}], got {t.dtype} {tuple(t.shape)}")
        if v.shape[1] != KVH:
            raise ValueError("causal_prefill: k and v differ in heads")
        q, k, v = (t if t.stride(2) == 1 and t.stride(1) == hd else t.contiguous()
                   for t in (q, k, v))
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        need = self._scratch_bytes(n, hd)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need + need // 2, dtype=torch.uint8)
        out = torch.empty(n, H, hd, dtype=self.DTYPE)
        rc = self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), n, H,
                      KVH, hd, scale, self._scratch.data_ptr(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"causal_prefill: unsupported shape (heads {H}, kv heads {KVH}, "
                             f"head_dim {hd})")
        return out


class CausalPrefillF32(CausalPrefill):
    """``causal_prefill_f32`` (causal_prefill_f32.c): the same job in fp32 with AVX2 and FMA,
    for a CPU without AVX-512, whose workers hold fp32 KV."""

    DTYPE = torch.float32
    SYMBOL = "causal_prefill_f32"
    SCRATCH = "causal_prefill_f32_scratch"


class LayerGlue:
    """``layer_glue``'s four functions, for bf16 CPU tensors (layer_glue.c says what each
    computes and how it rounds). Its `rms_norm` and `add_rms_norm` are `layers.glue.Glue`'s,
    so a forward calls it in a Glue's place."""

    DTYPE = torch.bfloat16      # of every tensor but positions and slots
    SUFFIX = "bf16"             # of the library's function names

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._norm = getattr(lib, f"add_rms_norm_{self.SUFFIX}")
        self._norm.restype = None
        self._norm.argtypes = [_P, _P, _P, _L, _L, ctypes.c_float, _P, _P]
        self._rope = getattr(lib, f"rope_kv_{self.SUFFIX}")
        self._rope.restype = _I
        self._rope.argtypes = [_P, _L, _L, _I, _I, _P, _P, _P, _L, _I, _P, _P, _P, _L]
        self._silu = getattr(lib, f"silu_mul_{self.SUFFIX}")
        self._silu.restype = None
        self._silu.argtypes = [_P, _L, _L, _P]
        self._head_norm = getattr(lib, f"head_rms_norm_{self.SUFFIX}")
        self._head_norm.restype = None
        self._head_norm.argtypes = [_P, _L, _L, _I, _I, _P, ctypes.c_float]

    def _rows(self, what: str, t: torch.Tensor, width: int) -> None:
        if (t.dtype != self.DTYPE or t.device.type != "cpu" or not t.is_contiguous()
                or t.shape[-1] != width):
            kind = str(self.DTYPE).removeprefix("torch.")
            raise ValueError(f"layer_glue: {what} must be a contiguous CPU {kind} tensor "
                             f"[..., {width}], got {t.dtype} {tuple(t.shape)}")

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """F.rms_norm(h, weight) of rows."""
        n = weight.numel()
        self._rows("h", h, n)
        self._rows("weight", weight, n)
        x = torch.empty_like(h)
        self._norm(h.data_ptr(), None, weight.data_ptr(), h.numel() // n, n, eps, None,
                   x.data_ptr())
        return x

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, F.rms_norm(h + delta, weight)), as `layers.glue` computes them."""
        n = weight.numel()
        for what, t in (("h", h), ("delta", delta), ("weight", weight)):
            self._rows(what, t, n)
        if delta.shape != h.shape:
            raise ValueError(f"layer_glue: delta {tuple(delta.shape)} is not h's {tuple(h.shape)}")
        out, x = torch.empty_like(h), torch.empty_like(h)
        self._norm(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), h.numel() // n, n, eps,
                   out.data_ptr(), x.data_ptr())
        return out, x

    def rope_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None,
                k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None) -> None:
        """RoPE in place on the q and k heads of `qkv` [T, heads + 2 * kv_heads, hd]
        (the model's `rope_cos`/`rope_sin` tables [positions, hd], `positions` int64 [T]);
        then, given `slots` (int64 [T]) and the layer's caches [slots, kv_heads, hd], its
        K and V written there, as the forward's `index_copy_` does."""
        T, width, hd = qkv.shape
        if width != heads + 2 * kv_heads:
            raise ValueError(f"layer_glue: qkv has {width} heads, not {heads} + 2 x {kv_heads}")
        self._rows("qkv", qkv, hd)
        self._rows("cos", cos, hd)
        self._rows("sin", sin, hd)
        if cos.shape != sin.shape or positions.dtype != torch.int64 or positions.numel() != T \
                or not positions.is_contiguous():
            raise ValueError("layer_glue: cos, sin or positions do not fit qkv")
        caches = (None, None, None, 0)
        if slots is not None:
            if k_cache is None or v_cache is None:
                raise ValueError("layer_glue: slots given without both caches")
            for what, t in (("k_cache", k_cache), ("v_cache", v_cache)):
                self._rows(what, t, hd)
            if slots.dtype != torch.int64 or slots.numel() != T or not slots.is_contiguous() \
                    or k_cache.shape != v_cache.shape or k_cache.shape[-2] != kv_heads:
                raise ValueError("layer_glue: slots or caches do not fit qkv")
            caches = (slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0])
        if self._rope(qkv.data_ptr(), T, width * hd, heads + kv_heads, hd, cos.data_ptr(),
                      sin.data_ptr(), positions.data_ptr(), cos.shape[0], kv_heads, *caches):
            raise ValueError(f"layer_glue: a position past the RoPE table's {cos.shape[0]} "
                             f"rows, or a slot past the cache's {caches[3]}")

    def head_rms_norm_(self, qkv: torch.Tensor, first: int, heads: int, weight: torch.Tensor,
                       eps: float) -> None:
        """`layers.norm.head_rms_norm_` in place on heads first .. first+heads-1 of `qkv`
        [T, all heads, hd] (Qwen3's q and k norms)."""
        T, width, hd = qkv.shape
        self._rows("qkv", qkv, hd)
        self._rows("weight", weight, hd)
        if first < 0 or heads < 0 or first + heads > width:
            raise ValueError(f"layer_glue: heads {first}..{first + heads - 1} not in {width}")
        self._head_norm(qkv.data_ptr() + first * hd * self.DTYPE.itemsize, T, width * hd, heads, hd,
                        weight.data_ptr(), eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of rows [..., 2 * inter] (gate first), as `DenseMLP` computes it."""
        inter = gate_up.shape[-1] // 2
        self._rows("gate_up", gate_up, 2 * inter)
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=self.DTYPE)
        self._silu(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, out.data_ptr())
        return out


class LayerGlueF32(LayerGlue):
    """``layer_glue_f32`` (layer_glue_f32.c): the same four functions for fp32 tensors, with
    AVX2 and FMA, rounding as torch's fp32 ops."""

    DTYPE = torch.float32
    SUFFIX = "f32"


class _Layer(ctypes.Structure):
    """decode_layers.c's layer_t: one layer's weights (addresses; 0 for none)."""
    _fields_ = [(name, _P) for name in (
        "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias",
        "mlp_norm", "next_norm", "q_norm", "k_norm")]


class _Step(ctypes.Structure):
    """decode_layers.c's step_t."""
    _fields_ = [("B", _L), ("D", _L), ("inter", _L), ("H", ctypes.c_int32),
                ("KVH", ctypes.c_int32), ("hd", ctypes.c_int32), ("bs", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos_t", _P),
                ("sin_t", _P), ("table_rows", _L), ("pos", _P), ("slots", _P), ("kv", _P),
                ("layer_elems", _L), ("kv_elems", _L), ("cache_slots", _L), ("tables", _P),
                ("table_stride", _L), ("ctx_lens", _P), ("starts", _P), ("scratch", _P),
                ("scratch_elems", _L), ("h", _P), ("x", _P), ("qkv", _P), ("q", _P),
                ("attn", _P), ("o", _P), ("gu", _P), ("act", _P)]


class DecodeLayers:
    """``decode_layers`` of a loaded library: a decode step's layers in one call, through
    the kernels given to `bind` (decode_layers.c says why and what it runs)."""

    DTYPE = torch.bfloat16      # of the weights, norms, activations and the pool

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._bind = lib.decode_layers_bind
        self._bind.restype = None
        self._bind.argtypes = [_P] * 9
        self._fn = lib.decode_layers
        self._fn.restype = _I
        self._fn.argtypes = [_P, _I, _P]
        self._kernels: tuple = ()
        self._work = torch.empty(0, dtype=self.DTYPE)

    def bind(self, linear, attention: PagedDecode, glue: LayerGlue) -> None:
        """Call these kernels' functions (the ones the forward calls one by one); a matmul
        kernel without a helper thread (`LinearF32`) hands over none."""
        def addr(fn) -> int | None:
            return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None
        helper = [addr(getattr(linear, name, None))
                  for name in ("_parallel", "_steal_begin", "_steal_end")]
        self._bind(addr(linear._fn), addr(attention._fn), addr(glue._norm), addr(glue._rope),
                   addr(glue._silu), addr(glue._head_norm), *helper)
        self._kernels = (linear, attention, glue)   # kept loaded while bound

    @staticmethod
    def layers(weights: list[dict[str, torch.Tensor | None]]) -> ctypes.Array:
        """The layers' weights as decode_layers.c reads them; each dict holds `_Layer`'s
        fields (packed bf16 matmul weights, fp32 biases, bf16 norms; None for none). The
        caller keeps the tensors alive as long as the array is used."""
        arr = (_Layer * len(weights))()
        for layer, w in zip(arr, weights):
            for name, t in w.items():
                if t is not None:
                    if not t.is_contiguous() or t.device.type != "cpu":
                        raise ValueError(f"decode_layers: {name} must be contiguous on the CPU")
                    setattr(layer, name, t.data_ptr())
        return arr

    def __call__(self, layers: ctypes.Array, h: torch.Tensor, x: torch.Tensor, *,
                 heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 scale: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                 ctx_lens: torch.Tensor, starts: torch.Tensor,
                 scratch: torch.Tensor) -> None:
        """Run every layer on the B decode rows of `h` and `x` ([B, D] `DTYPE`, updated in
        place: h the residual stream, x layer 0's normed input); `kv` the pool
        [2, layers, blocks, block_size, kv_heads, head_dim]; the rest as the forward hands
        them to the kernels one by one."""
        B, D = h.shape
        L = len(layers)
        if kv.dim() != 6 or kv.shape[1] != L or kv.shape[4:] != (kv_heads, head_dim) \
                or not kv.is_contiguous() or kv.dtype != self.DTYPE:
            raise ValueError(f"decode_layers: pool {tuple(kv.shape)} does not fit {L} layers")
        for name, t, dtype in (("h", h, self.DTYPE), ("x", x, self.DTYPE),
                               ("positions", positions, torch.int64),
                               ("slots", slots, torch.int64), ("tables", tables, torch.int64),
                               ("ctx_lens", ctx_lens, torch.int32),
                               ("starts", starts, torch.int32), ("scratch", scratch, torch.float32),
                               ("cos", cos, self.DTYPE), ("sin", sin, self.DTYPE)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"decode_layers: {name} must be a contiguous CPU {dtype} tensor")
        if x.shape != h.shape or positions.numel() != B or slots.numel() != B \
                or ctx_lens.numel() != B or starts.numel() != B or tables.shape[0] != B:
            raise ValueError("decode_layers: the step's rows disagree")
        W = (heads + 2 * kv_heads) * head_dim
        Q = heads * head_dim
        sizes = (W, Q, Q, D, 2 * inter, inter)       # qkv, q, attn, o, gu, act per row
        need = B * sum(sizes) + 32 * len(sizes)
        if self._work.numel() < need:
            self._work = torch.empty(need + need // 2, dtype=self.DTYPE)
        ptrs, at = [], self._work.data_ptr()
        for n in sizes:                               # 64-byte aligned slices
            ptrs.append(at)
            at += -(-B * n * self.DTYPE.itemsize // 64) * 64
        layer_elems = kv[0, 0].numel()
        step = _Step(B, D, inter, heads, kv_heads, head_dim, kv.shape[3], eps, scale,
                     cos.data_ptr(), sin.data_ptr(), cos.shape[0], positions.data_ptr(),
                     slots.data_ptr(), kv.data_ptr(), layer_elems, L * layer_elems,
                     kv.shape[2] * kv.shape[3], tables.data_ptr(), tables.shape[1],
                     ctx_lens.data_ptr(), starts.data_ptr(), scratch.data_ptr(),
                     scratch.numel(), h.data_ptr(), x.data_ptr(), *ptrs)
        rc = self._fn(ctypes.addressof(layers), L, ctypes.addressof(step))
        if rc:
            raise ValueError(f"decode_layers: layer {rc - 1} refused the step (a position or "
                             f"slot out of range, or attention it does not take)")


class DecodeLayersF32(DecodeLayers):
    """``decode_layers`` built from decode_layers_f32.c: the same step in fp32, through
    `LinearF32`, `PagedDecodeF32` and `LayerGlueF32`."""

    DTYPE = torch.float32


class MoeExperts:
    """``moe_experts`` of a loaded library: a step's SwiGLU experts in one call through the
    matmul and glue kernels given to `bind` (moe_experts.c says why and how it rounds)."""

    DTYPE = torch.bfloat16      # of x, the experts' packed weights and the output

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._bind = lib.moe_experts_bind
        self._bind.restype = None
        self._bind.argtypes = [_P, _P]
        self._fn = lib.moe_experts
        self._fn.restype = _I
        self._fn.argtypes = [_P, _P, _L, _L, _L, _P, _L, _L, _P, _P, _I, _P, _P, _P, _P, _P]
        lib.moe_experts_work.restype = _L
        lib.moe_experts_work.argtypes = [_L, _L]
        self._work_elems = lib.moe_experts_work
        self._kernels: tuple = ()

    def bind(self, linear, glue) -> None:
        """Multiply through `linear`'s function and activate through `glue`'s (the kernels
        the experts' `Linear`s and the dense MLP use)."""
        self._bind(ctypes.cast(linear._fn, ctypes.c_void_p).value,
                   ctypes.cast(glue._silu, ctypes.c_void_p).value)
        self._kernels = (linear, glue)      # kept loaded while bound

    @staticmethod
    def experts(packed: list[torch.Tensor]) -> ctypes.Array:
        """The experts' packed weights as the array of addresses moe_experts reads; the
        caller keeps the tensors alive as long as the array is used."""
        arr = (_P * len(packed))()
        for i, t in enumerate(packed):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("moe_experts: packed expert weights must be contiguous on the CPU")
            arr[i] = t.data_ptr()
        return arr

    def __call__(self, gate_up: ctypes.Array, down: ctypes.Array, hidden: int, inter: int,
                 x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] `DTYPE`; experts [T, k] ids; weights [T, k] fp32 or `DTYPE` ->
        [T, hidden]: each token's k experts' outputs, weighed and summed."""
        E = len(gate_up)
        if len(down) != E:
            raise ValueError(f"moe_experts: {E} gate/up and {len(down)} down weights")
        if x.dtype != self.DTYPE or x.dim() != 2 or x.shape[1] != hidden or x.device.type != "cpu":
            raise ValueError(f"moe_experts: x must be CPU {self.DTYPE} [T, {hidden}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        if weights.dtype not in (torch.float32, self.DTYPE) or weights.shape != experts.shape \
                or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
            raise ValueError("moe_experts: weights and experts must both be [T, k]")
        x = x.contiguous()
        experts = experts.to(torch.int64).contiguous()
        weights = weights.contiguous()
        T, k = experts.shape
        out = torch.empty_like(x)
        if T == 0:
            return out
        work = torch.empty(self._work_elems(hidden, inter), dtype=self.DTYPE)
        acc = torch.empty(T * hidden if self.DTYPE != torch.float32 else 0, dtype=torch.float32)
        order = torch.empty(T * k, dtype=torch.int32)
        starts = torch.empty(2 * (E + 1), dtype=torch.int64)
        rc = self._fn(ctypes.addressof(gate_up), ctypes.addressof(down), E, hidden, inter,
                      x.data_ptr(), T, k, experts.data_ptr(), weights.data_ptr(),
                      int(weights.dtype == torch.float32), out.data_ptr(), work.data_ptr(),
                      acc.data_ptr(), order.data_ptr(), starts.data_ptr())
        if rc:
            raise ValueError(f"moe_experts: refused the step (code {rc}: an expert id out of "
                             f"range, or a matmul the kernel does not take)")
        return out


class MoeExpertsF32(MoeExperts):
    """``moe_experts`` built from moe_experts_f32.c: the same in fp32, through `LinearF32`
    and `LayerGlueF32`."""

    DTYPE = torch.float32


_loaded: dict[tuple[str, str], object] = {}


def _load(name: str, cls, directory: str):
    where = cache_dir(directory)
    key = (name, str(where))
    if key not in _loaded:
        path = build(name, where)
        try:
            _loaded[key] = cls(path)
        except (OSError, AttributeError) as exc:    # not a library, or not this kernel's
            path.unlink(missing_ok=True)            # so the next start builds it again
            raise KernelUnavailable(f"cannot load {path.name}: {exc}") from None
    return _loaded[key]


def load_paged_decode(directory: str = "") -> PagedDecode:
    """The paged decode kernel, built into `directory` (`builder.cache_dir`) on first use.
    Raises KernelUnavailable (one line) when this host cannot build or load it."""
    return _load("paged_decode", PagedDecode, directory)


def load_causal_prefill(directory: str = "") -> CausalPrefill:
    """The prompt attention kernel, as `load_paged_decode` (it also needs AVX512-BF16)."""
    return _load("causal_prefill", CausalPrefill, directory)


def load_linear_bf16(directory: str = "") -> LinearBf16:
    """The bf16 linear kernel, as `load_paged_decode` (it also needs AVX512-BF16)."""
    return _load("linear_bf16", LinearBf16, directory)


def load_paged_decode_f32(directory: str = "") -> PagedDecodeF32:
    """The fp32 paged decode kernel, as `load_paged_decode` (it needs AVX2 and FMA)."""
    return _load("paged_decode_f32", PagedDecodeF32, directory)


def load_linear_f32(directory: str = "") -> LinearF32:
    """The fp32 linear kernel, as `load_paged_decode` (it needs AVX2 and FMA)."""
    return _load("linear_f32", LinearF32, directory)


def load_layer_glue(directory: str = "") -> LayerGlue:
    """A step's elementwise kernels, as `load_paged_decode` (AVX-512F)."""
    return _load("layer_glue", LayerGlue, directory)


def load_decode_layers(directory: str = "") -> DecodeLayers:
    """The one-call decode layers, built from decode_layers.c if needed."""
    return _load("decode_layers", DecodeLayers, directory)


def load_causal_prefill_f32(directory: str = "") -> CausalPrefillF32:
    """The prompt attention kernel in fp32, as `load_paged_decode` (AVX2 and FMA)."""
    return _load("causal_prefill_f32", CausalPrefillF32, directory)


def load_layer_glue_f32(directory: str = "") -> LayerGlueF32:
    """A step's elementwise kernels in fp32, as `load_paged_decode` (AVX2 and FMA)."""
    return _load("layer_glue_f32", LayerGlueF32, directory)


def load_decode_layers_f32(directory: str = "") -> DecodeLayersF32:
    """The one-call decode layers in fp32, built from decode_layers_f32.c if needed."""
    return _load("decode_layers_f32", DecodeLayersF32, directory)


def load_moe_experts(directory: str = "") -> MoeExperts:
    """A step's mixture-of-experts experts in one call, built from moe_experts.c if needed
    (AVX-512F)."""
    return _load("moe_experts", MoeExperts, directory)


def load_moe_experts_f32(directory: str = "") -> MoeExpertsF32:
    """The same in fp32, built from moe_experts_f32.c if needed (AVX2 and FMA)."""
    return _load("moe_experts_f32", MoeExpertsF32, directory)
