"""The real engine: a Llama-family model over one paged KV pool, batched by the shared loop.

`BatchEngine` (scheduler, block manager, prefix cache, preemption, handoff table) decides
what runs; this class only turns a scheduled `Batch` into one forward pass
(`torch_model.LlamaModel`) and one sampled token per sequence, and moves KV between pools:

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

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.engines import cpu_heap
from appliance.engines.base import BatchEngine, KvLayoutError
from appliance.engines.grammar import GrammarBook
from appliance.engines.messages import Decode, Prefill, RequestFailed, SamplingParams
from appliance.engines.sampling import SamplingState, sample, top_logprobs
from appliance.engines.scheduler import Batch
from appliance.engines.sequence import Sequence
from appliance.engines.torch_model import (
    AttnBatch, LlamaModel, kv_pool_bytes_per_block, layout_tag, load_model,
)
from appliance.kv import handoff

__all__ = ["TorchEngine", "build_torch_engine", "pool_blocks_for_budget"]


@dataclass(slots=True)
class _Peer:
    handle: bytes
    pool: handoff.PeerPool


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
        self.kv = handoff.allocate_pool(
            (2, s.num_layers, self.blocks.num_blocks, bs, s.num_kv_heads, s.head_dim),
            model.dtype, model.device)
        self._layout = layout_tag(s, bs, model.dtype)
        self._handle = handoff.export_pool(self.kv) if share_pool else None
        self._peers: dict[str, _Peer] = {}
        self._peer_errors: dict[str, str] = {}

    # ---- contract hooks ---------------------------------------------------
    def layout(self) -> str:
        return self._layout

    def peer_handle(self) -> bytes | None:
        return self._handle

    def hello_info(self) -> dict:
        info = super().hello_info()
        if self.model.device.type == "cpu":
            info["threads"] = torch.get_num_threads()
        return info

    def add(self, msg: Prefill | Decode) -> list:
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
            return super().add(msg)
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
        self._peer_errors.pop(worker, None)
        if old is not None:
            # A new pool under a known name: that worker restarted, its old pool is dead.
            handoff.forget_pool(old.pool, owner_dead=True)
        self._peers[worker] = _Peer(bytes(handle), pool)

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
        logits = self.model(torch.tensor(ids, dtype=torch.long),
                            torch.tensor(pos, dtype=torch.long), attn, self.kv)
        if rows:
            self._prompt_logprobs(attn.hidden, scored, len(rows))
        done = [i for i, (seq, end) in enumerate(zip(batch.seqs, ctx_lens))
                if end == len(seq.tokens)]
        out: list[int | None] = [None] * len(batch.seqs)
        if not done:
            return out
        # Only finished prompts draw a token: a chunk must not use up the rng.
        last = logits if len(done) == len(batch.seqs) else logits[done]
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


def pool_blocks_for_budget(model: LlamaModel, block_size: int, budget_bytes: int) -> int:
    return int(budget_bytes // kv_pool_bytes_per_block(model.shape, block_size, model.dtype))


def build_torch_engine(spec, model_dir: Path) -> TorchEngine:
    """The engine a WorkerSpec with engine="torch" names.

    CPU: fp32, spec.cpu_threads torch threads (on the cores the worker is pinned to), pool
    sized from spec.kv_cache_bytes (in /dev/shm).
    GPU (NOT RUN ON HARDWARE): bf16 on cuda:0 (the worker's own first device; the daemon
    lists its devices first in CUDA_VISIBLE_DEVICES), pool sized from the free memory
    after loading the weights times spec.gpu_mem_fraction. One device per worker: tensor
    parallelism is not implemented, extra devices are ignored."""
    from appliance.models.eos import read_eos_ids

    model_dir = Path(model_dir)
    if spec.device_kind == "gpu":
        if not torch.cuda.is_available():
            raise RuntimeError(f"worker {spec.worker} was given GPUs {spec.devices} but "
                               "torch sees no CUDA device")
        device, dtype = torch.device("cuda", 0), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        cpu_heap.keep_freed_memory()
        torch.set_num_threads(max(1, spec.cpu_threads))
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:        # already set (or parallel work already ran)
            pass
    model = load_model(model_dir, device=device, dtype=dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * spec.gpu_mem_fraction)
    else:
        budget = spec.kv_cache_bytes
    num_blocks = pool_blocks_for_budget(model, spec.block_size, budget)
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {spec.block_size} "
                         f"tokens for {model_dir.name}")
    return TorchEngine(
        model=model, worker=spec.worker, devices=tuple(spec.devices), num_blocks=num_blocks,
        block_size=spec.block_size, max_batch_tokens=spec.max_batch_tokens,
        max_seqs=spec.max_seqs, max_context=model.shape.max_context,
        eos_token_ids=read_eos_ids(model_dir), handoff_timeout_s=spec.handoff_timeout_s,
        reserve_ratio=spec.reserve_ratio, prefill_chunk_tokens=spec.prefill_chunk_tokens,
        grammar=GrammarBook(model_dir, model.shape.vocab_size, read_eos_ids(model_dir)))
