"""Copying whole KV blocks between pools: within one pool, between pools in two
processes (/dev/shm or CUDA IPC), between devices. Shared by the engines (prefix copies)
and the KV handoff; it knows nothing of either.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["copy_blocks"]


def copy_blocks(
    src_pool: torch.Tensor,
    src_block_ids: Sequence[int] | torch.Tensor,
    dst_pool: torch.Tensor,
    dst_block_ids: Sequence[int] | torch.Tensor,
) -> None:
    """Copy whole blocks (all layers, K and V) ``src_pool[.., src[i]] -> dst_pool[.., dst[i]]``.

    The pools may live in different processes (``src_pool`` shared via /dev/shm or CUDA
    IPC) or on different devices; layouts other than ``num_blocks`` must match.
    """
    if src_pool.dim() != 6 or dst_pool.dim() != 6:
        raise ValueError("KV pools must be 6-d [2, layers, blocks, block_size, kv_heads, head_dim]")
    if src_pool.shape[:2] != dst_pool.shape[:2] or src_pool.shape[3:] != dst_pool.shape[3:]:
        raise ValueError(
            f"KV pool layouts differ: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}"
        )
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"KV pool dtypes differ: {src_pool.dtype} vs {dst_pool.dtype}")
    src = torch.as_tensor(src_block_ids, dtype=torch.long).flatten()
    dst = torch.as_tensor(dst_block_ids, dtype=torch.long).flatten()
    if src.numel() != dst.numel():
        raise ValueError(f"{src.numel()} source blocks but {dst.numel()} destination blocks")
    if src.numel() == 0:
        return
    for name, ids, pool in (("source", src, src_pool), ("destination", dst, dst_pool)):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= pool.shape[2]:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} block id {bad} out of range [0, {pool.shape[2]})")
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("duplicate destination block ids")
    if src_pool.untyped_storage().data_ptr() == dst_pool.untyped_storage().data_ptr():
        # Within one pool (sources and destinations may overlap): gather first.
        moved = src_pool.index_select(2, src.to(src_pool.device))
        dst_pool.index_copy_(2, dst.to(dst_pool.device), moved)
        return
    s3 = src_pool.view(src_pool.shape[0] * src_pool.shape[1], src_pool.shape[2], -1)
    d3 = dst_pool.view(dst_pool.shape[0] * dst_pool.shape[1], dst_pool.shape[2], -1)
    pairs, stretches, dst_runs = _stretches(dst.tolist(), src.tolist())
    if src_pool.device.type == "cpu" and dst_pool.device.type == "cpu":
        # Stretches where both the destination and the source ids run consecutively are
        # one slice copy each (all K/V layer rows at once). When the sources are too
        # broken up for that (more stretches than rows x destination runs), one gather
        # per destination run and row instead, straight into the pool (index_select with
        # out= a view: no temporary, which would move every byte twice). Fewer, longer
        # copies win: every jump to another place in a 1 GiB pool costs page walks.
        if len(stretches) <= s3.shape[0] * len(dst_runs):
            _copy_stretches(s3, d3, stretches, per_row=False)
            return
        k = 0
        for d0, n in dst_runs:
            idx = torch.tensor([sid for _, sid in pairs[k:k + n]])
            for row in range(s3.shape[0]):
                torch.index_select(s3[row], 0, idx, out=d3[row, d0:d0 + n])
            k += n
        return
    # NOT RUN ON HARDWARE. A peer's pool on another GPU (CUDA IPC): only direct copies,
    # never a gather, whose output would live on the *peer's* GPU, kept there by this
    # process's caching allocator, in memory the prefill worker budgeted for itself.
    # With peer access a strided slice is one copy kernel per stretch; without it torch
    # would stage a strided slice through a contiguous temporary on the source GPU, so
    # each row of a stretch (contiguous on both sides) is its own cudaMemcpyAsync.
    per_row = (src_pool.device != dst_pool.device and src_pool.device.type == "cuda"
               and dst_pool.device.type == "cuda"
               and not torch.cuda.can_device_access_peer(dst_pool.device, src_pool.device))
    _copy_stretches(s3, d3, stretches, per_row)


def _stretches(dst: list[int], src: list[int]):
    """Block pairs sorted by destination; the stretches where destination and source ids
    both run consecutively ``[dst start, src start, blocks]``; the destination runs
    ``[dst start, blocks]``."""
    pairs = sorted(zip(dst, src))
    stretches: list[list[int]] = []
    dst_runs: list[list[int]] = []
    for d, sid in pairs:
        if dst_runs and d == dst_runs[-1][0] + dst_runs[-1][1]:
            dst_runs[-1][1] += 1
            last = stretches[-1]
            if d == last[0] + last[2] and sid == last[1] + last[2]:
                last[2] += 1
                continue
        else:
            dst_runs.append([d, 1])
        stretches.append([d, sid, 1])
    return pairs, stretches, dst_runs


def _copy_stretches(s3: torch.Tensor, d3: torch.Tensor, stretches: list[list[int]],
                    per_row: bool) -> None:
    """``d3[:, d0:d0+n] = s3[:, s0:s0+n]`` per stretch: one strided copy over all rows,
    or (`per_row`) one contiguous copy per row."""
    for d0, s0, n in stretches:
        if per_row:
            for row in range(s3.shape[0]):
                d3[row, d0:d0 + n].copy_(s3[row, s0:s0 + n])
        else:
            d3[:, d0:d0 + n].copy_(s3[:, s0:s0 + n])
