"""Decides what runs next; knows nothing of tensors or time.

Prefill-first and never mixed (nano-vllm's rule): a step is either a batch of
prompts under a token budget, or one decode token for every running sequence.
Sequences arriving with a KV handle (disaggregated decode) skip prefill: they are
admitted in a `kv_import` step that copies their blocks in (or, from another box, starts
the pull: the sequence waits in `importing` until its KV has arrived).

Chunked prefill (`chunk_tokens` > 0) lifts the never-mixed rule: every step decodes one
token for each running sequence and carries at most `chunk_tokens` prompt tokens along
(a `mixed` batch: prompts first, then the decoding sequences), splitting longer prompts
over several steps; each chunk attends over the KV of the ones before, as a prefix-cache
hit does. A long prompt then delays the running sequences by one chunk's worth of work
per step instead of stalling them for its whole prefill, and the decode tokens ride on
the weight reads the chunk makes anyway. `seq.step_tokens` says how many prompt tokens
of a sequence a step computes.

Riding prompts (`ride_rows` > 0, a CPU decode worker whose decode steps run in one C
call): while fewer than `ride_rows` sequences decode, a prompt of the worker's own goes
along in chunks of the rows left (`ride_rows` minus the decoding ones) instead of in one
step that pauses them. A decode step of a few rows is bound by reading the weights, not
by the products; up to the matmul kernel's tile of rows (8) more rows cost a fraction of
what they cost in a prompt's step (on the 82m model, 4 -> 8 rows: 6.7 -> 8.9 ms), so
those prompt tokens ride on reads the decodes make anyway. With that many or more
decoding, the rows are compute-bound either way and the prompt runs whole, as before.

When a decode step cannot get a block, the newest running sequence is preempted
and recomputed later (its generated tokens stay, so no output is lost).

Fair queuing: while the prompts waiting (or part-prefilled) belong to more than one
tenant or priority class, which of them join the next prefill step is decided by
`engines.fair_queue`'s virtual clock (prompt tokens served / the tenant's weight; the
best priority class first), not by arrival order, and the step's prompt budget shrinks
to `fair_chunk_tokens` with long prompts split into chunks: a short prompt arriving
behind a flood of long ones waits for at most one chunk, and gets into the very next
step. The steps stay that short while more than one tenant has sent requests within
`SHARED_WINDOW_S` (by the requests' arrival times), so a prompt arriving just after a
long one started waits for that one chunk, not for the whole long prompt. Within a
step the budget is granted a quantum at a time, so one tenant's long prompt cannot take
the whole step while another's short one waits. One tenant (the common case) costs two
length checks per step: arrival order and whole prompts, exactly as before.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from appliance.engines.block_manager import BlockManager
from appliance.engines.fair_queue import VirtualClock
from appliance.engines.sequence import Role, Sequence, Status

# How long after a second tenant's last request the box still counts as shared (steps
# of one fair chunk) rather than one tenant's (whole prompts, up to the token budget).
SHARED_WINDOW_S = 10.0


@dataclass(slots=True)
class Batch:
    phase: str                    # "prefill" | "decode" | "kv_import" | "mixed"
    seqs: list[Sequence]
    num_prefill: int = 0          # seqs[:num_prefill] are prompts (all of a prefill batch)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_seqs: int,
                 chunk_tokens: int = 0, fair_chunk_tokens: int = 0, fair: bool = True,
                 ride_rows: int = 0):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.chunk_tokens = chunk_tokens
        # The prompt budget of a step while tenants contend (0: no chunking for fairness,
        # only the reordering); `chunk_tokens`, when set, takes its place.
        self.fair_chunk_tokens = fair_chunk_tokens
        self.fair = fair          # False: arrival order whatever the tenants (as before)
        self.ride_rows = ride_rows      # > 0: prompts ride on small decode steps (above)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []   # admitted, prompt partly computed (chunked)
        # Admitted with their blocks allocated, their KV still arriving from another box
        # (an asynchronous pull): not scheduled until `mark_imported` (or `requeue`).
        self.importing: list[Sequence] = []
        self.preemptions = 0
        self.clock = VirtualClock()
        # Sequences in the schedule per (priority, tenant): more than one key is the only
        # case where fairness has anything to decide.
        self._classes: dict[tuple[int, str], int] = {}
        # Tenant -> its latest request's arrival, for the tenants that sent one within
        # SHARED_WINDOW_S of the newest: while there are two, the box is shared.
        self._seen: dict[str, float] = {}

    def add(self, seq: Sequence) -> None:
        key = (seq.priority, seq.tenant)
        self._classes[key] = self._classes.get(key, 0) + 1
        self.waiting.append(seq)
        seen = self._seen
        if seen.get(seq.tenant, -1.0) < seq.arrival:
            seen[seq.tenant] = seq.arrival
        if len(seen) > 1:
            cut = seq.arrival - SHARED_WINDOW_S
            for tenant in [t for t, at in seen.items() if at < cut]:
                del seen[tenant]

    @property
    def shared(self) -> bool:
        """More than one tenant sent requests lately: prefill steps stay one fair chunk
        long, so the next tenant to arrive waits behind at most one chunk, not behind a
        whole long prompt that started just before it."""
        return self.fair and len(self._seen) > 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.importing)

    def queued_prefill_tokens(self) -> int:
        return (sum(s.uncached for s in self.waiting if s.handle is None)
                + sum(s.uncached for s in self.prefilling))

    def schedule(self) -> Batch | None:
        admitted = len(self.running) + len(self.prefilling) + len(self.importing)
        # (a riding prompt's chunks take many steps: the handed-off sequences come in
        # meanwhile, to decode under it)
        if self.waiting and admitted < self.max_seqs and (self.ride_rows or not self.prefilling) \
                and self.waiting[0].handle is not None:
            batch = self._admit_imports()      # a copy, no forward pass: a step of its own
            if batch is not None:
                return batch
        if self.chunk_tokens:
            return self._mixed()
        if self.ride_rows and self.running and (self.prefilling or self.waiting):
            batch = self._ride()
            if batch is not None:
                return batch
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

    def _ride(self) -> Batch | None:
        """A decode step carrying the rows it has room for of a prompt (`ride_rows`), or
        None: the next prompt is not one to ride (`Sequence.ride`: the router sent it to
        run whole), or too many decode."""
        prompt = self.prefilling[0] if self.prefilling else self.waiting[0]
        if not prompt.ride or prompt.handle is not None:
            return None
        decoding = sum(1 for s in self.running if s.status is Status.RUNNING)
        room = self.ride_rows - decoding
        if room < 1:
            return None
        decode = self._decode().seqs        # (before the prompts: one finishing here
        prompts = self._admit_prefills(room)  # joins the running ones for the next step)
        if prompts is None:
            return Batch("decode", decode) if decode else None
        if not decode:
            return prompts
        return Batch("mixed", prompts.seqs + decode, len(prompts.seqs))

    def _admit_imports(self) -> Batch | None:
        seqs = []
        while (self.waiting and self.waiting[0].handle is not None
               and len(self.running) + len(self.importing) + len(seqs) < self.max_seqs):
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq, use_cache=False):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, use_cache=False, run=True)
            seqs.append(seq)
        return Batch("kv_import", seqs) if seqs else None

    def _admit_prefills(self, ride: int = 0) -> Batch | None:
        """A prefill step's prompts; `ride` > 0: at most that many tokens, chunked (a
        decode step's spare rows, `_ride`)."""
        if ride:
            chunked, budget = True, ride
        elif len(self._classes) > 1 and self.fair and len(queues := self._prompt_queues()) > 1:
            return self._admit_fair(queues)
        elif self.shared:
            chunked, budget = True, self.fair_budget()
        else:
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
        room = self.max_seqs - len(self.running) - len(self.prefilling) - len(self.importing)
        while (self.waiting and self.waiting[0].handle is None and room > 0
               and not (chunked and tokens >= budget) and (not ride or self.waiting[0].ride)):
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
        return self._started(seqs)

    def _started(self, seqs: list[Sequence]) -> Batch | None:
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

    def _prompt_queues(self) -> dict[tuple[int, str], deque[Sequence]]:
        """The prompts that could go next, per (priority, tenant), in each one's order:
        part-prefilled ones first, then the waiting ones as they queue (a preempted
        sequence is at the front)."""
        queues: dict[tuple[int, str], deque[Sequence]] = {}
        for seq in self.prefilling:
            queues.setdefault((seq.priority, seq.tenant), deque()).append(seq)
        for seq in self.waiting:
            if seq.handle is None:
                queues.setdefault((seq.priority, seq.tenant), deque()).append(seq)
        return queues

    def fair_budget(self) -> int:
        """The prompt tokens of one step while tenants contend."""
        return self.chunk_tokens or self.fair_chunk_tokens or self.max_batch_tokens

    def _admit_fair(self, queues: dict[tuple[int, str], deque[Sequence]]) -> Batch | None:
        """A prefill step for contending tenants: the best priority class first, within
        it the tenant least served for its weight, a quantum at a time, until the fair
        budget is spent. A prompt that does not fit whole is chunked."""
        budget = self.fair_budget()
        quantum = max(self.blocks.block_size, budget // 4)
        clock = self.clock
        for _, tenant in queues:
            clock.join(tenant)
        room = self.max_seqs - len(self.running) - len(self.prefilling) - len(self.importing)
        seqs: list[Sequence] = []
        granted: dict[int, int] = {}       # id(seq) -> tokens this step
        tokens = 0
        while queues and tokens < budget:
            key = min(queues, key=lambda k: (k[0], clock.time(k[1]), len(queues[k])))
            queue = queues[key]
            seq = queue[0]
            if id(seq) not in granted and seq not in self.prefilling:
                if room <= 0 or not self.blocks.can_admit(seq):
                    del queues[key]        # its turn passes; the others may still fit
                    continue
                self.waiting.remove(seq)
                self.blocks.allocate(seq)
                room -= 1
            if id(seq) not in granted:
                granted[id(seq)] = 0
                seqs.append(seq)
            left = seq.uncached - granted[id(seq)]
            grant = min(left, budget - tokens, quantum)
            granted[id(seq)] += grant
            tokens += grant
            clock.charge(seq.tenant, seq.weight, grant)
            if grant == left:
                queue.popleft()
                if not queue:
                    del queues[key]
        for seq in seqs:
            seq.step_tokens = granted[id(seq)]
        return self._started(seqs)

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
        if seq in self.importing:
            self.importing.remove(seq)
        seq.handle = None
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.role = Role.FULL
        self.waiting.appendleft(seq)

    def mark_imported(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq in self.importing:
                self.importing.remove(seq)
            seq.handle = None
            seq.status = Status.RUNNING
        self.running.extend(seqs)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the schedule; its blocks are the caller's business."""
        if seq.status is not Status.FINISHED:
            key = (seq.priority, seq.tenant)
            left = self._classes.get(key, 0) - 1
            if left > 0:
                self._classes[key] = left
            else:
                self._classes.pop(key, None)
                if not self._classes:
                    self.clock.forget(())
        if seq in self.importing:
            self.importing.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)     # (an import in flight is in neither list)
        seq.status = Status.FINISHED
