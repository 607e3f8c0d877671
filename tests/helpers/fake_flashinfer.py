"""A stand-in for the `flashinfer` package, for CPU tests of the paged-attention wiring.

Same names, signatures and semantics as FlashInfer's Python API (flashinfer-ai/flashinfer
@ fb28d724, flashinfer/prefill.py and decode.py; docs.flashinfer.ai "KV-Cache Layout"):

- `BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", ...)`;
  `.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
  num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
  packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", ..., q_data_type=
  "float16", kv_data_type=None, ...)`; `.run(q, paged_kv_cache, *args, ...)` with q
  ``[qo_indptr[-1], num_qo_heads, head_dim]`` and the cache a ``(k_cache, v_cache)`` tuple
  of ``[max_num_pages, page_size, num_kv_heads, head_dim]`` (NHD).
- `BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", ...)`;
  `.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  *deprecated_positional_args, **kwargs)`; `.run(q, paged_kv_cache, ...)`, q ``[batch,
  num_qo_heads, head_dim]``.
- indptr/indices/last_page_len are int32 (the docs: int64 "can cause indexing errors");
  ``1 <= last_page_len <= page_size``; kv_len = page_size * (pages - 1) + last_page_len;
  the causal mask is ``tril(ones(qo_len, kv_len), diagonal=kv_len - qo_len)``; GQA when
  num_qo_heads is a multiple of num_kv_heads; sm_scale defaults to 1/sqrt(head_dim).

The attention itself is computed plainly in fp32 on whatever device the tensors are on.
"""
from __future__ import annotations

import math
import types
from typing import Any, Optional, Tuple, Union

import torch

__version__ = "0.0.0+fake"
calls: list[tuple[str, dict]] = []


