"""Token sampling: greedy, or temperature + top-k + nucleus (top-p) + min-p with a
generator per sequence, after logit bias, OpenAI's presence/frequency penalties, the
repetition penalty and min_tokens' masking of stop tokens; and the log-probs a request
asked for.

Each sequence draws exactly one uniform number per sampled token from its own generator,
and its row is processed on its own, so a seeded request yields the same tokens whatever
else shares its batch. The penalties are computed from the sequence's own generated
tokens at every step (not kept in the sampler), so they come out the same on a decode
worker that took the request over after its first token, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

__all__ = ["SamplingState", "sample", "top_logprobs"]

MAX_LOGIT_BIAS = 100.0      # OpenAI: biases are in [-100, 100]
MAX_PENALTY = 2.0           # OpenAI: presence/frequency penalties are in [-2, 2]
MAX_REPETITION_PENALTY = 2.0    # vLLM takes any > 0; past 2 the output is degenerate


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
    guide: Any = None                       # grammar.Guide of a guided request
    min_p: float = 0.0                      # 0: off
    repetition_penalty: float = 1.0         # 1: off
    min_tokens: int = 0                     # stop ids masked until this many are generated
    stop_ids: torch.Tensor | None = None    # what min_tokens masks (EOS and stop_token_ids)

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
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        stop_ids: Sequence[int] = (),
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
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if not 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                             f"got {repetition_penalty}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
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
        stops = None
        if min_tokens and stop_ids:
            stops = torch.tensor(sorted(set(int(t) for t in stop_ids)), dtype=torch.long,
                                 device=device)
        return cls(float(temperature), float(top_p), gen, int(top_k), float(frequency_penalty),
                   float(presence_penalty), bias_ids, bias_values, None, float(min_p),
                   float(repetition_penalty), int(min_tokens), stops)

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def repeats(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def adjusts(self) -> bool:
        """Whether the raw logits are changed before the pick (bias, penalties, or stop
        tokens masked for min_tokens)."""
        return (self.penalized or self.bias_ids is not None or self.repeats
                or self.stop_ids is not None)


def _adjusted(rows: torch.Tensor, states: Sequence[SamplingState],
              generated: Sequence[Sequence[int]],
              contexts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``rows [R, V]`` (a copy the caller owns, updated in place) with each state's
    logit_bias added and its penalties taken off (OpenAI: ``mu[j] - c[j] *
    frequency_penalty - (c[j] > 0) * presence_penalty``, c[j] the count of token j among
    that sequence's generated tokens). The arithmetic runs once for all rows; only the
    bias and the counting are per row."""
    out = rows
    vocab = out.shape[1]
    freq = torch.zeros(len(states), 1, dtype=out.dtype, device=out.device)
    pres = torch.zeros_like(freq)
    counts = None
    for r, (p, gen) in enumerate(zip(states, generated)):
        if p.bias_ids is not None:
            out[r].index_add_(0, p.bias_ids, p.bias_values)
        if p.penalized and gen:
            if counts is None:
                counts = torch.zeros_like(out)
            ids = torch.tensor(gen, dtype=torch.long, device=out.device)
            counts[r] = torch.bincount(ids, minlength=vocab)[:vocab]
            freq[r], pres[r] = p.frequency_penalty, p.presence_penalty
    if counts is not None:
        out -= counts * freq + (counts > 0).to(out.dtype) * pres
    for r, p in enumerate(states):
        if p.repeats and contexts is not None and contexts[r]:
            # HF/vLLM's: every token seen in the prompt or the output has its logit
            # divided by the penalty when positive, multiplied when negative.
            seen = torch.unique(torch.tensor(contexts[r], dtype=torch.long, device=out.device))
            vals = out[r, seen]
            out[r, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                       vals * p.repetition_penalty)
        if p.stop_ids is not None and len(generated[r]) < p.min_tokens:
            out[r, p.stop_ids] = float("-inf")
    return out


