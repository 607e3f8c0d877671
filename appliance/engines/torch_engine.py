"""The real engine: a Llama-family model over one paged KV pool, batched by the shared loop.

`BatchEngine` (scheduler, block manager, prefix cache, preemption, handoff table) decides
what runs; this class only turns a scheduled `Batch` into one forward pass
(`models.llama.LlamaModel`) and one sampled token per sequence, and moves KV between pools:

- prefill: `seq.step_tokens` of each sequence's uncached tokens (all of them, or one chunk
  of a long prompt; a prefix-cache hit, an earlier chunk or a recompute after
  preemption starts past 0; the model attends over the cached blocks through the block
  table), slots from the block table;
- decode: each sequence's last token at position len-1;
- kv_import: whole blocks copied from the source worker's pool (attached once through
  `appliance.kv.handoff`) into the blocks the block manager just allocated.

Sampling state is per request (`SamplingState`: its own generator, one draw per token), so a
seeded request gives the same tokens whatever shares its batch.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from appliance.engines import cpu_heap, dtypes
from appliance.engines.base import BatchEngine, KvLayoutError
from appliance.engines.grammar import GrammarBook
from appliance.engines.messages import Decode, Prefill, RequestFailed, SamplingParams, WorkerStats
from appliance.engines.sampling import SamplingState, sample, top_logprobs
from appliance.engines.scheduler import Batch
from appliance.engines.sequence import Sequence
from appliance.engines.kv_pool import kv_pool_bytes_per_block, layout_tag
from appliance.engines.layers import attention_backends
from appliance.engines.layers.attention import AttnBatch
from appliance.engines.layers.glue import COMPILE_MODES, compile_glue, eager_glue
from appliance.engines.loader import load_model
from appliance.engines.models.llama import LlamaModel
from appliance.kv import handoff

__all__ = ["MemoryPlan", "TorchEngine", "build_torch_engine", "canary_pattern", "kv_pool_budget",
           "pool_blocks_for_budget", "profile_activation"]

ATTENTION_ENV = "APPLIANCED_ATTENTION"                  # auto | sdpa | bounded | flashinfer
ATTENTION_BYTES_ENV = "APPLIANCED_ATTENTION_TEMP_BYTES"  # the bounded path's budget


def pool_id_of(handle: bytes | None) -> str:
    """A pool incarnation's name in KvHandles: a digest of its exported handle (the shm
    object's name or the CUDA IPC handle, new with every pool), which exporter and
    importers both have without another message."""
    return hashlib.blake2b(handle, digest_size=8).hexdigest() if handle else ""


@dataclass(slots=True)
class _Peer:
    handle: bytes
    pool: handoff.PeerPool
    pool_id: str


PROMPT_LOGIT_ROWS = 256     # prompt positions scored per vocabulary projection


class TorchEngine(BatchEngine):
    name = "torch"
    logprobs = True
    simulated = False

    def __init__(self, *, model: LlamaModel, share_pool: bool = True,
                 grammar: GrammarBook | None = None, **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.grammar = grammar      # compiles guided-decoding grammars; None: refused
        s = model.shape
        bs = self.blocks.block_size
        # One block past the block manager's ids holds a known pattern (the canary): a peer
        # copies it once when it attaches this pool, to check the copy path end to end.
        shape = (2, s.num_layers, self.blocks.num_blocks + 1, bs, s.num_kv_heads, s.head_dim)
        if share_pool or model.device.type != "cpu":
            self.kv = handoff.allocate_pool(shape, model.dtype, model.device)
        else:
            # A pool no peer maps (a decode or agg worker's: KV flows prefill -> decode)
            # stays in this process, where it can sit on transparent huge pages; /dev/shm
            # is often on 4 KB pages only (shmem_enabled = never is the kernel's default),
            # and the decode attention's scattered block reads took ~35% longer there.
            from appliance.engines import cpu_kernels
            self.kv = cpu_kernels.huge_page_zeros(math.prod(shape), model.dtype).view(shape)
        self.kv[:, :, -1] = canary_pattern(self.kv[:, :, -1].shape, model.dtype, model.device)
        # A CPU pool's pages are faulted in behind the steps' back (`cpu_heap.PoolPopulator`)
        self.kv_populator = (cpu_heap.PoolPopulator(self.kv) if self.kv.device.type == "cpu"
                             else None)
        self._layout = layout_tag(s, bs, model.dtype)
        self._handle = handoff.export_pool(self.kv) if share_pool else None
        self._pool_id = pool_id_of(self._handle)
        # Within a box: /dev/shm between CPU workers, CUDA IPC between GPUs (not run on
        # hardware). Whole blocks move, so a handle's bytes are its blocks times this.
        self.kv_transport = "cuda_ipc" if self.kv.device.type == "cuda" else "shm"
        self._block_bytes = self.kv[:, :, 0].numel() * self.kv.element_size()
        self._peers: dict[str, _Peer] = {}
        self._peer_errors: dict[str, str] = {}
        self._gone: set[str] = set()       # peers that died and have not attached again
        self._unusable: set[str] = set()   # peers whose pool failed the pattern-copy check
        self.memory_plan: MemoryPlan | None = None   # GPU: the profile run's numbers
        self.nixl = None        # NixlKvAgent of a box that joins another (enable_nixl)
        # A decode worker whose matmuls may borrow an idle core (cpu_kernels.helper_gate)
        self.helper_gate = None
        # > 0: a decode step carries up to this many rows in all of a prompt of this
        # worker's own (`Scheduler.ride_rows`; set with the one-call decode kernel).
        self.ride_rows = 0
        # A prefill worker whose core is so borrowed takes it back for each step
        # (cpu_kernels.core_lending)
        self.core_lender = None
        # Every layer windowed (Mistral v0.1): blocks behind the widest window are freed
        # as a sequence decodes. With any full layer (Gemma 3) every block stays.
        if s.all_layers_slide:
            self.kv_window = max(w for w in s.layer_windows if w is not None)

    def set_compile(self, mode: str) -> None:
        """``[engine] compile``: "decode" runs a decode step's residual adds and norms
        through torch.compile (`layers.glue`; compiled here, at start-up), "off" eager.
        Where it cannot compile, one line on stderr and eager."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"engine.compile must be one of {', '.join(COMPILE_MODES)}, "
                             f"got {mode!r}")
        m = self.model
        m.decode_glue = (eager_glue() if mode == "off" else
                         compile_glue(m.device, m.dtype, m.shape.hidden_size,
                                      m.shape.rms_norm_eps, self.worker))

    # ---- contract hooks ---------------------------------------------------
    def layout(self) -> str:
        return self._layout

    def peer_handle(self) -> bytes | None:
        return self._handle

    def pool_id(self) -> str:
        return self._pool_id

    def can_import(self, handle) -> bool:
        """Only from the very pool the handle names: after its worker restarted, the same
        block ids in the new pool hold some other request's KV (or zeros)."""
        peer = self._peers.get(handle.worker)
        if peer is None:        # dead or unusable: recompute; never attached: import_kv says why
            return handle.worker not in self._gone and handle.worker not in self._unusable
        return not handle.pool_id or handle.pool_id == peer.pool_id

    def drop_peer_pool(self, worker: str) -> None:
        self._gone.add(worker)
        old = self._peers.pop(worker, None)
        if old is not None:
            handoff.forget_pool(old.pool, owner_dead=True)

    def hello_info(self) -> dict:
        info = super().hello_info()
        if self.model.device.type == "cpu":
            info["threads"] = torch.get_num_threads()
        if self.ride_rows:
            info["ride_rows"] = self.ride_rows
        if self.nixl is not None:
            from appliance.kv.nixl_transport import to_json
            info["nixl_pool"] = to_json(self.nixl.info())
        return info

    # ---- across boxes (cluster roles) -------------------------------------
    def enable_nixl(self) -> None:
        """Register this worker's pool with a NIXL agent of its own (once, at start-up):
        a prefill worker's blocks can then be read by a decode box, and a decode worker
        pulls a prefill box's blocks with it (`appliance.kv.nixl_transport`)."""
        from appliance.kv.nixl_transport import NixlKvAgent
        self.nixl = NixlKvAgent(self.kv, name=f"applianced-{self.worker}-{os.getpid()}-"
                                              f"{os.urandom(4).hex()}")

    def begin_pull(self, seq: Sequence):
        """Post the NIXL READ of a prefill box's blocks into seq's own (`check_pull`
        sees it end: the running sequences decode meanwhile); the peer's agent is loaded
        once per pool incarnation (a restarted peer has a new pool id: loaded again)."""
        from appliance.kv.nixl_transport import (
            KvTransferError, NixlKvHandle, NixlPoolInfo, from_json)
        if self.nixl is None:
            raise KvTransferError(f"worker {self.worker} has no NIXL agent (cluster.role "
                                  "is both?)")
        remote = seq.handle.payload
        handle = from_json(NixlKvHandle, remote.handle)
        if not self.nixl.connected(handle.agent, handle.pool_id):
            self.nixl.connect(from_json(NixlPoolInfo, remote.pool))
        n = len(handle.block_ids)
        if n != self.blocks.blocks_for(handle.num_tokens) or n > len(seq.block_table):
            raise KvTransferError(f"handle of {seq.request_id}: {n} blocks for "
                                  f"{handle.num_tokens} tokens, {len(seq.block_table)} allocated")
        return self.nixl.start_pull(handle, seq.block_table[:n])

    def check_pull(self, pending) -> tuple[int, str] | None:
        moved = self.nixl.check_pull(pending)
        return None if moved is None else (moved, "nixl")

    def add(self, msg: Prefill | Decode, received: float | None = None) -> list:
        rid = msg.request_id
        n = len(msg.prompt) + (1 if isinstance(msg, Decode) else 0)
        if not msg.prompt:
            return [RequestFailed(rid, "empty prompt", "invalid_request")]
        if n > self.max_context:
            return [RequestFailed(rid, f"prompt of {n} tokens exceeds the model's context "
                                       f"of {self.max_context}", "context_length_exceeded")]
        vocab = self.model.shape.vocab_size
        if min(msg.prompt) < 0 or max(msg.prompt) >= vocab:
            return [RequestFailed(rid, f"prompt has token ids outside [0, {vocab})",
                                  "invalid_request")]
        try:
            return super().add(msg, received)
        except (ValueError, RuntimeError) as exc:   # bad sampling parameters (a seed
            return [RequestFailed(rid, str(exc), "invalid_request")]   # torch can't take)

    def new_sampler(self, request_id: str, params: SamplingParams,
                    drawn: int = 0) -> SamplingState:
        """`drawn` tokens were sampled elsewhere (the prefill worker's first token): skip
        their draws so a seeded request continues the same stream as in agg mode."""
        state = SamplingState.create(
            params.temperature, params.top_p, params.seed, device=self.model.device,
            top_k=params.top_k, frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty, logit_bias=params.logit_bias,
            vocab_size=self.model.shape.vocab_size, min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            # min_tokens gives way to a grammar, which may allow nothing but the end
            min_tokens=0 if params.guided is not None else params.min_tokens,
            stop_ids=(() if params.ignore_eos else tuple(self.eos_token_ids))
            + tuple(params.stop_token_ids))
        if params.guided is not None:
            if self.grammar is None:
                raise ValueError("guided decoding needs the model's tokenizer, which this "
                                 "engine was built without")
            state.guide = self.grammar.guide(params.guided)
        if state.temperature != 0.0:
            for _ in range(drawn):   # sampling.sample draws one fp32 uniform per token
                torch.rand(1, generator=state.generator, device=self.model.device,
                           dtype=torch.float32)
        return state

    def attach_peer(self, worker: str, handle) -> None:
        if worker == self.worker or handle is None:
            return
        old = self._peers.get(worker)
        if old is not None and old.handle == handle:
            return
        try:
            pool = handoff.import_pool(handle)
        except Exception as exc:   # keep serving; handoffs from this peer fail clearly
            self._peer_errors[worker] = f"{type(exc).__name__}: {exc}"
            print(f"applianced worker {self.worker}: cannot attach KV pool of {worker}: "
                  f"{exc}", file=sys.stderr)
            return
        why = self._check_copy(pool.tensor)
        if why is not None:     # serve on: its handoffs are recomputed here (can_import)
            self._peer_errors[worker] = why
            self._unusable.add(worker)
            if self._peers.pop(worker, None) is not None:     # its old incarnation's pool
                handoff.forget_pool(old.pool, owner_dead=True)
            print(f"applianced worker {self.worker}: KV pool of {worker} refused: {why}; its "
                  "requests are recomputed here", file=sys.stderr)
            handoff.forget_pool(pool, owner_dead=False)
            return
        self._peer_errors.pop(worker, None)
        self._unusable.discard(worker)
        self._gone.discard(worker)
        if old is not None:
            # A new pool under a known name: that worker restarted, its old pool is dead.
            handoff.forget_pool(old.pool, owner_dead=True)
        # Imports still queued from the old incarnation are recomputed when admitted
        # (their pool_id is not this pool's).
        self._peers[worker] = _Peer(bytes(handle), pool, pool_id_of(bytes(handle)))

    def _check_copy(self, src: torch.Tensor) -> str | None:
        """Copy the peer's canary block through the very path handoffs take and compare it
        with the pattern: PCIe boxes with ACS can report P2P and corrupt the data. None
        when it arrives intact, else why not."""
        if (src.dim() != 6 or src.dtype != self.kv.dtype or src.shape[:2] != self.kv.shape[:2]
                or src.shape[3:] != self.kv.shape[3:]):
            return None         # another layout: import_kv refuses it with the details
        probe = torch.zeros((*self.kv.shape[:2], 1, *self.kv.shape[3:]), dtype=self.kv.dtype,
                            device=self.kv.device)
        try:
            handoff.copy_from_peer(src, [src.shape[2] - 1], probe, [0])
        except Exception as exc:
            return f"pattern-copy check failed: {type(exc).__name__}: {exc}"
        want = canary_pattern(probe[:, :, 0].shape, probe.dtype, probe.device)
        bad = int((probe[:, :, 0] != want).sum())
        if bad:
            return (f"pattern-copy check failed: {bad} of {want.numel()} values of the canary "
                    "block differ after the copy (P2P through a PCIe switch with ACS?)")
        return None

    def stats(self) -> WorkerStats:
        stats = super().stats()
        if self.kv_populator is not None:
            stats.kv_populated = self.kv_populator.share
        if self.helper_gate is not None:
            stats.borrowed_core = self.helper_gate.cpu
            stats.borrowed_core_steps = self.helper_gate.stats.steps_with
            stats.borrowed_core_lender_busy_steps = self.helper_gate.stats.owner_busy
            stats.borrowed_core_taken_steps = self.helper_gate.stats.steps_without
            stats.borrowed_core_taken_back = self.helper_gate.kernel.helper_steals()
        if self.core_lender is not None:
            lent = self.core_lender.stats
            stats.lent_core_steps = lent.takes
            stats.lent_core_waits = lent.waited
            stats.lent_core_wait_s = lent.waited_ns / 1e9
            stats.lent_core_gave_up = lent.gave_up
        return stats

    # ---- execution --------------------------------------------------------
    def run_batch(self, batch: Batch) -> list[int | None]:
        bs = self.blocks.block_size
        P = batch.num_prefill
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        for i, seq in enumerate(batch.seqs):
            prefill = i < P
            start = seq.num_cached
            n = start + seq.step_tokens if prefill else len(seq.tokens)
            if not prefill and n - start != 1:
                raise RuntimeError(f"decode of {seq.request_id} with {n - start} new tokens")
            table = seq.block_table
            ids.extend(seq.tokens[start:n])
            pos.extend(range(start, n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, n))
            q_lens.append(n - start)
            ctx_lens.append(n)
            tables.append(table)
        attn = AttnBatch(P == len(batch.seqs), q_lens, ctx_lens, tables,
                         torch.tensor(slots, dtype=torch.long), num_prefill=P)
        ridden = (batch.phase == "mixed" and 0 < len(ids) - (len(batch.seqs) - P) <= self.ride_rows
                  and not any(seq.needs_prompt_logits for seq in batch.seqs[:P]))
        if ridden:      # (its logits: the finished sequences' rows alone, in order)
            attn = self._as_decode_rows(batch, q_lens, ctx_lens, attn.slot_mapping)
        # Prompt logprobs: the rows of positions whose next token is still prompt.
        scored: list[tuple[Sequence, int, int]] = []     # (seq, first row, first position)
        rows: list[int] = []
        row = 0
        for seq, q in zip(batch.seqs[:P], q_lens):
            if seq.needs_prompt_logits:
                start = seq.num_cached
                n = max(0, min(start + q, seq.num_prompt - 1) - start)
                if n:
                    scored.append((seq, len(rows), start))
                    rows.extend(range(row, row + n))
            row += q
        if rows:
            attn.hidden_rows = torch.tensor(rows, dtype=torch.long)
        gate, lender = self.helper_gate, self.core_lender
        if gate is not None:
            gate.begin()
        if lender is not None:
            lender.take()
        try:
            logits = self.model(torch.tensor(ids, dtype=torch.long),
                                torch.tensor(pos, dtype=torch.long), attn, self.kv)
        finally:
            if gate is not None:
                gate.end()
            if lender is not None:
                lender.give()
        if rows:
            self._prompt_logprobs(attn.hidden, scored, len(rows))
        done = [i for i, (seq, end) in enumerate(zip(batch.seqs, ctx_lens))
                if end == len(seq.tokens)]
        out: list[int | None] = [None] * len(batch.seqs)
        if not done:
            return out
        # Only finished prompts draw a token: a chunk must not use up the rng.
        last = logits if ridden or len(done) == len(batch.seqs) else logits[done]
        seqs = [batch.seqs[i] for i in done]
        pick_from = last
        guided = [j for j, seq in enumerate(seqs) if seq.sampler.guide is not None]
        if guided:      # the grammar's mask on a copy: logprobs stay the model's own
            pick_from = last.float().clone()
            self.grammar.apply(pick_from, guided, [seqs[j].sampler.guide for j in guided],
                               [seqs[j].generated for j in guided])
        picked = sample(pick_from, [seq.sampler for seq in seqs],
                        [seq.generated if seq.sampler.penalized or seq.sampler.min_tokens
                         else () for seq in seqs],
                        [seq.tokens if seq.sampler.repeats else () for seq in seqs])
        for i, token in zip(done, picked):
            out[i] = token
        self._logprobs(last, seqs, picked)
        return out

    def _as_decode_rows(self, batch: Batch, q_lens: list[int], ctx_lens: list[int],
                        slots: torch.Tensor) -> AttnBatch:
        """A decode step carrying a few prompt rows (`Scheduler.ride_rows`) as a decode
        step of one row per token: the row of position p attends over positions 0..p of
        its sequence's blocks, which is what a causal prompt chunk computes, and the
        one-call decode kernel writes every row's K and V before any row attends. So the
        step keeps the decode path's single C call, where a mixed step would run layer by
        layer through the prompt path. Only the rows of the sequences that draw a token
        (each decoding one's, a prompt's last once its last chunk is in) go through the
        lm head, in the batch's order."""
        row_ctx: list[int] = []
        row_tables: list[list[int]] = []
        keep: list[int] = []
        for seq, q, end in zip(batch.seqs, q_lens, ctx_lens):
            row_ctx.extend(range(end - q + 1, end + 1))
            row_tables.extend([seq.block_table] * q)
            if end == len(seq.tokens):
                keep.append(len(row_ctx) - 1)
        return AttnBatch(False, [1] * len(row_ctx), row_ctx, row_tables, slots,
                         logit_rows=torch.tensor(keep, dtype=torch.long))

    def _prompt_logprobs(self, hidden: torch.Tensor, scored: list, total: int) -> None:
        """Score each prompt position's next prompt token. The vocabulary projection runs
        PROMPT_LOGIT_ROWS rows at a time: a whole long prompt's logits would be
        tokens x vocab floats (2,048 x 128k = 1 GiB)."""
        ends = [first for _, first, _ in scored[1:]] + [total]
        for (seq, first, pos), end in zip(scored, ends):
            k = seq.params.prompt_logprobs
            for a in range(first, end, PROMPT_LOGIT_ROWS):
                b = min(end, a + PROMPT_LOGIT_ROWS)
                p0 = pos + a - first
                targets = seq.tokens[p0 + 1:p0 + 1 + b - a]
                seq.prompt_lps.extend(top_logprobs(self.model.lm_head(hidden[a:b]),
                                                   targets, k))

    @staticmethod
    def _logprobs(rows: torch.Tensor, seqs: list[Sequence], picked: list[int]) -> None:
        asked = [j for j, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not asked:
            return
        k = max(seqs[j].params.logprobs for j in asked)
        found = top_logprobs(rows[asked], [picked[j] for j in asked], k)
        for j, (chosen, alts) in zip(asked, found):
            seqs[j].logprob = (chosen, alts[:seqs[j].params.logprobs])

    def kv_import_bytes(self, seq: Sequence) -> int:
        return len(seq.handle.block_ids) * self._block_bytes

    def import_kv(self, seqs: list[Sequence]) -> None:
        by_source: dict[str, tuple[list[int], list[int]]] = {}
        for seq in seqs:
            h = seq.handle
            if h.layout != self._layout:
                raise KvLayoutError(f"KV layout {h.layout} != this worker's {self._layout}")
            peer = self._peers.get(h.worker)
            if peer is None:
                why = self._peer_errors.get(h.worker, "no AttachPeer received")
                raise RuntimeError(f"worker {self.worker} has no KV pool of source worker "
                                   f"{h.worker!r} ({why})")
            src = peer.pool.tensor
            if (src.dtype != self.kv.dtype or src.shape[:2] != self.kv.shape[:2]
                    or src.shape[3:] != self.kv.shape[3:]):
                raise KvLayoutError(f"pool of {h.worker} is {tuple(src.shape)} {src.dtype}, "
                                    f"this worker's is {tuple(self.kv.shape)} {self.kv.dtype}")
            n = len(h.block_ids)
            if n != self.blocks.blocks_for(h.num_tokens) or n > len(seq.block_table):
                raise ValueError(f"handle of {seq.request_id}: {n} blocks for "
                                 f"{h.num_tokens} tokens, {len(seq.block_table)} allocated")
            src_ids, dst_ids = by_source.setdefault(h.worker, ([], []))
            src_ids.extend(h.block_ids)
            dst_ids.extend(seq.block_table[:n])
        for worker, (src_ids, dst_ids) in by_source.items():
            handoff.copy_from_peer(self._peers[worker].pool.tensor, src_ids, self.kv, dst_ids)


def canary_pattern(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The canary block's contents: small integers (exact in bf16 and fp16), different at
    every position within a period of 251, so a shifted, truncated or zeroed copy differs."""
    n = 1
    for d in shape:
        n *= d
    values = (torch.arange(n, dtype=torch.int64) * 7919 % 251 - 125).to(dtype)
    return values.view(tuple(shape)).to(device)


def pool_blocks_for_budget(model: LlamaModel, block_size: int, budget_bytes: int) -> int:
    return int(budget_bytes // kv_pool_bytes_per_block(model.shape, block_size, model.dtype))


def kv_pool_budget(total_bytes: int, used_bytes: int, peak_activation_bytes: int,
                   mem_fraction: float) -> int:
    """Bytes the KV pool may take on a GPU (vLLM's rule): the share of the device this
    worker may use, less what is in use after loading and profiling (weights, CUDA
    context, workspaces, other processes), less the peak activation of a full batch.
    A larger activation peak leaves a smaller pool, never an OOM in the first long batch."""
    return max(0, int(total_bytes * mem_fraction) - int(used_bytes) - int(peak_activation_bytes))


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The profile run's numbers, reported once at start-up."""

    total_bytes: int
    mem_fraction: float
    weights_bytes: int
    used_bytes: int                 # in use on the device after the profile run
    peak_activation_bytes: int
    profile_tokens: int
    kv_bytes: int
    kv_blocks: int
    attention: str

    def describe(self, worker: str) -> str:
        gib = 1 << 30
        return (f"applianced worker {worker}: memory plan: {self.total_bytes / gib:.1f} GiB x "
                f"{self.mem_fraction:g} usable, {self.used_bytes / gib:.2f} GiB in use (weights "
                f"{self.weights_bytes / gib:.2f} GiB), peak activation "
                f"{self.peak_activation_bytes / gib:.2f} GiB in a profile run of "
                f"{self.profile_tokens} tokens -> KV pool {self.kv_bytes / gib:.2f} GiB "
                f"({self.kv_blocks} blocks); attention: {self.attention}")


def profile_activation(model: LlamaModel, tokens: int, seqs: int, block_size: int,
                       stats: Any) -> int:
    """Peak bytes a full batch allocates beyond what was allocated before it: one forward
    of `tokens` prompt tokens as one sequence (the largest attention) and as up to `seqs`
    sequences (the most logits), plus the prompt-logprob projection's rows, each measured
    with the allocator's peak statistics (`stats`: torch.cuda). The scratch pool is
    allocated before the peak is reset, so it is not counted as activation."""
    s = model.shape
    device = model.device
    vocab_rows = min(tokens, PROMPT_LOGIT_ROWS)
    peak = 0
    for n_seqs in sorted({1, max(1, min(seqs, tokens))}):
        lens = [tokens // n_seqs + (1 if i < tokens % n_seqs else 0) for i in range(n_seqs)]
        per = [-(-n // block_size) for n in lens]
        pool = torch.zeros((2, s.num_layers, sum(per), block_size, s.num_kv_heads, s.head_dim),
                           dtype=model.dtype, device=device)
        tables, slots, pos, first = [], [], [], 0
        for n, b in zip(lens, per):
            tables.append(list(range(first, first + b)))
            slots += [first * block_size + p for p in range(n)]
            pos += list(range(n))
            first += b
        batch = AttnBatch(True, lens, lens, tables, torch.tensor(slots, dtype=torch.long))
        if n_seqs == 1:
            batch.hidden_rows = torch.arange(vocab_rows)
        stats.synchronize()
        stats.reset_peak_memory_stats()
        base = stats.memory_allocated()
        logits = model(torch.zeros(tokens, dtype=torch.long), torch.tensor(pos), batch, pool)
        probs = torch.log_softmax(logits, -1)
        if batch.hidden is not None:
            torch.log_softmax(model.lm_head(batch.hidden).float(), -1)
        stats.synchronize()
        peak = max(peak, stats.max_memory_allocated() - base)
        del pool, batch, logits, probs
        stats.empty_cache()
    return peak


def build_torch_engine(spec, model_dir: Path) -> TorchEngine:
    """The engine a WorkerSpec with engine="torch" names.

    CPU: fp32, or the checkpoint's own bf16/fp16 where the processor has the instructions
    (`[engine] dtype` may ask for bf16 or fp16: used where the processor has them, else
    fp32 with one line on stderr; `engines.dtypes`), spec.cpu_threads torch threads (on the cores the worker is pinned to), pool
    sized from spec.kv_cache_bytes (a prefill worker's in /dev/shm, for its decode peers;
    others' private, on huge pages), SDPA attention.
    GPU (NOT RUN ON HARDWARE): bf16 (or the configured dtype) on cuda:0 (the worker's own first device; the daemon
    lists its devices first in CUDA_VISIBLE_DEVICES); attention through FlashInfer's paged
    kernels when installed, else the bounded-memory path (layers.attention_backends); the pool sized
    after a profile run of a full batch (`profile_activation`, `kv_pool_budget`), reported
    on stderr. One device per worker: tensor parallelism is not implemented, so a worker
    given more is refused (the planner refuses tp > 1 for this engine first)."""
    from appliance.models.eos import read_eos_ids

    model_dir = Path(model_dir)
    if spec.device_kind == "gpu":
        if len(spec.devices) > 1:
            raise ValueError(f"engine = torch runs one GPU per worker (no tensor parallelism); "
                             f"worker {spec.worker} was given {len(spec.devices)}: use tp = 1 "
                             "or engine = trtllm")
        if not torch.cuda.is_available():
            raise RuntimeError(f"worker {spec.worker} was given GPUs {spec.devices} but "
                               "torch sees no CUDA device")
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
        cpu_heap.keep_freed_memory()
        torch.set_num_threads(max(1, spec.cpu_threads))
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:        # already set (or parallel work already ran)
            pass
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}            # load_model names the missing or broken file
    dtype, note = dtypes.resolve(spec.dtype, spec.device_kind,
                                 stored=dtypes.checkpoint_dtype(config))
    if note:
        print(f"applianced worker {spec.worker}: {note}", file=sys.stderr, flush=True)
    model = load_model(model_dir, device=device, dtype=dtype)
    backend = attention_backends.select_backend(device, os.environ.get(ATTENTION_ENV, "auto"))
    temp_bytes = int(os.environ.get(ATTENTION_BYTES_ENV, "0") or 0) or \
        attention_backends.DEFAULT_TEMP_BYTES
    model.set_attention(backend, temp_bytes)
    gate = None
    if device.type == "cpu" and dtype == torch.bfloat16 and spec.cpu_kernels != "off":
        gate = _use_cpu_kernels(model, spec)
    elif device.type == "cpu" and dtype == torch.float32 and spec.cpu_kernels != "off":
        _use_f32_kernels(model, spec)
    if device.type == "cpu":
        cpu_heap.release_freed()        # the load's discarded copies (see there)
    plan = None
    if device.type == "cuda":
        plan = _profile_memory_plan(model, spec, backend)
        budget = plan.kv_bytes
    else:
        budget = spec.kv_cache_bytes
    num_blocks = pool_blocks_for_budget(model, spec.block_size, budget)
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {spec.block_size} "
                         f"tokens for {model_dir.name}")
    if plan is not None:
        import dataclasses
        plan = dataclasses.replace(plan, kv_blocks=num_blocks)
        print(plan.describe(spec.worker), file=sys.stderr, flush=True)
    engine = TorchEngine(
        # only a prefill worker's pool is mapped by peers (`handoff`); on a GPU every pool
        # is cudaMalloc'd either way
        share_pool=spec.role == "prefill" or spec.device_kind == "gpu",
        model=model, worker=spec.worker, devices=tuple(spec.devices), num_blocks=num_blocks,
        block_size=spec.block_size, max_batch_tokens=spec.max_batch_tokens,
        max_seqs=spec.max_seqs, max_context=model.shape.max_context,
        eos_token_ids=read_eos_ids(model_dir), handoff_timeout_s=spec.handoff_timeout_s,
        reserve_ratio=spec.reserve_ratio, prefill_chunk_tokens=spec.prefill_chunk_tokens,
        fair_queuing=spec.fair_queuing, fair_chunk_tokens=spec.fair_chunk_tokens,
        grammar=GrammarBook(model_dir, model.shape.vocab_size, read_eos_ids(model_dir)))
    engine.memory_plan = plan
    engine.helper_gate = gate
    rides = decode_ride_rows(spec.cpu_decode_ride_rows, spec.role, model,
                             amx="amx_bf16" in dtypes.cpu_flags())
    if rides:
        engine.ride_rows = engine.scheduler.ride_rows = rides
    if device.type == "cpu" and spec.cpu_kernels != "off":
        engine.core_lender = _core_lender(spec)
    if spec.compile != "off" and spec.role != "prefill":   # a prefill worker never decodes
        if model.glue_kernel is not None:
            print(f"applianced worker {spec.worker}: engine.compile = {spec.compile!r} not "
                  "applied: the C kernels already run the steps' norms",
                  file=sys.stderr, flush=True)
        else:
            engine.set_compile(spec.compile)
    if spec.nixl:
        engine.enable_nixl()
    return engine


# `engine.cpu_decode_ride_rows = -1` (auto): the matmul kernel's tile of rows, the most a
# decode step's weight reads carry at little more than their own cost (linear_bf16.c).
AUTO_RIDE_ROWS = 8


def decode_ride_rows(setting: int, role: str, model, amx: bool = False) -> int:
    """The rows in all (decoding sequences and prompt tokens) a decode step carries a
    prompt of this worker's own in (`Scheduler.ride_rows`), 0: none. Only a disagg decode
    worker whose decode steps run in one C call (`LlamaModel.set_decode_layers`) rides:
    elsewhere a mixed step runs layer by layer and gains nothing over the whole prompt.
    `auto` rides only on a CPU without AMX, the kind it was measured to pay on: there a
    256-token prompt takes the prefill core ~190 ms at its bf16 peak and rides on the
    decode core for ~0.13 CPU s. With AMX the prefill core does it in ~60 ms and is not
    the bound; a ridden prompt waits longer for its first token than behind another, and
    at 8 clients that latency is the rate: measured there, 6% fewer requests a second at 8
    clients with 8 rows, no change at 32 (docs/engines/torch.md)."""
    if setting == 0 or role != "decode" or getattr(model, "decode_layers", None) is None:
        return 0
    if setting < 0:
        return 0 if amx else AUTO_RIDE_ROWS
    return setting


HEADS = "the C kernel does not take this model's heads, or its attention sinks"
FAMILY = "this model family's layers are not the kernel's"


def _apply_kernel(spec, what: str, loader, apply, why: str) -> None:
    """`apply` the kernel `loader` builds; where it cannot be built or does not fit, say
    so in one line (``<what> on torch's path (<why>)``) and leave torch's path."""
    from appliance.engines import cpu_kernels
    try:
        kernel = loader(spec.kernel_dir)
    except cpu_kernels.KernelUnavailable as exc:
        why = str(exc)
    else:
        if apply(kernel):
            return
    print(f"applianced worker {spec.worker}: {what} on torch's path ({why})", file=sys.stderr,
          flush=True)


def _load_kernel(spec, loader, instead: str):
    """The kernel `loader` builds, or None where this host cannot build it, said in one
    line (``<instead> (<why>)``) so the worker's log tells what runs in its place."""
    from appliance.engines import cpu_kernels
    try:
        return loader(spec.kernel_dir)
    except cpu_kernels.KernelUnavailable as exc:
        print(f"applianced worker {spec.worker}: {instead} ({exc})", file=sys.stderr,
              flush=True)
        return None


def _one_call_decode(model: LlamaModel, spec, loader, linear) -> None:
    """A decode step's layers in one call (`loader`'s `DecodeLayers`) of the matmul kernel
    `linear` and the model's decode attention and glue kernels, where it has both; what
    cannot be is said in one line and the layers are called one by one."""
    if model.attn.decode_kernel is None or model.glue_kernel is None:
        return
    layers = _load_kernel(spec, loader, "decode layers called one by one from Python")
    if layers is None:
        return
    layers.bind(linear, model.attn.decode_kernel, model.glue_kernel)
    model.set_decode_layers(layers)     # False for layers it does not fit: one by one


def _experts_in_c(model: LlamaModel, spec, linear, loader) -> None:
    """A mixture of experts' matrices on the matmul kernel `linear` too, and each MoE
    layer's experts in one C call of it (`loader`'s `MoeExperts`, cpu_kernels/moe_experts.c)
    where the glue kernel runs the activation. Why: a decode step reads a few rows through
    each of tens of experts a layer; on oneDNN, in Python's loop over them, the experts'
    weights streamed at 7-8 GB/s on an AMD EPYC Zen 4 core, on the kernel in that loop at
    12-15, in one call at 23-28 (12 layers of 128 experts of 256, hidden 768, bf16,
    `bench/bench_torch_moe.py`). Experts the call does not take (gpt-oss's: biases and a
    clamped activation) keep the kernel for their matmuls and Python's loop."""
    from appliance.engines.layers.moe import SparseMoE

    moes = [mlp for mlp in (getattr(layer, "mlp", None) for layer in model.layers)  # Gemma 3's
            if isinstance(mlp, SparseMoE)]         # layers hold their matmuls themselves
    for moe in moes:
        for lin in moe.gate_up + moe.down:
            getattr(lin, "linear", lin).use_kernel(linear)  # gpt-oss's BiasAfter wraps one
    if not moes or model.glue_kernel is None:
        return
    kernel = _load_kernel(spec, loader,
                          "mixture-of-experts layers loop over their experts in Python")
    if kernel is None:
        return
    kernel.bind(linear, model.glue_kernel)
    for moe in moes:
        moe.use_kernel(kernel)      # False for experts it does not take: Python's loop


def _use_cpu_kernels(model: LlamaModel, spec):
    """The C kernels of `engines.cpu_kernels` where this host builds them: a prompt's
    attention and every step's elementwise work (every worker), decode attention (decode
    and agg workers; a prefill worker never decodes), and the dense layers' matmuls on
    decode workers, whose decode-only steps then run all layers in one call of these
    kernels. On a CPU without AMX the matmul kernel also takes every worker's prompts: there
    it ran 5-8% faster than oneDNN's bf16 path at every size a step has (16-2,048 rows,
    82m weights, AMD EPYC Zen 4); with AMX, oneDNN's tiles are the prompts' best case. What
    cannot be used is said in one line on stderr, and torch's path serves it. The kernels
    run on one thread, so a worker with more keeps torch's path, which uses them all.
    Returns the `HelperGate` of a decode worker whose matmuls may borrow
    `spec.cpu_helper_core`, else None."""
    from appliance.engines import cpu_kernels

    def say(what: str) -> None:
        print(f"applianced worker {spec.worker}: {what}", file=sys.stderr, flush=True)
    if torch.get_num_threads() > 1:
        say(f"attention, matmuls and norms on torch's path (the C kernels are "
            f"single-threaded; this worker has {torch.get_num_threads()} threads)")
        return

    def load(what: str, loader, apply, why: str = HEADS) -> None:
        _apply_kernel(spec, what, loader, apply, why)
    load("prompt attention", cpu_kernels.load_causal_prefill, model.attn.set_prefill_kernel)
    load("norms, RoPE and activation", cpu_kernels.load_layer_glue, model.set_glue_kernel,
         FAMILY)
    if spec.role != "prefill":
        load("decode attention", cpu_kernels.load_paged_decode, model.attn.set_decode_kernel)
    amx = "amx_bf16" in dtypes.cpu_flags()
    if spec.role != "decode" and amx:
        return None     # oneDNN's AMX path is the one for prompt-sized matmuls
    try:
        linear = cpu_kernels.load_linear_bf16(spec.kernel_dir)
    except cpu_kernels.KernelUnavailable as exc:
        say(f"{'decode ' if spec.role == 'decode' else ''}matmuls on oneDNN ({exc})")
        return None
    if amx and not linear.amx:
        # without its tiles the kernel trails oneDNN's AMX path beyond 3 rows
        say("decode matmuls on oneDNN (this CPU has AMX, but the kernel was built without "
            "it or Linux did not grant this process the tiles)")
        return None
    for layer in dense_linears(model):
        layer.use_kernel(linear)
    _experts_in_c(model, spec, linear, cpu_kernels.load_moe_experts)
    if spec.role == "prefill":
        return None
    _one_call_decode(model, spec, cpu_kernels.load_decode_layers, linear)
    if spec.role != "decode":
        return None
    if spec.cpu_helper_core < 0:
        return None
    from appliance.engines.cpu_kernels.core_lending import LendPage
    from appliance.engines.cpu_kernels.helper_gate import HelperGate
    page = None
    if spec.cpu_lend_fd >= 0:
        try:
            page = LendPage(spec.cpu_lend_fd)
            why = ("" if linear.helper_lend(page.address, spec.cpu_helper_slot)
                   else f"slot {spec.cpu_helper_slot} out of range")
        except (OSError, ValueError) as exc:
            why = str(exc)
        if why:
            say(f"no page through which {spec.cpu_helper_lender} takes its core back from "
                f"the helper ({why}): the helper sits out the steps while it runs")
            page = None
    if not linear.start_helper(spec.cpu_helper_core):
        say(f"decode matmuls on this worker's core only (no helper thread on core "
            f"{spec.cpu_helper_core})")
        return None
    say(f"decode matmuls may borrow core {spec.cpu_helper_core} while "
        f"{spec.cpu_helper_lender or 'its owner'} idles (engine.cpu_decode_helper)")
    gate = HelperGate(linear, spec.cpu_helper_core, spec.cpu_helper_lender)
    gate.page = page        # mapped as long as the helper may read it
    return gate


def _use_f32_kernels(model: LlamaModel, spec) -> bool:
    """The fp32 kernels (`cpu_kernels.LayerGlueF32`, `CausalPrefillF32`, `PagedDecodeF32`,
    `LinearF32`, `DecodeLayersF32`) on a CPU without AVX-512F (AMD Zen 2/3, Intel client
    cores, a VM that hides it). There no bf16 kernel builds and a worker holds fp32 weights
    and KV. Every worker's norms, RoPE with the KV write and activation go through the glue
    kernel (one call each where torch made ~15 dispatches a layer), a prompt's causal
    attention through `CausalPrefillF32` (SDPA computed the masked half of a short prompt's
    scores too), and its dense matmuls through `LinearF32`: a decode step's few rows, where
    oneDNN's fp32 linear runs at a fraction of the core's read rate (linear_f32.c: 8 rows of
    the 82m model 50-76 -> 36-40 ms on a Zen 3 core), and a prompt's hundreds, where the
    kernel's tiles run at the core's FMA peak and oneDNN's packed fp32 some 12% below it
    (256 rows of the 82m model 440-467 against 499-532 ms on a Zen 3 core, session 63). A
    decode or agg worker's decode attention goes through its kernel too (torch's copies
    every K and V it reads), and with the glue, decode attention and matmul kernels a
    decode-only step runs every layer in one C call (decode_layers_f32.c). A CPU with
    AVX-512 keeps torch's path, where these kernels were not measured against it. Returns
    whether the matmuls were taken; what is not is said in one line on stderr."""
    from appliance.engines import cpu_kernels

    if "avx512f" in dtypes.cpu_flags():
        return False
    who = f"applianced worker {spec.worker}"

    def say(what: str) -> None:
        print(f"{who}: {what}", file=sys.stderr, flush=True)
    if torch.get_num_threads() > 1:
        say(f"norms, attention and matmuls on torch's path (the fp32 kernels are "
            f"single-threaded; this worker has {torch.get_num_threads()} threads)")
        return False
    _apply_kernel(spec, "norms, RoPE and activation", cpu_kernels.load_layer_glue_f32,
                  model.set_glue_kernel, FAMILY)
    _apply_kernel(spec, "prompt attention", cpu_kernels.load_causal_prefill_f32,
                  model.attn.set_prefill_kernel, HEADS)
    if spec.role != "prefill":      # a prefill worker never decodes
        _apply_kernel(spec, "decode attention", cpu_kernels.load_paged_decode_f32,
                      model.attn.set_decode_kernel, HEADS)
    try:
        linear = cpu_kernels.load_linear_f32(spec.kernel_dir)
    except cpu_kernels.KernelUnavailable as exc:
        say(f"{'decode ' if spec.role == 'decode' else ''}matmuls on oneDNN ({exc})")
        return False
    for layer in dense_linears(model):
        layer.use_kernel(linear)
    _experts_in_c(model, spec, linear, cpu_kernels.load_moe_experts_f32)
    if spec.role != "prefill":
        _one_call_decode(model, spec, cpu_kernels.load_decode_layers_f32, linear)
    return True


def _core_lender(spec):
    """A prefill worker whose core decode workers' helpers borrow: the `Lender` that
    takes it back at a group's boundary before each step (`cpu_kernels.core_lending`),
    else None."""
    if not spec.cpu_core_lent or spec.cpu_lend_fd < 0:
        return None
    from appliance.engines import cpu_kernels
    from appliance.engines.cpu_kernels.core_lending import LendPage, Lender
    try:
        return Lender(cpu_kernels.load_linear_bf16(spec.kernel_dir), LendPage(spec.cpu_lend_fd))
    except (cpu_kernels.KernelUnavailable, OSError, ValueError) as exc:
        print(f"applianced worker {spec.worker}: steps start without taking the core back "
              f"from the decode helper ({exc})", file=sys.stderr, flush=True)
        return None


def dense_linears(model: LlamaModel) -> list:
    """The `Linear`s a decode step streams once each: every layer's attention projections
    and dense MLP, and the LM head (unwrapped from a soft-cap or bias). A mixture of
    experts' matrices are not among them: `_experts_in_c` takes those."""
    from appliance.engines.layers.linear import Linear

    def unwrap(obj):
        inner = getattr(obj, "linear", None)
        return inner if isinstance(inner, Linear) else obj
    found = []
    for layer in model.layers:
        for holder in (layer, getattr(layer, "mlp", None)):
            for name in ("qkv", "o", "gate_up", "down"):
                obj = unwrap(getattr(holder, name, None))
                if isinstance(obj, Linear):
                    found.append(obj)
    head = unwrap(model.lm_head)
    if isinstance(head, Linear):
        found.append(head)
    return found


def _profile_memory_plan(model: LlamaModel, spec, backend: str) -> MemoryPlan:  # NOT RUN ON HARDWARE
    """Size the pool after a profile run at the batch budget, as vLLM does: weights and
    workspaces are in use, the activation peak is measured with the CUDA allocator's
    statistics, and the pool gets what the configured fraction leaves after both."""
    stats = torch.cuda
    stats.synchronize()
    stats.empty_cache()
    weights = stats.memory_allocated()
    tokens = max(1, min(spec.max_batch_tokens, model.shape.max_context))
    peak = profile_activation(model, tokens, spec.max_seqs, spec.block_size, stats)
    free, total = stats.mem_get_info()
    budget = kv_pool_budget(total, total - free, peak, spec.gpu_mem_fraction)
    return MemoryPlan(total_bytes=total, mem_fraction=spec.gpu_mem_fraction,
                      weights_bytes=weights, used_bytes=total - free,
                      peak_activation_bytes=peak, profile_tokens=tokens, kv_bytes=budget,
                      kv_blocks=0, attention=backend)
