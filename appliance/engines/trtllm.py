"""TensorRT-LLM behind the engine contract (`appliance.engines.base.Engine`).

TensorRT-LLM runs its own scheduler (in-flight batching, its own paged KV cache, its own
KV cache transceiver), so this engine implements `Engine` directly instead of
`BatchEngine`: it turns our messages into `tensorrt_llm.LLM.generate_async` calls and the
`RequestOutput`s that come back into our events.

Written against NVIDIA/TensorRT-LLM (main branch, 1.x; the PyTorch backend is `LLM`
itself since the prebuilt-engine backend moved to `tensorrt_llm._tensorrt_engine`):

- `tensorrt_llm/llmapi/llm.py` @ 4c05a74891e4 — `LLM(model, tokenizer=None, ...,
  tensor_parallel_size=1, dtype="auto", ..., **kwargs)`, kwargs validated against
  `TorchLlmArgs.model_fields`; `generate_async(inputs, sampling_params=None, ...,
  streaming=False, ..., disaggregated_params=None, ...) -> RequestOutput`; for a
  `context_only` request on the PyTorch backend it sets `sampling_params.max_tokens = 1`
  itself; `get_stats(timeout=2) -> list[dict]` and `get_stats_async(timeout=2)` (an async
  iterable of the same dicts, ending after `timeout` seconds without a new one);
  `shutdown()`.
- `tensorrt_llm/disaggregated_params.py` @ 01009a33a704 — `DisaggregatedParams`, a
  `dataclass(slots=True, kw_only=True)`: `request_type` ("context_only" |
  "generation_only" | "context_and_generation"), `first_gen_tokens`, `ctx_request_id`,
  `opaque_state` (bytes), `draft_tokens`, `disagg_request_id`, `ctx_dp_rank`,
  `ctx_info_endpoint`, `schedule_style`, plus logprob/logit/multimodal fields.
- `tensorrt_llm/executor/result.py` @ a678b91aafbe — `RequestOutput` (a
  `GenerationResult`): awaitable (`aresult`), async-iterable (one step per response when
  streaming), `outputs[0]` a `CompletionOutput` with cumulative `token_ids`,
  `finish_reason` in {'stop', 'length', 'timeout', 'cancelled', 'not_finished' (context
  only)}, `disaggregated_params` (for a context-only request: a new
  `DisaggregatedParams(request_type="context_only", first_gen_tokens, ctx_request_id,
  opaque_state, draft_tokens)`); `abort()` cancels through the executor; `cached_tokens`.
  A result only supports `async for`/`await` if an asyncio loop was running when
  `generate_async` created it, so every call is made on our loop thread.
- `tensorrt_llm/llmapi/llm_args.py` (current main; `CacheTransceiverConfig.backend` in
  "DEFAULT" | "UCX" | "NIXL" | "MOONCAKE" | "MPI", `None` = transceiver disabled;
  `kv_transfer_timeout_ms`; `KvCacheConfig.free_gpu_memory_fraction`, `tokens_per_block`
  (default 32), `dtype` (default "auto"); `TorchLlmArgs.disable_overlap_scheduler`,
  `enable_iter_perf_stats`), `tensorrt_llm/sampling_params.py` @ a98a9061d72f
  (`SamplingParams` fields used below), `cpp/tensorrt_llm/executor/jsonSerialization.cpp`
  @ 092229bb6e1c (the keys of one iteration-stats dict: `timestamp`, `iter`,
  `iterLatencyMS`, `numActiveRequests`, `numQueuedRequests`, `kvCacheStats{maxNumBlocks,
  freeNumBlocks, usedNumBlocks, tokensPerBlock, ...}`, `inflightBatchingStats{
  numScheduledRequests, numContextRequests, numGenRequests, numPausedRequests,
  numCtxTokens, ...}`), `tensorrt_llm/executor/base_worker.py` (`_stats_serializer` adds
  `requestStats`, and newer versions `hostStepTimeMS`/`schedulerMode`), and
  `tests/integration/defs/disaggregated/test_disaggregated_single_gpu.py` @ d043821581b4
  (context worker `disable_overlap_scheduler=True`, both sides
  `CacheTransceiverConfig(backend="DEFAULT")`; older releases spell the backends in
  lower case, see `transceiver_config`; the context output has exactly one token
  and `request_type == "context_only"`; flipping it to "generation_only" and sending the
  same prompt and `max_tokens` to the generation worker yields all `max_tokens` tokens,
  the context worker's first token included).

How the contract maps:

- prefill worker, `Prefill(handoff=True)`: a `context_only` request (max_tokens=1, what
  the PyTorch backend forces anyway) with a fresh `disagg_request_id` (the KV
  transceiver's session key, `get_unique_rid` in `_torch/disaggregation`; TensorRT-LLM's
  own disaggregated server sets one on every context request), which the handle carries
  to the generation-only request. Its `DisaggregatedParams` become
  `KvHandle.payload` as a plain dict of their picklable fields (the daemon carries the
  handle but must never import tensorrt_llm to unpickle it); `block_ids` is [] because
  TensorRT-LLM's blocks are its own; the layout tag names model, KV dtype and TP size.
  With max_tokens <= 1 there is nothing to hand off: a normal one-token request.
- decode worker, `Decode`: the dict is rebuilt into the local `DisaggregatedParams`
  with `request_type="generation_only"` and sent with `streaming=True`; the cache
  transceiver pulls the KV from the context worker. The output starts with the first
  token (already sent by the prefill worker), which is skipped, so a request yields
  max_tokens - 1 tokens here. The first response means the KV has arrived: `KvImported`.
- agg (and a decode worker prefilling locally): a normal streaming request.
- `Abort` -> `RequestOutput.abort()` (on the loop thread); its late outputs are dropped.
- `Release` and `sweep` do nothing: the context worker's transceiver frees the context
  KV once the generation side has pulled it, and `kv_transfer_timeout_ms` (set from
  `handoff_timeout_s`) frees what nobody pulls. A release without that field is refused
  for disaggregated roles at start-up (`llm_kwargs`); agg workers do not need it.

IterationRecords (APPROXIMATION — read before using them for billing): `generate_async`
does not expose the composition of each batch. Wall time, start time and phase come
from TensorRT-LLM's own per-iteration stats (`enable_iter_perf_stats=True`,
`get_stats_async`): `iterLatencyMS` (or `hostStepTimeMS` under the overlap scheduler),
the `timestamp` (see `iteration_seconds` for releases without `schedulerMode`), and "prefill" when the iteration scheduled any context request (a
TensorRT-LLM batch mixes context and generation requests, so such a record may also
cover decode rows), else "decode". The entries are not TensorRT-LLM's: they are the
tokens this engine saw arrive per request (prompt tokens for a request's first output,
generated tokens after). A record is held until the next iteration's stats arrive (or
the engine goes idle) and then takes every token seen since the previous record. Each
token is attributed exactly once, but possibly to a neighbouring iteration, since
outputs and stats travel on different queues. (`requestStats` with
`enable_iter_req_stats` carries per-request rows, but keyed by an executor-internal id
that `RequestOutput` does not expose.) If the stats stream is unavailable, records are
built from the same ledger with wall time measured here between drains — coarser still.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import queue
import random
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from appliance.engines.grammar import ebnf
from appliance.engines.messages import (
    Decode, IterationRecord, KvHandle, KvImported, Prefill, PrefillDone, RequestFailed,
    SamplingParams, Tokens, WorkerStats,
)

__all__ = ["TrtllmEngine", "TrtllmUnavailable", "build_trtllm_engine", "USED_API",
           "MISSING_MESSAGE", "disagg_to_payload", "payload_to_disagg"]

MISSING_MESSAGE = ("TensorRT-LLM is not installed (pip install applianced[trtllm] from "
                   "NVIDIA's index); use --engine torch")

# Every name this module touches on the tensorrt_llm package. tests/unit/test_trtllm_contract.py
# checks them against the fake, and against the real package wherever it is installed.
USED_API: dict[str, dict[str, tuple[str, ...]]] = {
    "modules": {
        "tensorrt_llm": ("LLM", "SamplingParams", "DisaggregatedParams"),
        "tensorrt_llm.llmapi": ("KvCacheConfig", "CacheTransceiverConfig", "RequestOutput",
                                "CompletionOutput", "GuidedDecodingParams"),
    },
    "methods": {
        "LLM": ("generate_async", "get_stats_async", "shutdown"),
        "RequestOutput": ("abort", "outputs"),
    },
    "params": {     # keyword arguments we pass (LLM: its signature plus TorchLlmArgs)
        "LLM": ("model", "tensor_parallel_size", "kv_cache_config", "cache_transceiver_config",
                "disable_overlap_scheduler", "enable_iter_perf_stats", "max_batch_size",
                "max_num_tokens", "guided_decoding_backend"),
        "LLM.generate_async": ("inputs", "sampling_params", "streaming", "disaggregated_params"),
    },
    "fields": {
        "SamplingParams": ("max_tokens", "temperature", "top_p", "seed", "stop_token_ids",
                           "end_id", "ignore_eos", "detokenize", "include_stop_str_in_output",
                           "top_k", "frequency_penalty", "presence_penalty",
                           "guided_decoding", "min_tokens", "repetition_penalty", "min_p"),
        "GuidedDecodingParams": ("grammar",),
        "DisaggregatedParams": ("request_type", "first_gen_tokens", "ctx_request_id",
                                "opaque_state"),
        "KvCacheConfig": ("free_gpu_memory_fraction",),
        "CacheTransceiverConfig": ("backend",),
        "CompletionOutput": ("token_ids", "finish_reason", "disaggregated_params"),
    },
    # Read with a fallback when absent (older releases): not required.
    "optional": {
        "KvCacheConfig": ("tokens_per_block", "dtype"),
        # Required in disaggregated roles (refused at start-up without it), not in agg.
        "CacheTransceiverConfig": ("kv_transfer_timeout_ms",),
        "RequestOutput": ("cached_tokens", "finished"),
        "DisaggregatedParams": ("disagg_request_id",),
        # generate_async(..., priority: float = 0.5), in [0, 1], higher first (current
        # main, tensorrt_llm/llmapi/llm.py); passed only where the signature has it.
        "LLM.generate_async": ("priority",),
    },
}

STEP_WAIT_S = 0.005             # step() blocks at most this long when nothing is ready
STATS_IDLE_TIMEOUT_S = 2.0      # the stats stream ends after this long without an iteration
KV_BACKEND_ENV = "APPLIANCED_TRTLLM_KV_BACKEND"
DEFAULT_KV_BACKEND = "DEFAULT"  # TensorRT-LLM picks NIXL/UCX (env TRTLLM_USE_*_KVCACHE)
CROSS_BOX_KV_BACKEND = "NIXL"   # a box with [cluster] peers: the transport the boxes share
# TensorRT-LLM's transceiver (UCX and NIXL alike) listens on the IPv4 address of this
# network interface (cpp/tensorrt_llm/common/envUtils.cpp `getEnvUCXInterface`); unset,
# it takes the first interface it finds, which may be one the peers cannot reach.
TRTLLM_INTERFACE_ENV = "TRTLLM_UCX_INTERFACE"
DEFAULT_PRIORITY = 0.5          # TensorRT-LLM's DEFAULT_REQUEST_PRIORITY
_CONTEXT_ONLY, _GENERATION_ONLY = "context_only", "generation_only"
# TensorRT-LLM's global disagg request ids live in [2**40, 2**63), apart from the local
# request ids below 2**40 (`get_global_disagg_request_id`, llmapi/disagg_utils.py).
MIN_GLOBAL_DISAGG_ID = 1 << 40


def trtllm_priority(priority_class: int) -> float:
    """Our priority class (an integer, lower served first, 0 the default: as vLLM's
    `priority`) as TensorRT-LLM's request priority (a float in [0, 1], higher first,
    0.5 the default). Monotone, so the scheduler orders classes as the router does:
    class 0 -> 0.5, 1 -> 0.25, 3 -> 0.125; negative classes rise towards 1 (-1 -> 0.75).
    TensorRT-LLM has priority only: tenants' weights within a class are not passed on."""
    p = int(priority_class)
    return DEFAULT_PRIORITY / (1 + p) if p >= 0 else 1.0 - DEFAULT_PRIORITY / (1 - p)


