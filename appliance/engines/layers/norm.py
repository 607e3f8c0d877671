"""RMSNorm over each attention head's vector (Qwen3's q_norm and k_norm).

Qwen3 normalizes every query and key head on its own (over head_dim, one weight shared by
the heads) after the projection and before RoPE; Llama does not. Applied in place on the
fused q/k/v projection's output, so no extra copy of q and k is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["head_rms_norm_"]


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize ``x`` ``[tokens, heads, head_dim]`` per head, in place; returns ``x``."""
    return x.copy_(F.rms_norm(x, (x.shape[-1],), weight, eps))
