"""A request as the scheduler sees it: tokens, blocks, and what to do after prefill."""
from __future__ import annotations

import enum
from typing import Any

from appliance.engines.messages import KvHandle, SamplingParams


class Role(enum.Enum):
    FULL = "full"          # prefill then decode here (agg, or a preempted decode)
    PREFILL = "prefill"    # prefill, then hand the KV off and stop
    DECODE = "decode"      # import KV from a prefill worker, then decode


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    __slots__ = (
        "request_id", "tokens", "num_prompt", "params", "role", "status",
        "block_table", "num_cached", "handle", "sampler", "reserved_blocks",
        "prefix_hit", "arrival", "hashed_blocks", "chain_hash", "step_tokens", "logprob",
        "prompt_lps", "released_blocks", "tenant", "weight", "priority",
        "sim_arrival", "sim_ttft", "ride",
    )

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 role: Role, handle: KvHandle | None = None, first_token: int | None = None,
                 arrival: float = 0.0, tenant: str = "", weight: float = 1.0,
                 priority: int = 0):
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.params = params
        self.role = role
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.released_blocks = 0     # leading table entries given back (-1): behind every window
        self.num_cached = 0          # tokens whose KV is in this worker's pool
        self.handle = handle         # KV to import (DECODE role)
        self.sampler: Any = None     # engine-specific sampling state (rng, generator)
        self.reserved_blocks = 0     # decode reservation held by this sequence
        self.prefix_hit = 0          # prompt tokens served from the prefix cache
        self.arrival = arrival
        self.hashed_blocks = 0       # full blocks whose hash is in the prefix cache
        self.chain_hash = 0          # hash chain value after those blocks
        self.step_tokens = 0         # prompt tokens the current prefill step computes
        self.logprob: Any = None     # the last sampled token's TokenLogprob, if asked for
        # Whose it is, for fair queuing (`engines.fair_queue`): an opaque name, its weight,
        # its priority class (lower first).
        self.tenant = tenant
        self.weight = weight
        self.priority = priority
        self.ride = False            # its prompt may ride on decode steps (Scheduler.ride_rows)
        # The simulator's clock at arrival, and the simulated seconds from it to the first
        # token (`engines.sim`; None on real engines).
        self.sim_arrival = 0.0
        self.sim_ttft: float | None = None
        # Prompt logprobs gathered chunk by chunk until the first token goes out with them.
        self.prompt_lps: list | None = None
        if params.prompt_logprobs is not None and first_token is None:
            self.prompt_lps = [None]
        if first_token is not None:
            self.tokens.append(first_token)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not yet sent (they go out with the first token):
        every prompt position's logits are needed, so none may come from the prefix cache."""
        return self.prompt_lps is not None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def uncached(self) -> int:
        """Tokens that the next forward pass must compute."""
        return len(self.tokens) - self.num_cached

    def remaining_output(self) -> int:
        return max(0, self.params.max_tokens - self.num_output)
