"""Power of a simulated GPU, driven by the simulator's own iterations.

A GPU's board power tracks how hard its SMs work, not merely whether a kernel runs:
prefill is compute-bound and runs near TDP, decode streams weights and KV from HBM and
draws far less (DOMAIN.md: decode on an H200 draws ~137-300 W of 700 W). The model:

    P = idle_w                                                   outside iterations
    P = idle_w + (tdp_w - idle_w) * (FLOOR + (CEIL - FLOOR) * u)  inside one

with u = T / (T + ridge) the compute-bound share of a pass over the weights for T tokens
in the batch, and ridge the tokens at which the roofline turns from memory- to
compute-bound: (achievable FLOP/s / achievable bytes/s) * bytes per weight / 2 FLOPs per
weight. For Llama-3.1-70B FP8 on an H100 ridge = 203 tokens, so a batch of 32 decodes
draws 70 + 630 * 0.30 = 261 W and a 4,000-token prefill 645 W. FLOOR = 0.2 is a
memory-bound pass's share (DOMAIN.md's 137 W on a 75-W-idle 700-W H200 is 0.10, 300 W is
0.36); CEIL = 0.95 keeps a saturated prefill just under TDP (boards cap at TDP). KV
imports count as memory-bound passes. Energy is the exact integral of this power over
wall time. These are modelled figures: every sample and series says `simulated`.
"""
from __future__ import annotations

from dataclasses import dataclass

from appliance.engines.roofline import BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY

FLOOR = 0.20
CEIL = 0.95


def ridge_tokens(flops: float, mem_bw: float, weight_bytes: float) -> float:
    """Tokens per pass at which weight reads and matmul FLOPs take equal time."""
    return (flops * COMPUTE_EFFICIENCY) / (mem_bw * BANDWIDTH_EFFICIENCY) * weight_bytes / 2.0


@dataclass(frozen=True, slots=True)
class SimPowerModel:
    idle_w: float
    tdp_w: float
    ridge: float

    @classmethod
    def for_gpu(cls, spec, weight_bytes: float = 2.0) -> "SimPowerModel":
        """From a catalogue entry (idle_w, tdp_w, dense FLOP/s for the weights' dtype)."""
        flops = spec.flops_fp8 if weight_bytes <= 1.0 and spec.flops_fp8 else spec.flops_bf16
        return cls(spec.idle_w, spec.tdp_w, ridge_tokens(flops, spec.mem_bw, weight_bytes))

    def share_for(self, phase: str, tokens: int) -> float:
        """u in [0, 1): how compute-bound an iteration over `tokens` tokens was."""
        if phase == "kv_import" or tokens <= 0:
            return 0.0
        return tokens / (tokens + self.ridge)

    def power_at(self, u: float) -> float:
        return self.idle_w + (self.tdp_w - self.idle_w) * (FLOOR + (CEIL - FLOOR) * u)

    def compute_share(self, phase: str, entries) -> float:
        return self.share_for(phase, sum(e[1] for e in entries))

    def power_w(self, phase: str, entries) -> float:
        return self.power_at(self.compute_share(phase, entries))
