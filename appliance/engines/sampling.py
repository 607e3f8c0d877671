"""Token sampling: greedy, or temperature + nucleus (top-p) with a generator per sequence.

Each sequence draws exactly one uniform number per sampled token from its own generator,
and its row is processed on its own, so a seeded request yields the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = ["SamplingState", "sample"]


class _SamplingLike(Protocol):
    temperature: float
    top_p: float
    generator: torch.Generator | None


@dataclass(slots=True)
class SamplingState:
    """Per-sequence sampler state. ``generator`` None means torch's global RNG."""

    temperature: float
    top_p: float
    generator: torch.Generator | None

    @classmethod
    def create(
        cls,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        device: str | torch.device = "cpu",
    ) -> SamplingState:
        """Validate and build; ``seed`` None draws a nondeterministic seed."""
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return cls(float(temperature), float(top_p), gen)


def _sample_row(logits: torch.Tensor, p: _SamplingLike) -> int:
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    if p.top_p < 1.0:
        # Nucleus: the smallest highest-probability set whose mass reaches top_p.
        # Stable sort keeps ties in id order, so top_p -> 0 gives the greedy token.
        probs, ids = torch.sort(probs, descending=True, stable=True)
        cdf = probs.cumsum(0)
        keep = int(torch.searchsorted(cdf, torch.tensor([p.top_p], dtype=cdf.dtype)).item()) + 1
        probs, ids = probs[:keep], ids[:keep]
    else:
        ids = None
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=p.generator, device=logits.device, dtype=cdf.dtype) * cdf[-1]
    idx = min(int(torch.searchsorted(cdf, u, right=True).item()), cdf.numel() - 1)
    return int(ids[idx]) if ids is not None else idx


def sample(logits: torch.Tensor, params: Sequence[_SamplingLike]) -> list[int]:
    """One token id per row of ``logits [B, V]``.

    Greedy (argmax, ties -> lowest id) when temperature == 0, else temperature + top-p.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} sampling params")
    out: list[int] = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, tok in zip(greedy, rows.argmax(dim=-1).tolist()):
            out[i] = tok
    for i, p in enumerate(params):
        if p.temperature != 0.0:
            out[i] = _sample_row(logits[i], p)
    return out
