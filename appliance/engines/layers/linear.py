"""A linear layer whose weight is stored the way the device multiplies fastest.

Shared by every model family (attention and MLP projections, MoE experts, the LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Linear"]


class Linear:
    """``x @ weight.T + bias`` with the weight stored the way the CPU multiplies fastest.

    On the CPU in fp32 the weight is re-laid out once into oneDNN's blocked format
    (``mkldnn._reorder_linear_weight``, what inductor's freezing pass does): a plain
    ``F.linear`` re-packs the weight inside MKL on every call, which at decode batch sizes
    costs as much as the multiply itself (packing made the 20m model's matmuls 1.3-1.9x
    faster at batch 1-32). Only the packed copy is kept. Elsewhere
    (CUDA, bf16, a torch build without oneDNN) the weight stays as is and ``F.linear`` runs.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_ok():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary [out, in] layout (a copy when packed)."""
        if self.packed is not None:
            return self.packed.to_dense()
        assert self.weight is not None
        return self.weight


_ONEDNN_OK: bool | None = None


def _onednn_ok() -> bool:
    """Whether this torch build packs and multiplies oneDNN linear weights correctly
    (checked once against F.linear, so a build without the ops just runs unpacked)."""
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        try:
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _ONEDNN_OK = bool(torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN_OK = False
    return _ONEDNN_OK
