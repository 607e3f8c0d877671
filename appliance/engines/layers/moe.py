"""A sparse mixture-of-experts MLP: a top-k router and SwiGLU experts (Mixtral, Qwen3-MoE).

Routing, as `transformers` does it for these families: softmax over the router's logits
(in fp32), the k largest kept, and — Mixtral always, Qwen3-MoE when ``norm_topk_prob`` —
the kept k renormalized to sum to 1 (`Router`). gpt-oss instead takes the top k of the
router's logits (it has a bias) and softmaxes those k (`TopKSoftmaxRouter`), and its
experts have biases and a clamped SwiGLU (`clamped_swiglu`).

The experts run grouped by expert, not by token: the step's (token, slot) pairs are
sorted by the expert they chose, so each expert with work multiplies one contiguous
block of rows, reading its weights once per step however many tokens chose it. The only
Python loop is over the experts (at most ``num_experts`` matmul pairs a layer); decode
at batch B touches at most ``B * k`` of them. Each expert's matrices are `Linear`s, so
on the CPU they are packed for oneDNN like every other weight, or for the C matmul kernel
where a worker runs its weights on it; then the loop itself runs in C too
(`SparseMoE.use_kernel`, cpu_kernels/moe_experts.c), the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from appliance.engines.layers.linear import Linear

__all__ = ["Activation", "Router", "SparseMoE", "TopKSoftmaxRouter", "clamped_swiglu", "swiglu"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> down's input


def clamped_swiglu(limit: float, alpha: float) -> Activation:
    """gpt-oss's expert activation: gate clamped above at `limit`, up to +-`limit`,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    return act


@dataclass(slots=True)
class Router:
    """Chooses `top_k` experts per token and weighs them (see the module docstring)."""

    gate: Linear          # [num_experts, hidden]
    top_k: int
    renormalize: bool     # the kept k weights sum to 1 (Mixtral; Qwen3-MoE norm_topk_prob)
    # Qwen3-MoE casts the weights to the activations' dtype before weighing the experts'
    # outputs; Mixtral keeps them in fp32. Equal in fp32, a rounding apart in bf16.
    weights_in_input_dtype: bool = False

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]``, expert ids ``[T, k]``) for ``x`` ``[T, hidden]``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        return weights, experts


@dataclass(slots=True)
class TopKSoftmaxRouter:
    """gpt-oss: the top k of the router's logits, softmaxed over those k (in the
    activations' dtype)."""

    gate: Linear          # [num_experts, hidden], with a bias
    top_k: int

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts


class SparseMoE:
    """``x [T, hidden] -> [T, hidden]``: each token's k experts' SwiGLU outputs, weighted."""

    __slots__ = ("router", "gate_up", "down", "act", "kernel", "_packed")

    def __init__(self, router: Router | TopKSoftmaxRouter, gate_up: list[Linear],
                 down: list[Linear], act: Activation = swiglu) -> None:
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate/up and {len(down)} down expert weights")
        self.router = router
        self.act = act           # (gate, up) -> the input of down
        self.gate_up = gate_up   # per expert, [2 * intermediate, hidden] (gate rows first)
        self.down = down         # per expert, [hidden, intermediate]
        self.kernel = None       # `cpu_kernels.MoeExperts`: the experts in one C call
        self._packed = None      # its arrays of the experts' packed weights

    def use_kernel(self, kernel) -> bool:
        """Run the experts in one call of `kernel` (`cpu_kernels.MoeExperts` or
        `MoeExpertsF32`, bound to the matmul kernel the experts' `Linear`s already use),
        the router staying here; or in this module's loop again with None. False (nothing
        changed) for experts it does not take: biases, an activation other than SwiGLU,
        a weight not on that matmul kernel."""
        if kernel is None:
            self.kernel, self._packed = None, None
            return True
        lins = self.gate_up + self.down
        if self.act is not swiglu or any(lin.pairs is None or lin.bias is not None
                                          for lin in lins):
            return False
        inter = self.gate_up[0].rows // 2
        if any(g.rows != 2 * inter for g in self.gate_up):
            return False
        self._packed = (kernel.experts([g.pairs for g in self.gate_up]),
                        kernel.experts([d.pairs for d in self.down]), inter)
        self.kernel = kernel
        return True

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.router(x)
        if self.kernel is not None:
            gate_up, down, inter = self._packed
            return self.kernel(gate_up, down, x.shape[-1], inter, x, weights, experts)
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)            # (token, slot) pairs by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // k                                   # the token of each pair
        xs = x.index_select(0, rows)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            gate, up = self.gate_up[e](xs[start:end]).chunk(2, dim=-1)
            ys[start:end] = self.down[e](self.act(gate, up))
            start = end
        scaled = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, scaled)
