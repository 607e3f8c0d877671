"""Paged KV bookkeeping: which blocks each sequence holds, shared prefixes, reservations.

Knows blocks only, not tensors: the simulator and the torch engine share it, and only
the torch engine has a pool behind the ids.

Invariants:
- a block is either free (ref 0, in `_free`, `_free_map[b] == 1`) or used (ref > 0);
  never both.
- a free block may still carry the hash of its full contents: it is a prefix-cache
  entry until it is handed out again (LRU order: the longest-free goes first).
- a table entry of -1 is a block given back while its sequence runs (`release_before`:
  every layer's sliding window has passed it); it is never read again.
- `reserved` <= number of free blocks: blocks promised to admitted sequences for their
  future decode steps. New admissions only see `free - reserved`, so an admitted
  sequence with a full reservation never runs out of KV (mini-sglang's rule).
"""
from __future__ import annotations

from collections import OrderedDict

from appliance.engines.sequence import Role, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserve_ratio: float = 1.0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserve_ratio = reserve_ratio
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_map = bytearray(b"\x01") * num_blocks   # 1 = free: runs found in C
        self._by_hash: dict[int, int] = {}
        self.reserved = 0

    # ---- queries ----------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Free blocks not promised to anyone."""
        return len(self._free) - self.reserved

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain(self, tokens: list[int], upto: int):
        """Yield (hash, block_tokens) for each full block of tokens[:upto]."""
        bs = self.block_size
        h = 0
        for start in range(0, upto - upto % bs, bs):
            chunk = tuple(tokens[start:start + bs])
            h = hash((h, chunk))
            yield h, chunk

    def _lookup(self, h: int, chunk: tuple[int, ...]) -> int | None:
        block = self._by_hash.get(h)
        if block is not None and self._tokens[block] == chunk:
            return block
        return None

    def _cache_hits(self, seq: Sequence) -> list[int]:
        # The last token is always recomputed: its logits give the next token.
        if seq.needs_prompt_logits:
            return []
        hits = []
        for h, chunk in self._chain(seq.tokens, len(seq.tokens) - 1):
            block = self._lookup(h, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens allocate() would serve from the prefix cache right now."""
        return len(self._cache_hits(seq)) * self.block_size

    def _reservation(self, seq: Sequence, total_blocks_now: int) -> int:
        if seq.role is Role.PREFILL:
            return 0        # hands its KV off after the first token: never decodes here
        future = int(seq.remaining_output() * self.reserve_ratio)
        # Never more than the pool: the engine ends a sequence at the pool's capacity.
        need = min(self.blocks_for(len(seq.tokens) + future), self.num_blocks)
        return max(0, need - total_blocks_now)

    def admission_cost(self, seq: Sequence, use_cache: bool = True) -> tuple[int, int]:
        """(free blocks this sequence would take now, blocks it would reserve)."""
        hits = self._cache_hits(seq) if use_cache else []
        hits_in_free = sum(1 for b in hits if self._ref[b] == 0)
        total = self.blocks_for(len(seq.tokens))
        take = total - len(hits) + hits_in_free
        return take, self._reservation(seq, total)

    def can_admit(self, seq: Sequence, use_cache: bool = True) -> bool:
        take, reserve = self.admission_cost(seq, use_cache)
        return take + reserve <= self.available

    # ---- changes ----------------------------------------------------------
    def _take_free(self, block: int | None = None) -> int:
        """Hand out `block`, or the least recently freed block."""
        if block is None:
            block, _ = self._free.popitem(last=False)
        else:
            del self._free[block]
        self._free_map[block] = 0
        h = self._hash[block]
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]
        self._hash[block] = None
        self._tokens[block] = None
        self._ref[block] = 1
        return block

    def allocate(self, seq: Sequence, use_cache: bool = True, run: bool = False) -> None:
        """Give seq blocks for all its tokens, reusing cached full-block prefixes.

        Which fresh blocks: the least recently freed (exact LRU, so cached prefixes live
        as long as possible), in ascending order: freed sequences leave runs of
        neighbouring ids, and sorted they become runs in the table. With `run` (KV
        imports) the first free run long enough is taken instead when there is one: the
        handoff then writes one slice of the pool (see kv.blocks.copy_blocks), else a
        few long runs. That may evict cached blocks out of LRU order, which on a
        decode worker only serve its own occasional local prefills."""
        hits = self._cache_hits(seq) if use_cache else []
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]
                self._free_map[block] = 0
            self._ref[block] += 1
        need = self.blocks_for(len(seq.tokens)) - len(hits)
        if run and need > 0:
            fresh = self._take_runs(need)
        else:
            fresh = sorted(self._take_free() for _ in range(need))
        table = hits + fresh
        seq.block_table = table
        seq.num_cached = len(hits) * self.block_size
        seq.hashed_blocks = len(hits)
        seq.chain_hash = self._hash[hits[-1]] if hits else 0
        seq.prefix_hit = seq.num_cached
        seq.reserved_blocks = self._reservation(seq, len(table))
        self.reserved += seq.reserved_blocks

    def _take_runs(self, need: int) -> list[int]:
        """Take `need` free blocks in few runs of consecutive ids, ascending: the first
        free run long enough, else runs found by halving the length sought (first fit at
        each length). Each search is one `bytearray.find` in C, resumed where the last
        one stopped: O(pool x log need) byte compares however fragmented the pool is."""
        fm = self._free_map
        taken: list[int] = []
        length, pos = need, 0
        while len(taken) < need:
            want = need - len(taken)
            if length > want:
                length, pos = want, 0
            start = fm.find(b"\x01" * length, pos)
            if start < 0:
                length, pos = max(1, length // 2), 0
                continue
            end = start + length
            while end < len(fm) and end - start < want and fm[end]:
                end += 1
            taken.extend(self._take_free(b) for b in range(start, end))
            pos = end
        return sorted(taken)

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of seq's full, computed blocks so later requests hit them.

        Called after a forward pass, never at allocation: a block must hold real KV
        before another sequence may read it."""
        # Incremental: continue the chain from the last hashed block, so a decode step
        # costs one hash per newly full block, not one per block of the context.
        bs = self.block_size
        full = seq.num_cached // bs
        h = seq.chain_hash
        for i in range(seq.hashed_blocks, full):
            chunk = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = hash((h, chunk))
            block = seq.block_table[i]
            if self._hash[block] is None:
                self._hash[block] = h
                self._tokens[block] = chunk
                self._by_hash.setdefault(h, block)
        if full > seq.hashed_blocks:
            seq.hashed_blocks, seq.chain_hash = full, h

    def needs_block(self, seq: Sequence) -> bool:
        return len(seq.tokens) > len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        if not self.needs_block(seq):
            return True
        return seq.reserved_blocks > 0 or self.available > 0

    def append_block(self, seq: Sequence) -> None:
        """Make room for seq's newest token (called before a decode step)."""
        if not self.needs_block(seq):
            return
        if seq.reserved_blocks > 0:
            seq.reserved_blocks -= 1
            self.reserved -= 1
        seq.block_table.append(self._take_free())

    def release_before(self, seq: Sequence, position: int) -> int:
        """Give back seq's blocks that hold only positions before `position`: KV no layer
        reads again (a model whose every layer slides, past its widest window). Their
        table entries become -1; their hashes stay, so until they are handed out again
        they still serve as prefix-cache entries (they hold that prefix's KV). Returns
        how many blocks were given back."""
        upto = min(max(0, position) // self.block_size, len(seq.block_table))
        released = 0
        for i in range(seq.released_blocks, upto):
            block = seq.block_table[i]
            seq.block_table[i] = -1
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                self._free_map[block] = 1
            released += 1
        seq.released_blocks = max(seq.released_blocks, upto)
        return released

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            if block < 0:
                continue
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                self._free_map[block] = 1
        seq.block_table = []
        seq.released_blocks = 0
        seq.num_cached = 0
        seq.hashed_blocks = 0
        seq.chain_hash = 0
        self.reserved -= seq.reserved_blocks
        seq.reserved_blocks = 0
