"""Which dtype a torch worker holds its weights and KV in (`[engine] dtype`).

- ``auto``: on the CPU the checkpoint's own dtype (config.json ``torch_dtype``/``dtype``,
  as `transformers`' ``dtype="auto"`` reads it) where the processor multiplies it natively,
  else fp32: a bf16 checkpoint (what Qwen3, Llama 3 and Gemma 3 ship) runs in bf16 on an
  AVX512-BF16/AMX core, at half the bytes per weight read; an fp32 checkpoint stays fp32
  (exact), and so does anything on a CPU without the instructions (there bf16 matmuls are
  emulated), silently, since nothing was asked for. bf16 on a GPU.
- ``float32`` | ``bfloat16`` | ``float16``: that dtype. On the CPU bf16 is used only
  where the processor multiplies it natively (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16
  extension), fp16 only where it has AVX512-FP16 or AMX-FP16 (Arm: FP16 arithmetic);
  elsewhere the worker falls back to fp32 and says so in one line (`resolve`'s note).

The flags are read from /proc/cpuinfo (Linux; `partitions.devices.cpu_flags`, which the
daemon reads without torch); where it cannot be read, no flag is assumed.
`torch.backends.cpu.get_cpu_capability()` names only the vector ISA ("AVX512", "AVX2"),
not bf16 support, so it cannot decide this.
"""
from __future__ import annotations

import torch

from appliance.partitions.devices import cpu_flags  # torch-free: the daemon reads them too

__all__ = ["DTYPES", "checkpoint_dtype", "cpu_flags", "cpu_supports", "resolve"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# cpuinfo flags (x86 "flags", Arm "Features") that give each dtype native arithmetic.
_NATIVE = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}

_NEEDS = {torch.bfloat16: "AVX512-BF16/AMX-BF16 (Arm: BF16)",
          torch.float16: "AVX512-FP16/AMX-FP16 (Arm: FP16)"}


def cpu_supports(dtype: torch.dtype, flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` multiplies `dtype` natively (fp32 always)."""
    if dtype == torch.float32:
        return True
    return any(f in flags for f in _NATIVE.get(dtype, ()))


def checkpoint_dtype(config: dict) -> torch.dtype | None:
    """The dtype a checkpoint's config.json says its weights are in (None: not said, or
    not one of `DTYPES`)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    return DTYPES.get(name)


def resolve(wanted: str, device_kind: str, flags: frozenset[str] | None = None,
            stored: torch.dtype | None = None) -> tuple[torch.dtype, str | None]:
    """(the dtype to load in, a one-line note when it is not what was asked for).
    `stored`: the checkpoint's own dtype (`checkpoint_dtype`), which ``auto`` follows on
    the CPU where the processor has it natively."""
    if wanted not in ("auto", *DTYPES):
        raise ValueError(f"unknown dtype {wanted!r}: expected auto, {', '.join(DTYPES)}")
    if device_kind == "gpu":
        return (torch.bfloat16 if wanted == "auto" else DTYPES[wanted]), None
    flags = cpu_flags() if flags is None else flags
    if wanted == "auto":
        if stored in (torch.bfloat16, torch.float16) and cpu_supports(stored, flags):
            return stored, None
        return torch.float32, None
    dtype = DTYPES[wanted]
    if cpu_supports(dtype, flags):
        return dtype, None
    need = _NEEDS[dtype]
    return torch.float32, (f"dtype {wanted} asked for, but this CPU lacks {need}: "
                           "running in float32")
