"""Which worker gets a request: the router's policy, one implementation for the live
daemon (`appliance.daemon.router`) and the planner's replay (`appliance.planner.cluster_sim`).

- A prompt (prefill, or the whole request on an aggregated worker) goes to the worker with
  the fewest queued prompt tokens, then the fewest requests in flight.
- A handed-off request goes to the decode worker with the most free KV blocks (as last
  reported, less the blocks already sent its way and not yet imported), then the fewest
  in flight. This is Dynamo's cost idea without the overlap term, until there is a
  cross-worker prefix index.
- Ties go round-robin: the candidates are rotated one place per pick, per role.

Pure: it knows workers only by the counters below, so it sits beneath the daemon and
the planner alike.
"""
from __future__ import annotations

import itertools
from typing import Callable, Protocol, Sequence, TypeVar

__all__ = ["Queued", "Rotation", "least_queued", "most_free"]


class Queued(Protocol):
    """What the policy reads of a worker."""

    pending_prefill_tokens: int
    inflight: int


W = TypeVar("W", bound=Queued)


class Rotation:
    """Round-robin tie-breaking: each pick for a role starts one worker further on."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count] = {}

    def rotate(self, workers: Sequence[W], role: str) -> list[W]:
        k = next(self._turns.setdefault(role, itertools.count())) % len(workers)
        return list(workers[k:]) + list(workers[:k])


def least_queued(candidates: Sequence[W]) -> W:
    """The worker for a prompt: fewest queued prompt tokens, then fewest in flight (the
    first of equals, so rotate the candidates for round-robin ties)."""
    return min(candidates, key=lambda w: (w.pending_prefill_tokens, w.inflight))


def most_free(candidates: Sequence[W], free_blocks: Callable[[W], int]) -> W:
    """The decode worker for a handed-off request: most free KV blocks (`free_blocks`:
    free less in flight to it), then fewest in flight."""
    return max(candidates, key=lambda w: (free_blocks(w), -w.inflight))