def new_disagg_request_id() -> int:
    """A fresh id for one context-only request and its generation-only continuation: the
    KV transceiver keys its sessions by it (`get_unique_rid` in _torch/disaggregation
    returns `disagg_request_id` whenever disaggregated params are set, and asserts on
    None in several revisions). Random in [2**40, 2**40 + 2**62): unique across workers
    and restarts without coordination (a collision among the requests in flight at once
    has a chance of about n**2 / 2**63)."""
    return MIN_GLOBAL_DISAGG_ID + secrets.randbits(62)


class TrtllmUnavailable(RuntimeError):
    """TensorRT-LLM cannot be used in this process; the message is one line."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def import_trtllm() -> SimpleNamespace:
    """Import TensorRT-LLM (needs libcuda, so only ever inside a GPU worker)."""
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM, DisaggregatedParams, SamplingParams as TrtSamplingParams
        from tensorrt_llm.llmapi import (
            CacheTransceiverConfig, GuidedDecodingParams, KvCacheConfig,
        )
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "tensorrt_llm":
            raise TrtllmUnavailable(MISSING_MESSAGE) from None
        raise TrtllmUnavailable(f"TensorRT-LLM failed to import ({_first_line(exc)}); "
                                "use --engine torch") from None
    except (ImportError, OSError, RuntimeError) as exc:    # libcuda, MPI, driver mismatch
        raise TrtllmUnavailable(f"TensorRT-LLM failed to import ({_first_line(exc)}); "
                                "use --engine torch") from None
    return SimpleNamespace(module=tensorrt_llm, LLM=LLM, SamplingParams=TrtSamplingParams,
                           DisaggregatedParams=DisaggregatedParams, KvCacheConfig=KvCacheConfig,
                           CacheTransceiverConfig=CacheTransceiverConfig,
                           GuidedDecodingParams=GuidedDecodingParams)


# ---- the KV handle payload ---------------------------------------------------------

_MISSING = object()


def _plain(value: Any) -> Any:
    """`value` as builtins only (so unpickling never needs tensorrt_llm), or _MISSING."""
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, (int, str)) else _MISSING
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _MISSING if any(v is _MISSING for v in items) else items
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items()}
        ok = all(isinstance(k, str) and v is not _MISSING for k, v in items.items())
        return items if ok else _MISSING
    return _MISSING     # tensors, Logprob objects, bindings objects: not carried


def _field_names(obj_or_cls: Any) -> list[str]:
    if dataclasses.is_dataclass(obj_or_cls):
        return [f.name for f in dataclasses.fields(obj_or_cls)]
    return [n for n in vars(obj_or_cls) if not n.startswith("_")]


def disagg_to_payload(params: Any) -> dict:
    """A context-only request's DisaggregatedParams as a plain, picklable dict (None and
    non-builtin fields such as logits left out)."""
    out = {}
    for name in _field_names(params):
        value = _plain(getattr(params, name, None))
        if value is not None and value is not _MISSING:
            out[name] = value
    return out


def payload_to_disagg(cls: Any, payload: dict) -> Any:
    """Rebuild the generation-only DisaggregatedParams on the decode side; fields this
    TensorRT-LLM version does not know are dropped."""
    known = set(_field_names(cls))
    kwargs = {k: v for k, v in payload.items() if k in known}
    kwargs["request_type"] = _GENERATION_ONLY
    return cls(**kwargs)


# ---- internal records --------------------------------------------------------------

@dataclass(slots=True)
class _Request:
    request_id: str
    kind: str                   # "context" | "one_token" | "full" | "generation"
    prompt_len: int
    source_worker: str = ""     # generation: the prefill worker holding the KV
    skip: list[int] | None = None   # generation: the first tokens the output repeats
    started: bool = False       # an output arrived
    disagg_request_id: int | None = None    # context: carried in the handle to the decode side
    priority: float = DEFAULT_PRIORITY      # TensorRT-LLM's scale (trtllm_priority)


@dataclass(slots=True)
class _Chunk:                   # loop thread -> step(): new output of one request
    request_id: str
    tokens: list[int]
    finish_reason: str | None
    payload: dict | None
    cached_tokens: int


@dataclass(slots=True)
class _Failed:
    request_id: str
    message: str
    code: str


@dataclass(slots=True)
class _Closed:                  # the request's coroutine is over
    request_id: str


@dataclass(slots=True)
class _StatsUnavailable:
    reason: str


@dataclass(slots=True)
class _Cursor:                  # loop-thread state of one request's output stream
    sent: int = 0
    skip: list[int] | None = None


_TS_FORMATS = ("%m-%d-%Y %H:%M:%S.%f", "%m-%d-%Y %H:%M:%S")


def _parse_timestamp(text: Any, exact: bool = False) -> float | None:
    """A stats `timestamp` as epoch seconds; `exact`: only one with sub-second digits."""
    if not isinstance(text, str):
        return None
    for fmt in _TS_FORMATS[:1] if exact else _TS_FORMATS:
        try:
            return datetime.strptime(text, fmt).timestamp()    # local time, as written
        except ValueError:
            continue
    return None


def iteration_seconds(stats: dict, next_start: float | None) -> float:
    """One iteration's wall time from its stats dict.

    Current releases say which scheduler ran it: under the overlap scheduler
    `iterLatencyMS` spans two loops (this iteration's launch to the previous one's
    results), and `hostStepTimeMS` is the step itself. Older releases have neither key and
    may run the overlap scheduler too: there the iteration is the gap to the next stats'
    timestamp (`next_start`, when it has sub-second digits), capped by iterLatencyMS (a
    gap that spans idle time is not iteration time)."""
    latency = max(0.0, float(stats.get("iterLatencyMS", 0.0)) / 1000.0)
    if "schedulerMode" in stats or "hostStepTimeMS" in stats:
        if stats.get("schedulerMode") == "overlap" and "hostStepTimeMS" in stats:
            return max(0.0, float(stats["hostStepTimeMS"]) / 1000.0)
        return latency
    start = _parse_timestamp(stats.get("timestamp"), exact=True)
    if start is None or next_start is None or next_start <= start:
        return latency
    gap = next_start - start
    return min(gap, latency) if latency > 0 else gap


class TrtllmEngine:
    """One `tensorrt_llm.LLM`, driven from a private asyncio loop thread."""

    name = "trtllm"
    simulated = False

    def __init__(self, *, llm: Any, api: SimpleNamespace, worker: str, role: str,
                 devices: tuple[str, ...], layout: str, block_size: int,
                 eos_token_ids: tuple[int, ...] = ()):
        self.llm = llm
        self.api = api
        self.worker = worker
        self.role = role
        self.devices = devices
        self.layout = layout
        self.block_size = block_size
        self.end_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos = tuple(eos_token_ids[1:])
        # Releases before `priority` reached generate_async would refuse the keyword.
        self.takes_priority = _accepts(llm.generate_async, "priority")
        # main-thread state
        self._inflight: dict[str, _Request] = {}
        self._aborted: set[str] = set()
        self._pending: dict[str, list] = {}     # rid -> [new_tokens, context_len, prefill]
        self._last_stats: dict = {}
        self._held: dict | None = None          # the latest iteration's stats, not yet sent
        self._stats_ok = True
        self._last_record_end = 0.0
        self.iterations = 0
        self.busy_s = 0.0
        self.prefix_hit_tokens = 0
        # loop-thread state
        self._results: dict[str, Any] = {}
        self._abort_requested: set[str] = set()
        self._stats_task: asyncio.Task | None = None
        # the bridge
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"trtllm-{worker}",
                                        daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    # ---- contract -----------------------------------------------------------------
    def hello_info(self) -> dict:
        kv = self._last_stats.get("kvCacheStats") or {}
        return {"layout": self.layout, "block_size": self.block_size,
                "kv_blocks_total": int(kv.get("maxNumBlocks", 0)), "peer_handle": None}

    def add(self, msg: Prefill | Decode, received: float | None = None) -> list:
        rid = msg.request_id
        if rid in self._inflight or rid in self._aborted:
            return [RequestFailed(rid, f"request id {rid} is already on worker {self.worker}")]
        if not msg.prompt:
            return [RequestFailed(rid, "empty prompt", "invalid_request")]
        # Not mapped onto TensorRT-LLM yet: refused rather than silently ignored.
        p = msg.params
        if p.logprobs is not None or p.prompt_logprobs is not None or p.logit_bias:
            what = "logit_bias" if p.logit_bias else "logprobs"
            return [RequestFailed(rid, f"{what} is not available from the trtllm engine",
                                  "invalid_request")]
        if p.guided is not None:
            try:
                ebnf(p.guided)
            except ValueError as exc:       # GrammarError: no xgrammar, or a bad grammar
                return [RequestFailed(rid, str(exc), "invalid_request")]
        disagg = None
        if isinstance(msg, Decode):
            handle = msg.handle
            if handle.layout != self.layout:
                return [RequestFailed(rid, f"KV layout mismatch: source {handle.layout}, "
                                           f"this worker {self.layout}", "kv_layout_mismatch")]
            payload = handle.payload
            if not isinstance(payload, dict) or not payload.get("first_gen_tokens"):
                return [RequestFailed(rid, "KV handle carries no TensorRT-LLM disaggregated "
                                           "params", "kv_layout_mismatch")]
            try:
                disagg = payload_to_disagg(self.api.DisaggregatedParams, payload)
            except (TypeError, ValueError) as exc:
                return [RequestFailed(rid, f"bad disaggregated params: {_first_line(exc)}",
                                      "kv_layout_mismatch")]
            req = _Request(rid, "generation", len(msg.prompt), handle.worker,
                           list(payload["first_gen_tokens"]))
            sp, streaming = self._sampling(msg.params), True
        elif msg.handoff and msg.params.max_tokens > 1:
            req = _Request(rid, "context", len(msg.prompt))
            ids = {}
            if "disagg_request_id" in _field_names(self.api.DisaggregatedParams):
                ids["disagg_request_id"] = req.disagg_request_id = new_disagg_request_id()
            disagg = self.api.DisaggregatedParams(request_type=_CONTEXT_ONLY, **ids)
            sp, streaming = self._sampling(msg.params, max_tokens=1), False
        elif msg.handoff:           # one token wanted: nothing to hand off
            req = _Request(rid, "one_token", len(msg.prompt))
            sp, streaming = self._sampling(msg.params, max_tokens=1), False
        else:
            req = _Request(rid, "full", len(msg.prompt))
            sp, streaming = self._sampling(msg.params), True
        req.priority = trtllm_priority(msg.priority)
        if not self._inflight:
            self._last_record_end = time.time()     # a busy period (fallback records) starts
        self._inflight[rid] = req
        asyncio.run_coroutine_threadsafe(
            self._drive(req, list(msg.prompt), sp, disagg, streaming), self._loop)
        return []

    def abort(self, request_id: str) -> None:
        if self._inflight.pop(request_id, None) is None:
            return
        self._aborted.add(request_id)
        self._loop.call_soon_threadsafe(self._abort_in_loop, request_id)

    def release(self, request_id: str) -> None:
        """Nothing to free: TensorRT-LLM's cache transceiver releases a context request's
        KV once the generation side has pulled it (and after `kv_transfer_timeout_ms`
        when nobody does)."""

    def attach_peer(self, worker: str, handle: Any) -> None:
        """Peers find each other through the transceiver's own metadata (opaque_state)."""

    def detach_peer(self, worker: str) -> list:
        """A dead context worker: the generation-only requests pulling from it fail in
        TensorRT-LLM's transceiver (its kv_transfer_timeout_ms); nothing is mapped here."""
        return []

    def has_work(self) -> bool:
        return bool(self._inflight) or not self._events.empty()

    def sweep(self, now: float) -> list:
        return []   # orphaned context KV: TensorRT-LLM's kv_transfer_timeout_ms (see release)

    def step(self) -> list:
        items = []
        try:
            items.append(self._events.get(timeout=STEP_WAIT_S) if self._inflight
                         else self._events.get_nowait())
            while True:
                items.append(self._events.get_nowait())
        except queue.Empty:
            pass
        events: list = []
        for item in items:
            if isinstance(item, dict):
                record = self._on_stats(item)
                if record is not None:
                    events.append(record)
            elif isinstance(item, _StatsUnavailable):
                self._stats_ok = False
            elif isinstance(item, _Closed):
                self._aborted.discard(item.request_id)
                if self._inflight.pop(item.request_id, None) is not None:
                    events.append(RequestFailed(item.request_id, "TensorRT-LLM ended the "
                                                "request without a result"))
            elif item.request_id in self._inflight:
                events += self._convert(self._inflight[item.request_id], item)
        if self._held is not None and not self._inflight:
            events.append(self._record(self._held))     # idle: nothing more will arrive
            self._held = None
        if not self._stats_ok and self._pending:
            events.append(self._fallback_record())
        return events

    def stats(self) -> WorkerStats:
        waiting = [r for r in self._inflight.values() if not r.started]
        kv = self._last_stats.get("kvCacheStats") or {}
        return WorkerStats(
            worker=self.worker, waiting=len(waiting),
            running=len(self._inflight) - len(waiting),
            queued_prefill_tokens=sum(r.prompt_len for r in waiting if r.kind != "generation"),
            kv_blocks_total=int(kv.get("maxNumBlocks", 0)),
            kv_blocks_free=int(kv.get("freeNumBlocks", 0)),
            kv_blocks_handed_off=0,     # held by TensorRT-LLM's transceiver, not visible
            iterations=self.iterations, busy_s=self.busy_s, preemptions=0,
            prefix_hit_tokens=self.prefix_hit_tokens)

    def close(self) -> None:
        """Stop the loop thread and the LLM (the worker process normally just exits)."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=5)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        try:
            self.llm.shutdown()
        except Exception:   # already down: nothing left to free
            pass

    # ---- main thread: outputs -> events ---------------------------------------------
    def _sampling(self, p: SamplingParams, max_tokens: int | None = None) -> Any:
        # An unseeded request in TensorRT-LLM draws from its sampler's one generator, seeded
        # with 42 when the worker starts (the C++ runtime's per-request default is 0): a
        # restarted worker replays the same random stream, and identical requests on
        # fresh workers sample identically. Unseeded requests get a seed of their own.
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        kw: dict[str, Any] = dict(max_tokens=max_tokens or p.max_tokens, seed=seed,
                                  temperature=p.temperature, top_p=p.top_p,
                                  ignore_eos=p.ignore_eos, detokenize=False,
                                  include_stop_str_in_output=True)
        # TensorRT-LLM takes None for "off"; OpenAI's penalties map one to one.
        if p.top_k > 0:
            kw["top_k"] = p.top_k
        if p.frequency_penalty:
            kw["frequency_penalty"] = p.frequency_penalty
        if p.presence_penalty:
            kw["presence_penalty"] = p.presence_penalty
        if p.min_tokens:
            kw["min_tokens"] = p.min_tokens
        if p.repetition_penalty != 1.0:
            kw["repetition_penalty"] = p.repetition_penalty
        if p.min_p:
            kw["min_p"] = p.min_p
        if p.guided is not None:
            # TensorRT-LLM's own guided decoding (its xgrammar backend), given the same
            # grammar the other engines enforce, as EBNF: one conversion for every engine.
            kw["guided_decoding"] = self.api.GuidedDecodingParams(grammar=ebnf(p.guided))
        if p.temperature == 0.0 or p.top_p <= 0:
            # Greedy as top_k=1, the one spelling every release reads as greedy: older ones
            # decide `SamplingParams._greedy_decoding` by top_k in (None, 1) and top_p in
            # (None, 0) only, so temperature=0 with our top_p=1.0 sampled there; current
            # ones (`params_imply_greedy_decoding`) also take top_k == 1. Temperature and
            # top_p are left unset (None): a zero temperature is a division on some runtimes.
            kw.update(top_k=1, temperature=None, top_p=None)
        stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.extra_eos))
        if stop:
            kw["stop_token_ids"] = stop
        if self.end_id is not None:
            kw["end_id"] = self.end_id
        return self.api.SamplingParams(**kw)

    def _convert(self, req: _Request, item: _Chunk | _Failed) -> list:
        rid = req.request_id
        if isinstance(item, _Failed):
            del self._inflight[rid]
            return [RequestFailed(rid, item.message, item.code)]
        reason = item.finish_reason
        if reason in ("cancelled", "timeout"):
            del self._inflight[rid]
            return [RequestFailed(rid, f"TensorRT-LLM ended the request ({reason})",
                                  f"engine_{reason}")]
        if reason not in ("stop", "length"):
            reason = None           # None and "not_finished" (context only)
        first = not req.started
        req.started = True
        cached = item.cached_tokens if first else 0
        if first and req.kind != "generation":
            self.prefix_hit_tokens += cached
        self._account(req, len(item.tokens), first)
        events: list = []
        if req.kind in ("context", "one_token"):
            del self._inflight[rid]
            if not item.tokens:
                return [RequestFailed(rid, "TensorRT-LLM returned no first token")]
            handle = None
            if req.kind == "context" and reason is None:
                if not item.payload:
                    return [RequestFailed(rid, "TensorRT-LLM returned no disaggregated params")]
                payload = dict(item.payload)
                if req.disagg_request_id is not None:
                    # The returned params need not carry it; the generation side must.
                    payload.setdefault("disagg_request_id", req.disagg_request_id)
                handle = KvHandle(self.worker, rid, [], req.prompt_len, self.layout, payload)
            elif reason is None:
                reason = "length"
            return [PrefillDone(rid, item.tokens[0], handle, reason, cached)]
        if req.kind == "generation" and first:
            events.append(KvImported(rid, req.source_worker))
        if item.tokens or reason is not None:
            events.append(Tokens(rid, item.tokens, reason, cached))
        if reason is not None:
            del self._inflight[rid]
        return events

    def _account(self, req: _Request, n_tokens: int, first: bool) -> None:
        start = req.prompt_len + (1 if req.kind == "generation" else 0)   # + first token
        entry = self._pending.setdefault(req.request_id, [0, start, False])
        if first and req.kind != "generation":
            entry[0] += req.prompt_len      # the prefill's tokens
            entry[2] = True
            n_tokens -= 1                   # the first token came out of the prefill
        entry[0] += max(0, n_tokens)
        entry[1] += max(0, n_tokens) + (1 if first and req.kind != "generation" else 0)

    def _take_entries(self) -> tuple[list[tuple[str, int, int]], bool]:
        entries = [(rid, n, ctx) for rid, (n, ctx, _) in self._pending.items()]
        prefill = any(p for _, _, p in self._pending.values())
        self._pending.clear()
        return entries, prefill

    def _on_stats(self, stats: dict) -> IterationRecord | None:
        """Hold each iteration's stats until the next one arrives (or the engine goes
        idle): by then the outputs of that iteration have normally been seen too."""
        self._last_stats = stats
        held = self._held
        if held is not None and "_next_ts" not in held:
            held["_next_ts"] = _parse_timestamp(stats.get("timestamp"), exact=True)
        ifb = stats.get("inflightBatchingStats") or {}
        scheduled = int(ifb.get("numScheduledRequests", int(ifb.get("numContextRequests", 0))
                                + int(ifb.get("numGenRequests", 0))))
        if not scheduled:
            return None
        held, self._held = self._held, stats
        return self._record(held) if held is not None else None

    def _record(self, stats: dict) -> IterationRecord:
        ifb = stats.get("inflightBatchingStats") or {}
        wall = iteration_seconds(stats, stats.get("_next_ts"))
        start = _parse_timestamp(stats.get("timestamp"))
        if start is None:
            start = time.time() - wall
        entries, _ = self._take_entries()
        self.iterations += 1
        self.busy_s += wall
        self._last_record_end = start + wall
        phase = "prefill" if int(ifb.get("numContextRequests", 0)) else "decode"
        return IterationRecord(self.worker, phase, start, wall, self.devices, False, entries,
                               approximate=True)

    def _fallback_record(self) -> IterationRecord:
        now = time.time()
        start = min(self._last_record_end or now, now)
        entries, prefill = self._take_entries()
        self.iterations += 1
        self.busy_s += now - start
        self._last_record_end = now
        return IterationRecord(self.worker, "prefill" if prefill else "decode", start,
                               now - start, self.devices, False, entries, approximate=True)

    # ---- loop thread ----------------------------------------------------------------
    async def _drive(self, req: _Request, prompt: list[int], sp: Any, disagg: Any,
                     streaming: bool) -> None:
        rid = req.request_id
        put = self._events.put
        try:
            extra = {"priority": req.priority} if self.takes_priority else {}
            try:
                result = self.llm.generate_async(prompt, sampling_params=sp, streaming=streaming,
                                                 disaggregated_params=disagg, **extra)
            except ValueError as exc:       # prompt too long, bad sampling parameters
                put(_Failed(rid, f"TensorRT-LLM refused the request: {_first_line(exc)}",
                            "invalid_request"))
                return
            except Exception as exc:
                put(_Failed(rid, f"TensorRT-LLM: {_first_line(exc)}", "engine_error"))
                return
            self._results[rid] = result
            self._ensure_stats_task()
            if rid in self._abort_requested:
                result.abort()
            cursor = _Cursor(skip=req.skip)
            want_params = req.kind == "context"
            if streaming:
                async for out in result:
                    put(self._chunk(rid, out, cursor, want_params))
            else:
                put(self._chunk(rid, await result, cursor, want_params))
        except Exception as exc:    # an executor error surfaces while iterating
            put(_Failed(rid, f"TensorRT-LLM: {_first_line(exc)}", "engine_error"))
        finally:
            self._results.pop(rid, None)
            self._abort_requested.discard(rid)
            put(_Closed(rid))

    @staticmethod
    def _chunk(rid: str, out: Any, cursor: _Cursor, want_params: bool) -> _Chunk:
        comp = out.outputs[0]
        ids = comp.token_ids
        if cursor.skip is not None and (len(ids) >= len(cursor.skip) or comp.finish_reason):
            # A generation-only output starts with first_gen_tokens (the integration test
            # checks the whole sequence); skip them once, only if they really are there.
            if list(ids[:len(cursor.skip)]) == cursor.skip:
                cursor.sent = len(cursor.skip)
            cursor.skip = None
        new = [int(t) for t in ids[cursor.sent:]] if cursor.skip is None else []
        cursor.sent = max(cursor.sent, len(ids)) if cursor.skip is None else cursor.sent
        payload = None
        if want_params and comp.disaggregated_params is not None:
            payload = disagg_to_payload(comp.disaggregated_params)
        return _Chunk(rid, new, comp.finish_reason, payload,
                      int(getattr(out, "cached_tokens", 0) or 0))

    def _abort_in_loop(self, rid: str) -> None:
        result = self._results.get(rid)
        if result is None:
            self._abort_requested.add(rid)      # _drive aborts it right after submitting
        else:
            result.abort()

    def _ensure_stats_task(self) -> None:
        if self._stats_ok and (self._stats_task is None or self._stats_task.done()):
            self._stats_task = self._loop.create_task(self._pump_stats())

    async def _pump_stats(self) -> None:
        """Forward iteration stats until TensorRT-LLM has been idle for a while; the next
        request starts a new pump."""
        try:
            async for stats in self.llm.get_stats_async(timeout=STATS_IDLE_TIMEOUT_S):
                self._events.put(json.loads(stats) if isinstance(stats, str) else stats)
        except Exception as exc:
            self._stats_ok = False
            self._events.put(_StatsUnavailable(_first_line(exc)))


# ---- construction ------------------------------------------------------------------

def _accepts(fn: Any, name: str) -> bool:
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):     # a builtin without a signature: do not guess
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _local_ip_towards(host: str) -> str:
    """The local IPv4 address the kernel routes to `host` from (a UDP connect sends
    nothing)."""
    import socket
    addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def _interface_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for the interfaces that have one (Linux)."""
    import fcntl
    import socket
    import struct
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915,   # SIOCGIFADDR
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:                             # down, or no IPv4 address
                continue
            out.setdefault(socket.inet_ntoa(raw[20:24]), name)
    return out


