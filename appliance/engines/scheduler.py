"""Decides what runs next; knows nothing of tensors or time.

Prefill-first and never mixed (nano-vllm's rule): a step is either a batch of
prompts under a token budget, or one decode token for every running sequence.
Sequences arriving with a KV handle (disaggregated decode) skip prefill: they are
admitted in a `kv_import` step that copies their blocks in.

Chunked prefill (`chunk_tokens` > 0) lifts the never-mixed rule: every step decodes one
token for each running sequence and carries at most `chunk_tokens` prompt tokens along
(a `mixed` batch: prompts first, then the decoding sequences), splitting longer prompts
over several steps; each chunk attends over the KV of the ones before, as a prefix-cache
hit does. A long prompt then delays the running sequences by one chunk's worth of work
per step instead of stalling them for its whole prefill, and the decode tokens ride on
the weight reads the chunk makes anyway. `seq.step_tokens` says how many prompt tokens
of a sequence a step computes.

When a decode step cannot get a block, the newest running sequence is preempted
and recomputed later (its generated tokens stay, so no output is lost).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from appliance.engines.block_manager import BlockManager
from appliance.engines.sequence import Role, Sequence, Status


@dataclass(slots=True)
class Batch:
    phase: str                    # "prefill" | "decode" | "kv_import" | "mixed"
    seqs: list[Sequence]
    num_prefill: int = 0          # seqs[:num_prefill] are prompts (all of a prefill batch)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_seqs: int,
                 chunk_tokens: int = 0):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []   # admitted, prompt partly computed (chunked)
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def queued_prefill_tokens(self) -> int:
        return (sum(s.uncached for s in self.waiting if s.handle is None)
                + sum(s.uncached for s in self.prefilling))

    def schedule(self) -> Batch | None:
        admitted = len(self.running) + len(self.prefilling)
        if self.waiting and admitted < self.max_seqs and not self.prefilling \
                and self.waiting[0].handle is not None:
            batch = self._admit_imports()      # a copy, no forward pass: a step of its own
            if batch is not None:
                return batch
        if self.chunk_tokens:
            return self._mixed()
        if self.prefilling or (self.waiting and admitted < self.max_seqs):
            batch = self._admit_prefills()
            if batch is not None:
                return batch
        if self.running:
            return self._decode()
        return None

    def _mixed(self) -> Batch | None:
        decode = self._decode().seqs if self.running else []
        prompts = self._admit_prefills()
        if prompts is None:
            return Batch("decode", decode) if decode else None
        if not decode:
            return prompts
        return Batch("mixed", prompts.seqs + decode, len(prompts.seqs))

    def _admit_imports(self) -> Batch | None:
        seqs = []
        while (self.waiting and self.waiting[0].handle is not None
               and len(self.running) + len(seqs) < self.max_seqs):
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq, use_cache=False):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, use_cache=False, run=True)
            seqs.append(seq)
        return Batch("kv_import", seqs) if seqs else None

    def _admit_prefills(self) -> Batch | None:
        chunked = self.chunk_tokens > 0
        budget = self.chunk_tokens if chunked else self.max_batch_tokens
        seqs: list[Sequence] = []
        tokens = 0
        for seq in self.prefilling:        # prompts already under way go on first
            if tokens >= budget:
                break
            seq.step_tokens = min(seq.uncached, budget - tokens)
            tokens += seq.step_tokens
            seqs.append(seq)
        room = self.max_seqs - len(self.running) - len(self.prefilling)
        while (self.waiting and self.waiting[0].handle is None and room > 0
               and not (chunked and tokens >= budget)):
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq):
                break
            # Unchunked, a prompt longer than the budget runs alone rather than never.
            # Checked before allocating: a trial allocation would evict cached prefixes.
            uncached = len(seq.tokens) - self.blocks.cached_tokens(seq)
            if not chunked and seqs and tokens + uncached > budget:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.step_tokens = min(seq.uncached, budget - tokens) if chunked else seq.uncached
            tokens += seq.step_tokens
            seqs.append(seq)
            room -= 1
        if not seqs:
            return None
        for seq in seqs:
            seq.status = Status.RUNNING
            done = seq.step_tokens == seq.uncached   # its first token comes out of this step
            if seq in self.prefilling:
                if done:
                    self.prefilling.remove(seq)
                    self.running.append(seq)
            else:
                (self.running if done else self.prefilling).append(seq)
        return Batch("prefill", seqs, len(seqs))

    def _decode(self) -> Batch:
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_block(seq)
                batch.append(seq)
        return Batch("decode", batch)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        if seq.role is Role.DECODE:
            seq.role = Role.FULL       # recompute here; the KV is gone from its source
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """A sequence whose KV import was given up (its blocks already freed): it is
        recomputed here, first in line, like a preempted one."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.handle = None
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.role = Role.FULL
        self.waiting.appendleft(seq)

    def mark_imported(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.handle = None
            seq.status = Status.RUNNING
        self.running.extend(seqs)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the schedule; its blocks are the caller's business."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)     # (an import in flight is in neither list)
        seq.status = Status.FINISHED
