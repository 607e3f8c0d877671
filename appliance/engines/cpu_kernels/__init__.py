"""C kernels for what torch's CPU build does slowly, loaded through ctypes.

- `PagedDecode`: a decode step's attention read straight from the paged KV pool in bf16
  (paged_decode.c says why and what it computes);
- `LinearBf16`: a bf16 linear layer for a decode step's few rows, its weight stored as
  the kernel streams it (linear_bf16.c);
- `CausalPrefill`: a prompt's causal self-attention in bf16 (causal_prefill.c).

Torch's ops stay the reference and the fallback: a kernel is only used when it could be
built and loaded here (`load_paged_decode`, `load_linear_bf16`, `load_causal_prefill`),
and for what it `supports`.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from appliance.engines.cpu_kernels.builder import KernelUnavailable, build, cache_dir

__all__ = ["CausalPrefill", "KernelUnavailable", "LinearBf16", "PagedDecode",
           "load_causal_prefill", "load_linear_bf16", "load_paged_decode"]

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class PagedDecode:
    """``paged_decode_bf16`` of a loaded library (see paged_decode.c for the layout)."""

    MAX_HEADS = 64
    MAX_HEAD_DIM = 256

    def __init__(self, path: Path):
        self.path = path
        self._fn = ctypes.CDLL(str(path)).paged_decode_bf16
        self._fn.restype = _I
        self._fn.argtypes = [_P, _P, _P, _P, _L, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float,
                             _P, _L, _P]

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (num_heads <= self.MAX_HEADS and head_dim <= self.MAX_HEAD_DIM
                and head_dim % 16 == 0 and num_kv_heads >= 1 and num_heads % num_kv_heads == 0)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 tables: torch.Tensor, ctx_lens: torch.Tensor, starts: torch.Tensor,
                 scale: float, scratch: torch.Tensor, out: torch.Tensor) -> None:
        """q, out: [B, H, hd] bf16 contiguous; k_pool, v_pool: one layer's
        [blocks, block_size, KVH, hd] bf16 contiguous; tables [B, width] int64;
        ctx_lens, starts [B] int32; scratch: fp32, at least H x the longest span."""
        B, H, hd = q.shape
        for name, t, dtype in (("q", q, torch.bfloat16), ("k_pool", k_pool, torch.bfloat16),
                               ("v_pool", v_pool, torch.bfloat16), ("out", out, torch.bfloat16),
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
        self._fn = ctypes.CDLL(str(path)).linear_bf16
        self._fn.restype = _I
        self._fn.argtypes = [_P, _L, _L, _P, _L, _L, _P, _P, _L]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.dim() == 2 and weight.dtype == torch.bfloat16
                and weight.device.type == "cpu" and weight.shape[1] % 2 == 0)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [ceil(N/16), K/2, 16, 2]: pairs of input columns interleaved across
        16 output rows (rows past N are zero)."""
        N, K = weight.shape
        pad = -N % 16
        if pad:
            weight = torch.cat((weight, weight.new_zeros(pad, K)))
        return weight.view(-1, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()

    @staticmethod
    def unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
        """The [rows, K] weight `pack` was given."""
        blocks, half, _, _ = packed.shape
        return packed.permute(0, 2, 1, 3).reshape(blocks * 16, half * 2)[:rows].contiguous()

    def __call__(self, packed: torch.Tensor, rows: int, x: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] bf16 -> [..., rows] bf16; `bias`: fp32 [rows] or None."""
        K = packed.shape[1] * 2
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


class CausalPrefill:
    """``causal_prefill_bf16`` of a loaded library: one prompt, no cached prefix, no window."""

    MAX_HEAD_DIM = 256

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fn = lib.causal_prefill_bf16
        self._fn.restype = _I
        self._fn.argtypes = [_P, _L, _P, _P, _L, _L, _I, _I, _I, ctypes.c_float, _P, _P]
        self._scratch_bytes = lib.causal_prefill_scratch
        self._scratch_bytes.restype = _L
        self._scratch_bytes.argtypes = [_L, _I]
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (head_dim <= self.MAX_HEAD_DIM and head_dim % 16 == 0 and num_kv_heads >= 1
                and num_heads % num_kv_heads == 0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q [n, H, hd], k and v [n, KVH, hd], bf16 on the CPU, each row's heads dense
        (rows may be strided, as slices of a fused qkv are); returns [n, H, hd]."""
        n, H, hd = q.shape
        KVH = k.shape[1]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 3 \
                    or t.shape[0] != n or t.shape[2] != hd:
                raise ValueError(f"causal_prefill: {name} must be CPU bfloat16 [{n}, heads, "
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
        out = torch.empty(n, H, hd, dtype=torch.bfloat16)
        rc = self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), n, H,
                      KVH, hd, scale, self._scratch.data_ptr(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"causal_prefill: unsupported shape (heads {H}, kv heads {KVH}, "
                             f"head_dim {hd})")
        return out


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