def _canon(dtype: Union[str, torch.dtype]) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _int32(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', t)}")


class _Paged:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD"):
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"Invalid kv_layout {kv_layout}")
        if float_workspace_buffer.dtype != torch.uint8:
            raise ValueError("workspace buffer must be uint8")
        self._kv_layout = kv_layout
        self._planned = False

    def _set(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, q_data_type, kv_data_type, causal, sm_scale):
        for name, t in (("indptr", indptr), ("indices", indices),
                        ("last_page_len", last_page_len)):
            _int32(name, t)
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if len(indptr) != len(last_page_len) + 1 or int(indptr[-1]) != len(indices):
            raise ValueError("indptr / indices / last_page_len disagree")
        if ((last_page_len < 1) | (last_page_len > page_size)).any():
            raise ValueError("last_page_len must be in [1, page_size]")
        self._indptr, self._indices, self._last = indptr.tolist(), indices.tolist(), \
            last_page_len.tolist()
        self._heads, self._kv_heads, self._head_dim = num_qo_heads, num_kv_heads, head_dim
        self._page_size = page_size
        self._q_dtype = _canon(q_data_type)
        self._kv_dtype = _canon(kv_data_type) if kv_data_type is not None else self._q_dtype
        self._causal = causal
        self._sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self._planned = True

    def _attend(self, q: torch.Tensor, cache, qo: list[int]) -> torch.Tensor:
        if not self._planned:
            raise RuntimeError("plan() must be called before run()")
        k_cache, v_cache = cache if isinstance(cache, tuple) else (cache[:, 0], cache[:, 1])
        want = (self._page_size, self._kv_heads, self._head_dim)
        if self._kv_layout != "NHD" or tuple(k_cache.shape[1:]) != want \
                or k_cache.shape != v_cache.shape:
            raise ValueError(f"paged kv cache {tuple(k_cache.shape)} is not NHD {want}")
        if q.dtype != self._q_dtype or k_cache.dtype != self._kv_dtype:
            raise ValueError(f"dtypes {q.dtype}/{k_cache.dtype} differ from the plan's "
                             f"{self._q_dtype}/{self._kv_dtype}")
        if q.dim() != 3 or q.shape[0] != qo[-1] or tuple(q.shape[1:]) != (self._heads,
                                                                          self._head_dim):
            raise ValueError(f"q {tuple(q.shape)} does not fit the plan")
        out = torch.empty_like(q)
        group = self._heads // self._kv_heads
        for i in range(len(self._last)):
            pages = self._indices[self._indptr[i]:self._indptr[i + 1]]
            kv_len = self._page_size * (len(pages) - 1) + self._last[i]
            idx = torch.tensor(pages, dtype=torch.long, device=k_cache.device)
            k = k_cache.index_select(0, idx).flatten(0, 1)[:kv_len].float()
            v = v_cache.index_select(0, idx).flatten(0, 1)[:kv_len].float()
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)     # [H, kv, hd]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            qi = q[qo[i]:qo[i + 1]].float().transpose(0, 1)            # [H, n, hd]
            n = qi.shape[1]
            scores = qi @ k.transpose(1, 2) * self._sm_scale
            if self._causal:
                keep = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - n)
                scores = scores.masked_fill(~keep, float("-inf"))
            out[qo[i]:qo[i + 1]] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indices_buf: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
                 custom_mask_buf: Optional[torch.Tensor] = None,
                 mask_indptr_buf: Optional[torch.Tensor] = None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None,
             packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None,
             q_data_type: Union[str, torch.dtype] = "float16",
             kv_data_type: Optional[Union[str, torch.dtype]] = None,
             o_data_type: Optional[Union[str, torch.dtype]] = None,
             non_blocking: bool = True, **later_kwargs: Any) -> None:
        calls.append(("prefill.plan", dict(causal=causal, pos_encoding_mode=pos_encoding_mode)))
        _int32("qo_indptr", qo_indptr)
        if pos_encoding_mode != "NONE" or custom_mask is not None or window_left != -1:
            raise NotImplementedError("the fake does only what applianced asks")
        self._qo = qo_indptr.tolist()
        self._set(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                  num_kv_heads, head_dim_qk, page_size, q_data_type, kv_data_type, causal,
                  sm_scale)
        if len(self._qo) != len(self._last) + 1:
            raise ValueError("qo_indptr and paged_kv_indptr disagree on the batch size")

    def run(self, q: torch.Tensor, paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor,
                                                                              torch.Tensor]],
            *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None,
            **later_kwargs) -> torch.Tensor:
        calls.append(("prefill.run", {}))
        return self._attend(q, paged_kv_cache, self._qo)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
                 paged_kv_indices_buffer: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
                 backend: str = "auto", jit_args=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             *deprecated_positional_args: Any, **kwargs: Any) -> None:
        calls.append(("decode.plan", dict(kwargs)))
        if deprecated_positional_args:
            raise TypeError("positional arguments after page_size are deprecated")
        known = {"pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type",
                 "kv_data_type", "o_data_type", "data_type", "sm_scale", "rope_scale",
                 "rope_theta", "non_blocking", "seq_lens", "block_tables",
                 "fixed_split_size", "disable_split_kv", "q_len_per_req", "window_right"}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        if kwargs.get("pos_encoding_mode", "NONE") != "NONE":
            raise NotImplementedError("the fake does only what applianced asks")
        self._qo = list(range(len(last_page_len) + 1))
        self._set(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                  page_size, kwargs.get("q_data_type", "float16"), kwargs.get("kv_data_type"),
                  False, kwargs.get("sm_scale"))

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None,
            v_scale=None, out=None, lse=None, return_lse: bool = False, enable_pdl=None,
            window_left=None, sinks=None, q_len_per_req=None, **later_kwargs) -> torch.Tensor:
        calls.append(("decode.run", {}))
        return self._attend(q, paged_kv_cache, self._qo)


def module() -> types.ModuleType:
    """A fresh `flashinfer` module object for sys.modules."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = __version__
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    calls.clear()
    return mod
