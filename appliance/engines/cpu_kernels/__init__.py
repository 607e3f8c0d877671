"""C kernels for what torch's CPU build does slowly, loaded through ctypes.

One so far: `PagedDecode`, a decode step's attention read straight from the paged KV pool
in bf16 (paged_decode.c says why and what it computes). The torch path stays the
reference and the fallback: a kernel is only used when `load_paged_decode` could build
and load it, and for the shapes it `supports`.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from appliance.engines.cpu_kernels.builder import KernelUnavailable, build, cache_dir

__all__ = ["KernelUnavailable", "PagedDecode", "load_paged_decode"]

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


_loaded: dict[str, PagedDecode] = {}


def load_paged_decode(directory: str = "") -> PagedDecode:
    """The paged decode kernel, built into `directory` (`builder.cache_dir`) on first use.
    Raises KernelUnavailable (one line) when this host cannot build or load it."""
    where = cache_dir(directory)
    key = str(where)
    if key not in _loaded:
        path = build("paged_decode", where)
        try:
            _loaded[key] = PagedDecode(path)
        except OSError as exc:
            raise KernelUnavailable(f"cannot load {path.name}: {exc}") from None
    return _loaded[key]
