"""Built-in GPU catalogue: the figures the roofline, cost and carbon code need.

Real GPUs are matched to an entry by their NVML name; simulated GPUs are built from an
entry. Figures that are not datasheet facts (idle power, price, embodied carbon) are
defaults to be overridden by calibration or site configuration, and say so below.

Conventions:
- FLOP/s are *dense* tensor-core figures (NVIDIA datasheets quote sparse numbers first,
  which are exactly 2x dense).
- mem_bytes is the marketed capacity read as GiB (HBM stacks are binary-sized); NVML
  reports a little less after the driver's reservation.
- usd_per_hour is a specialty-cloud (not hyperscaler) on-demand price per GPU-hour: the
  middle of the range in mercatus-ai.com/blog/cloud-gpu-pricing (May 2026) for A100,
  H100 and H200; lyceum.technology "NVIDIA B200 GPU Cloud Pricing 2026" for B200;
  RunPod's on-demand list price (as quoted by modal.com, Aug 2025) for L40S.
- idle_w is a typical nvidia-smi reading of an idle board in persistence mode; rough,
  calibrate on the box.
- embodied_kgco2e is a per-GPU cradle-to-gate estimate including a 1/8 share of its host,
  from Chien et al., "Reducing the Carbon Impact of Generative AI Inference", HotCarbon
  2023 (318 kg per A100 GPU), scaled as noted per entry; rough, override per site.
- lifetime_years spreads embodied carbon over the device's service life (carbon per
  GPU-second = embodied / lifetime): 5 years, a common depreciation period for
  accelerator servers (hyperscalers book 5-6); an assumption, override per site.
- Simulated GPUs are priced and carbon-counted as the real model they stand for.
- The CPU has no entry: `CPU_USD_PER_HOUR` etc. below are its defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GIB = 1024**3
_TERA = 1e12


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    aliases: tuple[str, ...]
    flops_bf16: float  # dense FLOP/s
    flops_fp8: float  # dense FLOP/s; 0.0 = no FP8 tensor cores
    mem_bw: float  # bytes/s
    mem_bytes: int
    tdp_w: float
    idle_w: float
    usd_per_hour: float
    embodied_kgco2e: float
    nvlink: bool
    lifetime_years: float = 5.0


# H100 SXM5, NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 / FP8 3,958 TFLOPS with
# sparsity -> 989.5 / 1,979 dense; 80 GB HBM3 at 3.35 TB/s; up to 700 W; NVLink 900 GB/s.
H100_SXM = GpuSpec(
    name="H100-SXM",
    aliases=("H100", "H100-80GB", "H100-SXM5"),
    flops_bf16=989.5 * _TERA,
    flops_fp8=1979.0 * _TERA,
    mem_bw=3.35e12,
    mem_bytes=80 * _GIB,
    tdp_w=700.0,
    idle_w=70.0,
    usd_per_hour=3.00,  # specialty on-demand $2.50-3.50
    embodied_kgco2e=318.0,  # same HGX-class board and host share as Chien et al.'s A100
    nvlink=True,
)

# H200 SXM, NVIDIA H200 Tensor Core GPU datasheet: same Hopper compute as H100 SXM
# (BF16 1,979 / FP8 3,958 TFLOPS sparse); 141 GB HBM3e at 4.8 TB/s; up to 700 W.
H200 = GpuSpec(
    name="H200",
    aliases=("H200-SXM", "H200-141GB"),
    flops_bf16=989.5 * _TERA,
    flops_fp8=1979.0 * _TERA,
    mem_bw=4.8e12,
    mem_bytes=141 * _GIB,
    tdp_w=700.0,
    idle_w=75.0,
    usd_per_hour=4.00,  # specialty on-demand $3.50-4.50
    embodied_kgco2e=350.0,  # H100 figure + ~10% for the larger HBM3e stacks (estimate)
    nvlink=True,
)

# A100 80GB SXM4, NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense (624
# sparse); no FP8; 80 GB HBM2e at 2,039 GB/s; 400 W; NVLink 600 GB/s.
A100_80GB = GpuSpec(
    name="A100-80GB",
    aliases=("A100", "A100-SXM", "A100-SXM4-80GB"),
    flops_bf16=312.0 * _TERA,
    flops_fp8=0.0,
    mem_bw=2.039e12,
    mem_bytes=80 * _GIB,
    tdp_w=400.0,
    idle_w=55.0,
    usd_per_hour=1.30,  # specialty on-demand $1.10-1.50
    embodied_kgco2e=318.0,  # Chien et al. 2023, per A100 incl. 1/8 of the host
    nvlink=True,
)

# L40S, NVIDIA L40S datasheet: BF16 733 / FP8 1,466 TFLOPS with sparsity -> 366 / 733
# dense; 48 GB GDDR6 at 864 GB/s; 350 W; PCIe Gen4 only, no NVLink.
L40S = GpuSpec(
    name="L40S",
    aliases=("L40S-48GB",),
    flops_bf16=366.0 * _TERA,
    flops_fp8=733.0 * _TERA,
    mem_bw=864e9,
    mem_bytes=48 * _GIB,
    tdp_w=350.0,
    idle_w=35.0,
    usd_per_hour=0.86,  # RunPod on-demand
    embodied_kgco2e=160.0,  # PCIe card, GDDR6, no HGX board: ~half the A100 figure (estimate)
    nvlink=False,
)

# B200 (HGX, 1,000 W configuration), NVIDIA HGX B200 datasheet: FP8 9 PFLOPS / BF16 4.5
# PFLOPS with sparsity -> 4.5 / 2.25 dense; 180 GB HBM3e per GPU at 8 TB/s; NVLink 5.
B200 = GpuSpec(
    name="B200",
    aliases=("B200-SXM", "B200-180GB"),
    flops_bf16=2250.0 * _TERA,
    flops_fp8=4500.0 * _TERA,
    mem_bw=8.0e12,
    mem_bytes=180 * _GIB,
    tdp_w=1000.0,
    idle_w=140.0,
    usd_per_hour=5.25,  # specialty on-demand $4.50-6.00
    # NVIDIA's PCF comparison (developer.nvidia.com, HGX B200 vs HGX H100): embodied
    # carbon per FLOP -24% at 2.3x the FLOPs, i.e. ~1.75x the H100 board per GPU.
    embodied_kgco2e=557.0,
    nvlink=True,
)

CATALOGUE: tuple[GpuSpec, ...] = (H100_SXM, H200, A100_80GB, L40S, B200)

# NVML device names seen on real boards, mapped to catalogue entries. Only the variant the
# entry describes matches: an "H100 PCIe" has different figures, and a wrong spec would
# misprice every GPU-second, so unknown variants get no spec at all.
_NVML_NAMES: tuple[tuple[re.Pattern[str], GpuSpec], ...] = (
    (re.compile(r"\bH100\b.*\b(HBM3|SXM)", re.I), H100_SXM),  # "NVIDIA H100 80GB HBM3"
    (re.compile(r"\bH200\b(?!.*\bNVL\b)", re.I), H200),  # "NVIDIA H200"
    (re.compile(r"\bA100-SXM4-80GB\b", re.I), A100_80GB),  # "NVIDIA A100-SXM4-80GB"
    (re.compile(r"\bL40S\b", re.I), L40S),  # "NVIDIA L40S"
    (re.compile(r"\bB200\b", re.I), B200),  # "NVIDIA B200"
)


# A CPU worker's device (its pinned cores) for cost and carbon: priced at nothing and
# carrying no embodied figure by default, because a CPU box's price and footprint vary too
# much for a useful default; set [accounting] usd_per_gpu_hour.cpu and [site]
# embodied_kgco2e.cpu to charge them.
CPU_USD_PER_HOUR = 0.0
CPU_EMBODIED_KGCO2E = 0.0
CPU_LIFETIME_YEARS = 5.0


def known_gpu_names() -> list[str]:
    return [spec.name for spec in CATALOGUE]


def lookup_gpu(name: str) -> GpuSpec:
    """Find a catalogue entry by name or alias, ignoring case (user input: sim specs, config)."""
    wanted = name.strip().casefold()
    for spec in CATALOGUE:
        if wanted == spec.name.casefold() or wanted in (a.casefold() for a in spec.aliases):
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(known_gpu_names())}")


def match_nvml_name(nvml_name: str) -> GpuSpec | None:
    """The catalogue entry for a real board's NVML name, or None if we carry no figures for it."""
    for pattern, spec in _NVML_NAMES:
        if pattern.search(nvml_name):
            return spec
    return None
