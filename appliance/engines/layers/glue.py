"""The elementwise work between a decoder layer's matmuls: residual adds and RMSNorms,
eager or through `torch.compile` (opt-in: ``[engine] compile = "decode"``).

Measured on the CPU (bench/bench_decode_step.py, 82m model, bf16, one thread), a decode
step's norms and residual adds are 4-9% of its CPU time: eager, ``F.rms_norm`` in bf16 is
some eight small ops (upcast, square, mean, rsqrt, scale, cast, weight), each a dispatch
and a pass over the rows. Compiled, the residual add and the next norm are one generated
loop. The matmuls (the packed oneDNN `Linear`) and the paged attention stay eager:
inductor cannot lower ``mkldnn._linear_pointwise`` on a packed weight with a dynamic
batch size (torch 2.13: a LoweringException), and the attention's shapes depend on the
step's plan.

Compiled once with dynamic shapes (any batch size, no recompile per size); inductor's
CPU backend needs a C++ compiler, so without one, or when compiling fails, the engine
says so in one line on stderr and runs eager. Precision casts are emulated
(``emulate_precision_casts``) so a compiled bf16 step rounds where the eager one does:
the same tokens with it on as off.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["COMPILE_MODES", "Glue", "compile_glue", "eager_glue"]

COMPILE_MODES = ("off", "decode")


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(h, (h.shape[-1],), weight, eps)


def _add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add and the next layer's norm."""
    h = h + delta
    return h, F.rms_norm(h, (h.shape[-1],), weight, eps)


class Glue:
    """The two glue functions a forward calls (eager, or compiled) and which they are."""

    __slots__ = ("rms_norm", "add_rms_norm", "compiled")

    def __init__(self, rms_norm: Callable, add_rms_norm: Callable, compiled: bool) -> None:
        self.rms_norm = rms_norm
        self.add_rms_norm = add_rms_norm
        self.compiled = compiled


def eager_glue() -> Glue:
    return Glue(_rms_norm, _add_rms_norm, False)


def compiler_missing() -> str | None:
    """Why inductor's CPU backend cannot build here (no C++ compiler), else None."""
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return None
    if any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        return None
    return "no C++ compiler found (g++, clang++ or $CXX)"


def compile_glue(device: torch.device, dtype: torch.dtype, hidden: int, eps: float,
                 worker: str = "") -> Glue:
    """The glue compiled for `device`/`dtype`, warmed up (compiled) here at start-up on a
    few rows, so no request waits for it; eager, with one line on stderr saying why,
    where it cannot be compiled."""
    who = f"applianced worker {worker}: " if worker else "applianced: "
    why = compiler_missing() if device.type == "cpu" else None
    if why is None:
        try:
            import torch._inductor.config as inductor_config
            inductor_config.emulate_precision_casts = True
            glue = Glue(torch.compile(_rms_norm, dynamic=True),
                        torch.compile(_add_rms_norm, dynamic=True), True)
            # As the forward calls them: the weight an ordinary tensor (dynamo guards on
            # that), the rows made under inference_mode; at 1 row (dynamo specializes a
            # size of 1) and two more sizes (the dynamic graph), so no step's batch size
            # compiles later, with a request waiting for it.
            w = torch.ones(hidden, device=device, dtype=dtype)
            with torch.inference_mode():
                for rows in (1, 2, 3):
                    h = torch.zeros(rows, hidden, device=device, dtype=dtype)
                    glue.rms_norm(h, w, eps)
                    glue.add_rms_norm(h, torch.zeros_like(h), w, eps)   # two tensors
            return glue
        except Exception as exc:  # noqa: BLE001 - any failure: serve eager, say why
            lines = str(exc).strip().splitlines()
            why = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    print(f"{who}engine.compile = \"decode\" unavailable ({why}): running eager",
          file=sys.stderr, flush=True)
    return eager_glue()