def interface_towards(peers: list[str], route=None, interfaces=None) -> tuple[str | None, str]:
    """(the network interface this box reaches its [cluster] peers through, why): the
    one TensorRT-LLM's transceiver should listen on, so the address it puts in each
    context request's `opaque_state` is one the decode boxes can connect to. None when
    no peer resolves (TensorRT-LLM then picks an interface itself)."""
    from urllib.parse import urlsplit
    route, interfaces = route or _local_ip_towards, interfaces or _interface_addresses
    names = None
    chosen: list[tuple[str, str]] = []
    failed = []
    for url in peers:
        host = urlsplit(url).hostname or url
        try:
            ip = route(host)
        except OSError as exc:
            failed.append(f"{host} ({_first_line(exc)})")
            continue
        names = names if names is not None else interfaces()
        if ip in names:
            chosen.append((host, names[ip]))
    if not chosen:
        why = "no [cluster] peer resolved to a local interface"
        return None, why + (f": {', '.join(failed)}" if failed else "")
    iface = chosen[0][1]
    why = f"routes to {chosen[0][0]}"
    others = sorted({n for _, n in chosen[1:] if n != iface})
    if others:
        why += f"; other peers route through {', '.join(others)} (one interface is used)"
    return iface, why


def transceiver_env(spec, route=None, interfaces=None) -> dict:
    """The environment TensorRT-LLM's transceiver reads, from the same [cluster] config
    the torch engine's NIXL path uses: the interface towards the peers. An operator's
    own TRTLLM_UCX_INTERFACE wins; agg workers and single boxes get nothing."""
    if spec.role not in ("prefill", "decode") or not spec.cluster_peers \
            or os.environ.get(TRTLLM_INTERFACE_ENV):
        return {}
    iface, _ = interface_towards(spec.cluster_peers, route, interfaces)
    return {TRTLLM_INTERFACE_ENV: iface} if iface else {}

