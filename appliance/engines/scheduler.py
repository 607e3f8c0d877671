"""Decides what runs next; knows nothing of tensors or time.

Prefill-first and never mixed (nano-vllm's rule): a step is either a batch of
prompts under a token budget, or one decode token for every running sequence.
Sequences arriving with a KV handle (disaggregated decode) skip prefill: they are
admitted in a `kv_import` step that copies their blocks in.

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
    phase: str                    # "prefill" | "decode" | "kv_import"
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_seqs: int):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        return sum(s.uncached for s in self.waiting if s.handle is None)

    def schedule(self) -> Batch | None:
        if self.waiting and len(self.running) < self.max_seqs:
            if self.waiting[0].handle is not None:
                batch = self._admit_imports()
            else:
                batch = self._admit_prefills()
            if batch is not None:
                return batch
        if self.running:
            return self._decode()
        return None

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
        seqs: list[Sequence] = []
        tokens = 0
        while (self.waiting and self.waiting[0].handle is None
               and len(self.running) + len(seqs) < self.max_seqs):
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq):
                break
            # A prompt longer than the budget runs alone rather than never. Checked
            # before allocating: a trial allocation would evict cached prefixes.
            uncached = len(seq.tokens) - self.blocks.cached_tokens(seq)
            if seqs and tokens + uncached > self.max_batch_tokens:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            tokens += seq.uncached
            seqs.append(seq)
        if not seqs:
            return None
        for seq in seqs:
            seq.status = Status.RUNNING
        self.running.extend(seqs)
        return Batch("prefill", seqs)

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

    def mark_imported(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.handle = None
            seq.status = Status.RUNNING
        self.running.extend(seqs)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the schedule; its blocks are the caller's business."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)     # (an import in flight is in neither list)
        seq.status = Status.FINISHED