def _top(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of a 1-d ``probs`` and their ids, largest first, ties in id order
    (what a stable descending sort gives), by topk rather than a sort of everything; k
    grows past a tie that straddles the cut."""
    n = probs.numel()
    while k < n:
        vals, ids = torch.topk(probs, k + 1)
        if vals[k - 1] > vals[k]:
            vals, ids = vals[:k], ids[:k]
            by_id = torch.argsort(ids)
            vals, ids = vals[by_id], ids[by_id]
            vals, order = torch.sort(vals, descending=True, stable=True)
            return vals, ids[order]
        k *= 2
    return torch.sort(probs, descending=True, stable=True)


NUCLEUS_FIRST_TRY = 64      # candidates tried first for top-p; then 64 times as many


def _sample_row(logits: torch.Tensor, p: _SamplingLike) -> int:
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    min_p = getattr(p, "min_p", 0.0)
    if min_p > 0.0:     # keep tokens at least min_p times as likely as the likeliest
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    n = probs.numel()
    top_k = getattr(p, "top_k", 0)
    if 0 < top_k < n:
        # Top-k first, then the nucleus over what top-k kept (renormalized), as
        # transformers' and vLLM's samplers do.
        probs, ids = _top(probs, top_k)
    elif p.top_p < 1.0:
        # Only the head of the distribution can be in the nucleus: grow a candidate set
        # until it holds top_p of the mass, instead of sorting the whole vocabulary.
        total, want = probs.sum(), NUCLEUS_FIRST_TRY
        while True:
            head, head_ids = _top(probs, min(want, n))
            if want >= n or head.sum() >= p.top_p * total:
                break
            want *= 64
        probs, ids = head, head_ids
        cdf = probs.cumsum(0)
        keep = int(torch.searchsorted(cdf, (p.top_p * total).reshape(1)).item()) + 1
        probs, ids = probs[:keep], ids[:keep]
    else:
        ids = None
    if ids is not None and 0 < top_k < n and p.top_p < 1.0:
        # Nucleus: the smallest highest-probability set whose mass reaches top_p.
        cdf = probs.cumsum(0)
        cut = torch.tensor([p.top_p], dtype=cdf.dtype) * cdf[-1]
        keep = int(torch.searchsorted(cdf, cut).item()) + 1
        probs, ids = probs[:keep], ids[:keep]
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=p.generator, device=logits.device, dtype=cdf.dtype) * cdf[-1]
    idx = min(int(torch.searchsorted(cdf, u, right=True).item()), cdf.numel() - 1)
    return int(ids[idx]) if ids is not None else idx


def sample(logits: torch.Tensor, params: Sequence[_SamplingLike],
           generated: Sequence[Sequence[int]] | None = None,
           contexts: Sequence[Sequence[int]] | None = None) -> list[int]:
    """One token id per row of ``logits [B, V]``.

    Greedy (argmax, ties -> lowest id) when temperature == 0, else temperature + top-k +
    top-p + min-p. ``generated[i]``: row i's tokens generated so far, needed when its state
    has penalties or min_tokens; ``contexts[i]``: all its tokens (prompt and output),
    needed when it has a repetition penalty.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} sampling params")
    out: list[int] = [0] * len(params)
    adjust = [i for i, p in enumerate(params) if getattr(p, "adjusts", False)]
    if adjust:
        logits = logits.float().clone()     # the caller's logits stay as they are
        # (indexing with a list copies the rows, which _adjusted then updates in place)
        logits[adjust] = _adjusted(logits[adjust], [params[i] for i in adjust],
                                   [generated[i] if generated is not None else ()
                                    for i in adjust],
                                   [contexts[i] for i in adjust] if contexts is not None
                                   else None)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, tok in zip(greedy, rows.argmax(dim=-1).tolist()):
            out[i] = tok
    for i, p in enumerate(params):
        if p.temperature != 0.0:
            out[i] = _sample_row(logits[i], p)
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
    chosen_list = chosen[:, 0].tolist()
    k = min(k, lp.shape[1])
    if k == 0:
        return [(c, []) for c in chosen_list]
    if k < lp.shape[1]:
        vals, ids = lp.topk(k + 1, dim=-1)
        if bool((vals[:, k - 1] > vals[:, k]).all()):    # no tie straddles the cut
            vals, ids = vals[:, :k], ids[:, :k]
            by_id = ids.argsort(dim=-1)                   # then ties inside in id order
            vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
            vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)
            ids = ids.gather(1, order)
            return [(c, list(zip(i, v))) for c, i, v in
                    zip(chosen_list, ids.tolist(), vals.tolist())]
    out = []
    for r, c in enumerate(chosen_list):     # a tie at the cut: that row's _top grows past it
        v, i = _top(lp[r], k)
        out.append((c, list(zip(i[:k].tolist(), v[:k].tolist()))))
    return out
