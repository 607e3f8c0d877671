"""The timing simulator: real scheduling and block accounting, no math.

Step times come from the roofline of the device shape and the model shape, divided
by `speed`; tokens come from a seeded generator over the served tokenizer's
vocabulary, so clients see well-formed text and usage counts stay exact.

The simulated clock (`sim_clock`) is the simulated device's own time: the modelled
seconds of the steps it has run. It does not move with the wall between steps, so the
daemon's latency and the machine's load (which stretch what a client measures) do not
reach it. Each request's arrival (when the worker read it off its socket) is placed on
it at the point of the step under way it arrived in: the step's share of the wall is its
sleep and the worker's own time before it (at most as long again), so a loaded machine,
which stretches those gaps, places arrivals no differently; after the last step, at its
end. A prompt's simulated time to first token is the clock at the end of the step that
makes its first token, less its arrival: the steps it waited for (the rest of the one
under way, then whatever the scheduler ran before it) and its own. `PrefillDone`
carries it (`simulated_ttft_s`), the request's record too.
"""
from __future__ import annotations

import random
import time
import zlib

from appliance.engines.base import BatchEngine, KvLayoutError
from appliance.engines.fair_queue import chunk_for_step_time
from appliance.engines.grammar import GrammarBook
from appliance.engines.messages import Decode, Prefill, RequestFailed
from appliance.engines.roofline import StepTimeModel
from appliance.engines.scheduler import Batch
from appliance.engines.sequence import Sequence

# Sleeps shorter than this cost more in timer overhead than they simulate.
MIN_SLEEP_S = 20e-6


class SimSampler(random.Random):
    """The simulator's per-request generator, and the request's grammar if it has one."""

    guide = None


class SimEngine(BatchEngine):
    name = "sim"
    simulated = True
    kv_transport = "sim"

    def __init__(self, *, timing: StepTimeModel, vocab_ids: list[int], speed: float = 1.0,
                 grammar: GrammarBook | None = None, **kwargs):
        self.timing = timing        # (before the scheduler is built: it sizes the fair chunk)
        super().__init__(**kwargs)
        self.vocab_ids = vocab_ids
        self.grammar = grammar
        # What a guided pick may take: the regular ids and the end-of-sequence ones.
        self._pickable = set(vocab_ids) | set(self.eos_token_ids)
        self.speed = speed
        self.sim_clock = 0.0
        # The last step: the start of its share of the wall (the worker's time since the
        # step before, then its sleep) and its end (time.time()), its start on the clock.
        self._wall_start = self._wall_end = 0.0
        self._sim_start = 0.0
        m = timing.model
        self._layout = (f"sim-L{m.layers}-kvh{m.kv_heads}-hd{m.head_dim}-"
                        f"bs{self.blocks.block_size}-kvb{m.kv_bytes:g}")

    def layout(self) -> str:
        return self._layout

    def default_fair_chunk(self, max_batch_tokens: int) -> int:
        """The chunk whose step the roofline times at ~50 ms on this device (simulated
        time: the same whatever `speed`)."""
        return chunk_for_step_time(lambda n: self.timing.prefill_s([n], [0]),
                                   align=self.blocks.block_size, lo=self.blocks.block_size,
                                   hi=max(self.blocks.block_size, max_batch_tokens))

    def add(self, msg: Prefill | Decode, received: float | None = None) -> list:
        try:
            events = super().add(msg, received)
        except ValueError as exc:     # a grammar this worker cannot compile
            return [RequestFailed(msg.request_id, str(exc), "invalid_request")]
        seq = self._seqs.get(msg.request_id)
        if seq is not None and not events:
            seq.sim_arrival = self.sim_time_at(seq.arrival)
        return events

    def sim_time_at(self, wall: float) -> float:
        """`wall` (time.time()) on the simulated clock: within the last step's share of the
        wall, at the same fraction of the step; after it, its end; before it, its start."""
        if wall >= self._wall_end:
            return self.sim_clock
        span = self._wall_end - self._wall_start
        into = (wall - self._wall_start) / span if span > 0 else 1.0
        return self._sim_start + min(max(0.0, into), 1.0) * (self.sim_clock - self._sim_start)

    def new_sampler(self, request_id: str, params, drawn: int = 0) -> SimSampler:
        seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        rng = SimSampler(seed)
        if params.guided is not None:
            if self.grammar is None:
                raise ValueError("guided decoding needs the model's tokenizer, which this "
                                 "engine was built without")
            rng.guide = self.grammar.guide(params.guided)
        for _ in range(drawn):
            rng.randrange(len(self.vocab_ids))
        return rng

    def _pick(self, seq: Sequence) -> int:
        """A random regular token; for a guided request a random one among those its
        grammar allows, so simulated output is valid for the request's schema."""
        rng = seq.sampler
        if rng.guide is None:
            return self.vocab_ids[rng.randrange(len(self.vocab_ids))]
        allowed = self.grammar.allowed(rng.guide, seq.generated)
        pickable = [t for t in allowed if t in self._pickable] or allowed
        return pickable[rng.randrange(len(pickable))]

    def _sleep(self, seconds: float) -> None:
        """One step of `seconds` simulated time: the clock moves by it, the wall by
        `seconds / speed`."""
        now = time.time()
        self._wall_start = max(self._wall_end, now - seconds / self.speed)
        self._sim_start = self.sim_clock
        self.sim_clock += seconds
        seconds /= self.speed
        if seconds >= MIN_SLEEP_S:
            time.sleep(seconds)
        self._wall_end = time.time()

    def run_batch(self, batch: Batch) -> list[int | None]:
        P = batch.num_prefill
        if not P:
            self._sleep(self.timing.decode_s([len(s.tokens) for s in batch.seqs]))
            return [self._pick(s) for s in batch.seqs]
        # Prompts (or chunks) and, in a mixed batch, one new token per decoding sequence
        # over its cached context: one pass over the weights for all of them.
        new = [s.step_tokens if i < P else 1 for i, s in enumerate(batch.seqs)]
        self._sleep(self.timing.prefill_s(new, [s.num_cached for s in batch.seqs]))
        for s in batch.seqs[:P]:
            if s.step_tokens == s.uncached and s.sim_ttft is None:   # its first token
                s.sim_ttft = self.sim_clock - s.sim_arrival
        return [self._pick(s) if i >= P or s.step_tokens == s.uncached
                else None for i, s in enumerate(batch.seqs)]

    def import_kv(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.handle.layout != self._layout:
                raise KvLayoutError(f"layout {seq.handle.layout} != {self._layout}")
        self._sleep(sum(self.timing.transfer_s(s.handle.num_tokens) for s in seqs))

    def kv_import_bytes(self, seq: Sequence) -> int:
        """The modelled bytes: the handle's tokens at the model's KV bytes per token."""
        return int(seq.handle.num_tokens * self.timing.model.kv_bytes_per_token())

    def kv_import_seconds(self, seqs: list[Sequence], wall_s: float) -> list[float]:
        """The modelled time on the simulated link (not the sleep, which `speed` divides)."""
        return [self.timing.transfer_s(s.handle.num_tokens) for s in seqs]
