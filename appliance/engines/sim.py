"""The timing simulator: real scheduling and block accounting, no math.

Step times come from the roofline of the device shape and the model shape, divided
by `speed`; tokens come from a seeded generator over the served tokenizer's
vocabulary, so clients see well-formed text and usage counts stay exact.
"""
from __future__ import annotations

import random
import time
import zlib

from appliance.engines.base import BatchEngine, KvLayoutError
from appliance.engines.roofline import StepTimeModel
from appliance.engines.scheduler import Batch
from appliance.engines.sequence import Sequence

# Sleeps shorter than this cost more in timer overhead than they simulate.
MIN_SLEEP_S = 20e-6


class SimEngine(BatchEngine):
    name = "sim"
    simulated = True

    def __init__(self, *, timing: StepTimeModel, vocab_ids: list[int], speed: float = 1.0,
                 **kwargs):
        super().__init__(**kwargs)
        self.timing = timing
        self.vocab_ids = vocab_ids
        self.speed = speed
        m = timing.model
        self._layout = (f"sim-L{m.layers}-kvh{m.kv_heads}-hd{m.head_dim}-"
                        f"bs{self.blocks.block_size}-kvb{m.kv_bytes:g}")

    def layout(self) -> str:
        return self._layout

    def new_sampler(self, request_id: str, params, drawn: int = 0) -> random.Random:
        seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        rng = random.Random(seed)
        for _ in range(drawn):
            rng.randrange(len(self.vocab_ids))
        return rng

    def _sleep(self, seconds: float) -> None:
        seconds /= self.speed
        if seconds >= MIN_SLEEP_S:
            time.sleep(seconds)

    def run_batch(self, batch: Batch) -> list[int | None]:
        ids = self.vocab_ids
        P = batch.num_prefill
        if not P:
            self._sleep(self.timing.decode_s([len(s.tokens) for s in batch.seqs]))
            return [ids[s.sampler.randrange(len(ids))] for s in batch.seqs]
        # Prompts (or chunks) and, in a mixed batch, one new token per decoding sequence
        # over its cached context: one pass over the weights for all of them.
        new = [s.step_tokens if i < P else 1 for i, s in enumerate(batch.seqs)]
        self._sleep(self.timing.prefill_s(new, [s.num_cached for s in batch.seqs]))
        return [ids[s.sampler.randrange(len(ids))] if i >= P or s.step_tokens == s.uncached
                else None for i, s in enumerate(batch.seqs)]

    def import_kv(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.handle.layout != self._layout:
                raise KvLayoutError(f"layout {seq.handle.layout} != {self._layout}")
        self._sleep(sum(self.timing.transfer_s(s.handle.num_tokens) for s in seqs))
