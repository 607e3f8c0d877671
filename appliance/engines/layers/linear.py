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
    faster at batch 1-32). bf16 weights on the CPU are packed the same way (at batch 8 on an
    AVX512-BF16 core, 0.23 ms packed vs 0.75 ms for F.linear on a 768x2304 weight; the
    results are identical). Only the packed copy is kept. Elsewhere (CUDA, fp16, a torch
    build without oneDNN) the weight stays as is and ``F.linear`` runs.

    A CPU decode worker may hand a layer to a C kernel instead (`use_kernel`:
    `engines.cpu_kernels.LinearBf16` for bf16, `LinearF32` for fp32 on a CPU without
    AVX-512): the weight is then kept only in that kernel's layout.
    """

    __slots__ = ("weight", "bias", "packed", "kernel", "pairs", "rows", "bias32")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.kernel = None
        self.pairs: torch.Tensor | None = None    # the weight in the kernel's layout
        self.rows = weight.shape[0]
        self.bias32: torch.Tensor | None = None
        if (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and _onednn_ok(weight.dtype)):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self.weight = None

    def use_kernel(self, kernel) -> bool:
        """Multiply through `kernel` (`cpu_kernels.LinearBf16` or `LinearF32`) from now on,
        its layout replacing the packed weight; False (nothing changed) for a weight it does
        not take."""
        dense = self.dense()
        if kernel is None or not kernel.supports(dense):
            return False
        self.pairs = kernel.pack(dense)
        self.bias32 = self.bias.float() if self.bias is not None else None
        self.kernel, self.packed, self.weight = kernel, None, None
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pairs is not None:
            return self.kernel(self.pairs, self.rows, x, self.bias32)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary [out, in] layout (a copy when packed)."""
        if self.pairs is not None:
            return self.kernel.unpack(self.pairs, self.rows)
        if self.packed is not None:
            return self.packed.to_dense()
        assert self.weight is not None
        return self.weight


_ONEDNN_OK: dict[torch.dtype, bool] = {}


def _onednn_ok(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build packs and multiplies oneDNN linear weights of `dtype`
    correctly (checked once per dtype against F.linear, so a build or CPU without the
    ops just runs unpacked)."""
    if dtype not in _ONEDNN_OK:
        try:
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
            w, x = w.to(dtype), x.to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            _ONEDNN_OK[dtype] = bool(torch.allclose(y.float(), F.linear(x, w).float(),
                                                    rtol=tol, atol=tol))
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN_OK[dtype] = False
    return _ONEDNN_OK[dtype]
