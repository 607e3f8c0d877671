"""The torch engine's KV pool: its allocation, its size per block, and the tag that says
which pools may exchange blocks.

Layout (shared with the KV handoff, see `appliance.kv.blocks.copy_blocks`):

    kv[2, layers, num_blocks, block_size, kv_heads, head_dim]     index 0 = K, 1 = V

Token slot ``s = block_id * block_size + offset``; K is stored *after* RoPE, so a cached
block is position-encoded once and reused as is (prefix caching, handoff between workers).
"""

from __future__ import annotations

import torch

from appliance.models.shape import LlamaShape

__all__ = ["allocate_kv_pool", "kv_pool_bytes_per_block", "layout_tag"]


def allocate_kv_pool(
    shape: LlamaShape,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Zeroed pool ``[2, layers, num_blocks, block_size, kv_heads, head_dim]``."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
    return torch.zeros(
        (2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
        device=device,
        dtype=dtype,
    )


def kv_pool_bytes_per_block(shape: LlamaShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * elem


def layout_tag(shape: LlamaShape, block_size: int, dtype: torch.dtype) -> str:
    """Identity of a pool's block layout; KV may only move between equal tags."""
    dname = str(dtype).removeprefix("torch.")
    return f"L{shape.num_layers}-kvh{shape.num_kv_heads}-hd{shape.head_dim}-bs{block_size}-{dname}"