def kv_dtype_name(model_dir: Path, kv_dtype: str) -> str:
    """The KV cache dtype for the layout tag: "auto" follows the checkpoint's dtype."""
    if kv_dtype and kv_dtype != "auto":
        return kv_dtype
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto")


def layout_tag(model_dir: Path, kv_dtype: str, tp: int) -> str:
    return f"trtllm:{model_dir.name}:kv={kv_dtype_name(model_dir, kv_dtype)}:tp={tp}"


def llm_kwargs(api: SimpleNamespace, spec, model_dir: Path) -> dict:
    """The `LLM(...)` arguments for a worker of `spec.role`."""
    tp = max(1, len(spec.devices))
    kw: dict[str, Any] = dict(
        model=str(model_dir), tensor_parallel_size=tp,
        kv_cache_config=api.KvCacheConfig(free_gpu_memory_fraction=spec.gpu_mem_fraction),
        max_batch_size=spec.max_seqs, max_num_tokens=spec.max_batch_tokens,
        enable_iter_perf_stats=True, guided_decoding_backend="xgrammar")
    if spec.role in ("prefill", "decode"):
        if "kv_transfer_timeout_ms" not in getattr(api.CacheTransceiverConfig, "model_fields", {}):
            version = getattr(api.module, "__version__", "?")
            raise TrtllmUnavailable(
                f"TensorRT-LLM {version} has no CacheTransceiverConfig.kv_transfer_timeout_ms: "
                "a context-only request nobody pulls would pin its KV until restart; "
                "disaggregated mode needs a release that has it (use mode = agg here)")
        extra: dict[str, Any] = {
            "kv_transfer_timeout_ms": max(1, int(spec.handoff_timeout_s * 1000))}
        # Across boxes ([cluster] peers), NIXL: what the boxes' KV path speaks (issue 29);
        # within one box TensorRT-LLM's own default. The env variable overrides both.
        default = CROSS_BOX_KV_BACKEND if spec.cluster_peers else DEFAULT_KV_BACKEND
        kw["cache_transceiver_config"] = transceiver_config(
            api, os.environ.get(KV_BACKEND_ENV, default), extra)
    if spec.role == "prefill":
        kw["disable_overlap_scheduler"] = True      # context-only workers need it
    return kw


