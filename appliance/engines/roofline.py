"""Step times from a roofline: max(compute time, memory time) + communication + overhead.

Why a roofline and not fitted curves (Dynamo's mocker): it generalizes across GPU
shapes from datasheet figures alone, and it makes prefill compute-bound and decode
bandwidth-bound for the right reason (FLOPs grow with tokens, bytes with weights+KV).
The efficiency factors are the usual achievable fractions of peak; they are stated
here, not tuned to hit a published number.
"""
from __future__ import annotations

from dataclasses import dataclass

# Achievable fractions of datasheet peak for large dense GEMMs and streaming reads
# on H100-class parts (typical MFU ~50-60% for prefill; ~80% of HBM bandwidth).
COMPUTE_EFFICIENCY = 0.55
BANDWIDTH_EFFICIENCY = 0.80
STEP_OVERHEAD_S = 1.0e-3        # scheduling + launches per iteration (CUDA graphs on)
ALLREDUCE_LATENCY_S = 8e-6      # per all-reduce, NVLink ring
NVLINK_BW = 450e9               # H100 NVLink 4: 900 GB/s bidirectional per GPU
PCIE_BW = 25e9                  # PCIe Gen4/5 x16, achievable


@dataclass(frozen=True, slots=True)
class DeviceShape:
    """What the roofline needs of one device."""

    name: str
    flops: float          # dense FLOP/s for the model's weight dtype
    mem_bw: float         # bytes/s
    mem_bytes: float
    link_bw: float        # bytes/s to a peer device (KV handoff, all-reduce)

    @classmethod
    def from_gpu(cls, spec, weight_bytes: float) -> "DeviceShape":
        fp8 = weight_bytes <= 1.0 and getattr(spec, "flops_fp8", 0)
        return cls(spec.name, spec.flops_fp8 if fp8 else spec.flops_bf16, spec.mem_bw,
                   spec.mem_bytes, NVLINK_BW if spec.nvlink else PCIE_BW)


# A 2-core AVX2 box, for the simulator on `--devices cpu` (roughly what DOMAIN.md
# measured: ~20 GB/s, tens of GFLOP/s single-threaded fp32).
CPU_SHAPE = DeviceShape("cpu", 5e10, 2e10, 4 * 2**30, 2e10)


class StepTimeModel:
    """Seconds per engine iteration for one worker of `tp` devices running `model`."""

    def __init__(self, device: DeviceShape, tp: int, model):
        self.device = device
        self.tp = tp
        self.model = model
        m = model
        self._attn_flops_per_pair = 4.0 * m.layers * m.heads * m.head_dim  # QK^T + PV
        self._kv_per_token = m.kv_bytes_per_token()
        self._peak = device.flops * tp * COMPUTE_EFFICIENCY
        self._bw = device.mem_bw * tp * BANDWIDTH_EFFICIENCY

    def _allreduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        m = self.model
        bytes_per = tokens * m.hidden * 2 * 2 * (self.tp - 1) / self.tp
        return 2 * m.layers * (bytes_per / self.device.link_bw + ALLREDUCE_LATENCY_S)

    def _weight_bytes_read(self, tokens: int) -> float:
        m = self.model
        # Dense: every weight once per step. MoE: only touched experts, at most all.
        return min(m.weight_total_bytes(), m.active_params * m.weight_bytes * max(1, tokens))

    def prefill_s(self, new_tokens: list[int], cached: list[int]) -> float:
        total = sum(new_tokens)
        flops = 2.0 * self.model.active_params * total
        flops += sum(self._attn_flops_per_pair * n * (c + n / 2) for n, c in zip(new_tokens, cached))
        bytes_ = self._weight_bytes_read(total) + self._kv_per_token * sum(
            n + c for n, c in zip(new_tokens, cached))
        return max(flops / self._peak, bytes_ / self._bw) + self._allreduce_s(total) + STEP_OVERHEAD_S

    def decode_s(self, contexts: list[int]) -> float:
        batch = len(contexts)
        ctx = sum(contexts)
        flops = 2.0 * self.model.active_params * batch + self._attn_flops_per_pair * ctx
        bytes_ = self._weight_bytes_read(batch) + self._kv_per_token * ctx
        return max(flops / self._peak, bytes_ / self._bw) + self._allreduce_s(batch) + STEP_OVERHEAD_S

    def transfer_s(self, tokens: int) -> float:
        """KV handoff of `tokens` between two workers over the device link."""
        return tokens * self._kv_per_token / self.device.link_bw + 20e-6

    def kv_capacity_tokens(self, mem_fraction: float = 0.9) -> int:
        budget = self.device.mem_bytes * self.tp * mem_fraction - self.model.weight_total_bytes()
        return int(budget // self._kv_per_token) if budget > 0 else 0
