"""Token sampling: greedy, or temperature + top-k + nucleus (top-p) with a generator per
sequence, after logit bias and OpenAI's presence/frequency penalties; and the log-probs a
request asked for.

Each sequence draws exactly one uniform number per sampled token from its own generator,
and its row is processed on its own, so a seeded request yields the same tokens whatever
else shares its batch. The penalties are computed from the sequence's own generated
tokens at every step (not kept in the sampler), so they come out the same on a decode
worker that took the request over after its first token, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = ["SamplingState", "sample", "top_logprobs"]

MAX_LOGIT_BIAS = 100.0      # OpenAI: biases are in [-100, 100]
MAX_PENALTY = 2.0           # OpenAI: presence/frequency penalties are in [-2, 2]


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
    top_k: int = 0                          # 0: off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    bias_ids: torch.Tensor | None = None    # logit_bias as two aligned tensors
    bias_values: torch.Tensor | None = None

    @classmethod
    def create(
        cls,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        device: str | torch.device = "cpu",
        top_k: int = 0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: Sequence[tuple[int, float]] = (),
        vocab_size: int | None = None,
    ) -> SamplingState:
        """Validate and build; ``seed`` None draws a nondeterministic seed. Raises
        ValueError naming the first bad parameter."""
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        for name, value in (("frequency_penalty", frequency_penalty),
                            ("presence_penalty", presence_penalty)):
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        bias_ids = bias_values = None
        if logit_bias:
            ids = [int(t) for t, _ in logit_bias]
            values = [float(v) for _, v in logit_bias]
            limit = vocab_size if vocab_size is not None else float("inf")
            bad = [t for t in ids if not 0 <= t < limit]
            if bad:
                raise ValueError(f"logit_bias names token id {bad[0]}, outside the "
                                 f"vocabulary [0, {vocab_size})")
            if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in values):
                raise ValueError("logit_bias values must be in [-100, 100]")
            bias_ids = torch.tensor(ids, dtype=torch.long, device=device)
            bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return cls(float(temperature), float(top_p), gen, int(top_k), float(frequency_penalty),
                   float(presence_penalty), bias_ids, bias_values)

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusts(self) -> bool:
        """Whether the raw logits are changed before the pick (bias or penalties)."""
        return self.penalized or self.bias_ids is not None


def _adjusted(row: torch.Tensor, p: SamplingState, generated: Sequence[int]) -> torch.Tensor:
    """fp32 copy of one row of logits with logit_bias added and the penalties taken off
    (OpenAI: ``mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty``, c[j]
    the count of token j among this sequence's generated tokens)."""
    row = row.float().clone()
    if p.bias_ids is not None:
        row.index_add_(0, p.bias_ids, p.bias_values)
    if p.penalized and generated:
        ids = torch.tensor(generated, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=row.numel())[: row.numel()].to(row.dtype)
        row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
    return row


def _sample_row(logits: torch.Tensor, p: _SamplingLike) -> int:
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    top_k = getattr(p, "top_k", 0)
    if p.top_p < 1.0 or 0 < top_k < probs.numel():
        # Stable sort keeps ties in id order, so top_p -> 0 or top_k = 1 gives the
        # greedy token. Top-k first, then nucleus over what top-k kept (renormalized),
        # as transformers' and vLLM's samplers do.
        probs, ids = torch.sort(probs, descending=True, stable=True)
        if 0 < top_k < probs.numel():
            probs, ids = probs[:top_k], ids[:top_k]
        if p.top_p < 1.0:
            # Nucleus: the smallest highest-probability set whose mass reaches top_p.
            cdf = probs.cumsum(0)
            cut = torch.tensor([p.top_p], dtype=cdf.dtype) * cdf[-1]
            keep = int(torch.searchsorted(cdf, cut).item()) + 1
            probs, ids = probs[:keep], ids[:keep]
    else:
        ids = None
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=p.generator, device=logits.device, dtype=cdf.dtype) * cdf[-1]
    idx = min(int(torch.searchsorted(cdf, u, right=True).item()), cdf.numel() - 1)
    return int(ids[idx]) if ids is not None else idx


def sample(logits: torch.Tensor, params: Sequence[_SamplingLike],
           generated: Sequence[Sequence[int]] | None = None) -> list[int]:
    """One token id per row of ``logits [B, V]``.

    Greedy (argmax, ties -> lowest id) when temperature == 0, else temperature + top-k +
    top-p. ``generated[i]``: row i's tokens generated so far, needed when its state has
    penalties.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} sampling params")
    out: list[int] = [0] * len(params)
    plain = [i for i, p in enumerate(params)
             if p.temperature == 0.0 and not getattr(p, "adjusts", False)]
    done = set(plain)
    if plain:
        rows = logits if len(plain) == len(params) else logits[plain]
        for i, tok in zip(plain, rows.argmax(dim=-1).tolist()):
            out[i] = tok
    for i, p in enumerate(params):
        if i in done:
            continue
        row = logits[i]
        if getattr(p, "adjusts", False):
            row = _adjusted(row, p, generated[i] if generated is not None else ())
        out[i] = int(row.argmax()) if p.temperature == 0.0 else _sample_row(row, p)
    return out


def top_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int
                 ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of ``logits [B, V]``: the log-probability of ``tokens[i]`` and the k
    most likely tokens with theirs (ties in id order).

    These are the model's own log-probabilities (log-softmax of the raw logits, before
    temperature, penalties and bias), as vLLM reports by default: what the model thought
    of each token, whatever the sampler did with it.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])
    k = min(k, lp.shape[1])
    # topk, not a sort of the whole vocabulary (150k entries for some models); it leaves
    # the order of ties open, so everything at or above the k-th value is re-sorted stably.
    floor = lp.topk(k, dim=-1).values[:, -1:] if k > 0 else None
    out = []
    for i, c in enumerate(chosen[:, 0].tolist()):
        alts: list[tuple[int, float]] = []
        if floor is not None:
            ids = (lp[i] >= floor[i]).nonzero()[:, 0]           # ascending ids
            vals, order = torch.sort(lp[i, ids], descending=True, stable=True)
            alts = list(zip(ids[order][:k].tolist(), vals[:k].tolist()))
        out.append((c, alts))
    return out