def transceiver_config(api: SimpleNamespace, backend: str, extra: dict) -> Any:
    """`CacheTransceiverConfig(backend=...)` in the spelling the installed release takes:
    older ones validate `Literal["default", "ucx", "nixl", "mpi"]`, current ones
    `Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"]` (pydantic rejects the other
    case). Tries the name as given, then upper and lower case; one clear line if none."""
    error: Exception | None = None
    for spelling in dict.fromkeys((backend, backend.upper(), backend.lower())):
        try:
            return api.CacheTransceiverConfig(backend=spelling, **extra)
        except ValueError as exc:       # pydantic's ValidationError is a ValueError
            error = error or exc
    why = " ".join(str(error).split())[:300]
    raise TrtllmUnavailable(
        f"this TensorRT-LLM refuses KV cache transceiver backend {backend!r} in any case "
        f"({why}); set {KV_BACKEND_ENV} to one it accepts")


def build_trtllm_engine(spec, model_dir: Path) -> TrtllmEngine:
    """Called by the worker process (`appliance.worker.engine_factory`). The daemon has
    already set CUDA_VISIBLE_DEVICES to this worker's GPUs."""
    from appliance.models.eos import read_eos_ids

    if spec.device_kind != "gpu":
        raise TrtllmUnavailable(f"TensorRT-LLM needs NVIDIA GPUs; worker {spec.worker} has "
                                f"{spec.device_kind} devices; use --engine torch")
    tp = max(1, len(spec.devices))
    if tp == 1:     # otherwise every LLM spawns an MPI worker process of its own
        os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
    api = import_trtllm()
    kwargs = llm_kwargs(api, spec, model_dir)
    os.environ.update(transceiver_env(spec))        # read when the transceiver starts
    try:
        llm = api.LLM(**kwargs)
    except Exception as exc:
        raise RuntimeError(f"TensorRT-LLM could not load {model_dir}: {_first_line(exc)}") from exc
    kv_cfg = kwargs["kv_cache_config"]
    return TrtllmEngine(
        llm=llm, api=api, worker=spec.worker, role=spec.role, devices=tuple(spec.devices),
        layout=layout_tag(model_dir, getattr(kv_cfg, "dtype", "auto"), tp),
        block_size=int(getattr(kv_cfg, "tokens_per_block", 32) or 32),
        eos_token_ids=read_eos_ids(model_dir))
