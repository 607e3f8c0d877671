"""A stand-in for the `tensorrt_llm` package, for tests on machines without GPUs.

Same names, signatures and object shapes as the real LLM API (NVIDIA/TensorRT-LLM main,
1.x; files read: tensorrt_llm/llmapi/llm.py, disaggregated_params.py, sampling_params.py,
executor/result.py, llmapi/llm_args.py, and the iteration-stats keys of
cpp/tensorrt_llm/executor/jsonSerialization.cpp):

- `LLM(model, ..., tensor_parallel_size=1, dtype="auto", ..., **kwargs)`; kwargs must be
  `TorchLlmArgs` fields (the real BaseLLM raises ValueError otherwise).
- `LLM.generate_async(inputs, sampling_params=None, ..., streaming=False, ...,
  disaggregated_params=None, ...)` returns a `RequestOutput` that is awaitable and
  async-iterable; it needs a running asyncio loop, as the real result's queue does.
  A context-only request gets `max_tokens = 1` (what the PyTorch backend does), answers
  one token with finish_reason "not_finished" and a new
  `DisaggregatedParams(request_type="context_only", first_gen_tokens, ctx_request_id,
  opaque_state, draft_tokens)`; a generation-only request "pulls" that context from a
  process-wide transceiver table (and so frees it) and its output starts with
  `first_gen_tokens`, as the real integration test shows.
- Iterations are batched like in-flight batching: every active request advances once per
  iteration, and with `enable_iter_perf_stats=True` each iteration leaves a stats dict
  with the real keys, read through `get_stats(timeout)` / `get_stats_async(timeout)`.

Tokens are deterministic: the first from the prompt and seed, each next one from the one
before, so a generation-only request continued from a context-only first token yields
exactly what one aggregated request yields.

Use `modules()` to get fresh module objects to put into `sys.modules`.
"""
from __future__ import annotations

import asyncio
import itertools
import queue as queue_mod
import time
import types
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, List, Literal, Optional, Union

VOCAB = 32000
FIRST_REGULAR_ID = 10       # generated ids stay above the usual special ids


def first_token(prompt: list[int], seed: int | None) -> int:
    h = sum((i + 1) * t for i, t in enumerate(prompt)) * 2654435761 + (seed or 0) * 97
    return FIRST_REGULAR_ID + h % (VOCAB - FIRST_REGULAR_ID)


def next_token(prev: int, seed: int | None) -> int:
    return FIRST_REGULAR_ID + (prev * 1103515245 + 12345 + (seed or 0)) % (VOCAB - FIRST_REGULAR_ID)


def expected_tokens(prompt: list[int], n: int, seed: int | None = None) -> list[int]:
    out = [first_token(prompt, seed)]
    while len(out) < n:
        out.append(next_token(out[-1], seed))
    return out


# ---- configs (pydantic StrictBaseModel in the real package: unknown keys rejected) ----

class _StrictConfig:
    model_fields: dict[str, Any] = {}

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self.model_fields)
        if unknown:
            raise ValueError(f"{type(self).__name__}: extra inputs are not permitted: "
                             f"{sorted(unknown)}")
        for name, default in self.model_fields.items():
            setattr(self, name, kwargs.get(name, default))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.model_fields)
        return f"{type(self).__name__}({body})"


class KvCacheConfig(_StrictConfig):
    model_fields = {
        "enable_block_reuse": True, "max_tokens": None, "max_attention_window": None,
        "sink_token_length": None, "free_gpu_memory_fraction": 0.9, "host_cache_size": None,
        "onboard_blocks": True, "cross_kv_cache_fraction": None,
        "secondary_offload_min_priority": None, "event_buffer_max_size": 0,
        "attention_dp_events_gather_period_ms": 5, "enable_partial_reuse": True,
        "copy_on_partial_reuse": True, "use_uvm": False, "max_gpu_total_bytes": 0,
        "dtype": "auto", "mamba_ssm_cache_dtype": "auto", "tokens_per_block": 32,
        "use_kv_cache_manager_v2": False, "max_util_for_resume": 0.95,
    }


# The backend's spelling changed between releases: `Literal["default", "ucx", "nixl",
# "mpi"]` in older llm_args.py, `Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"]` in
# current ones; pydantic rejects the other case. Tests switch this to emulate either.
TRANSCEIVER_BACKENDS = ("DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI")
OLD_TRANSCEIVER_BACKENDS = ("default", "ucx", "nixl", "mpi")


class CacheTransceiverConfig(_StrictConfig):
    model_fields = {
        "backend": None, "transceiver_runtime": None, "max_tokens_in_buffer": None,
        "kv_transfer_timeout_ms": None, "kv_transfer_sender_future_timeout_ms": 1000,
    }

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.backend is not None and self.backend not in TRANSCEIVER_BACKENDS:
            # pydantic's ValidationError is a ValueError
            raise ValueError(f"1 validation error for CacheTransceiverConfig\nbackend\n  Input "
                             f"should be {' or '.join(map(repr, TRANSCEIVER_BACKENDS))} "
                             f"[type=literal_error, input_value={self.backend!r}]")


class TorchLlmArgs:
    """Only its field names: what `LLM(**kwargs)` accepts besides its named parameters."""
    model_fields = dict.fromkeys((
        "model", "tokenizer", "tokenizer_mode", "custom_tokenizer", "skip_tokenizer_init",
        "trust_remote_code", "tensor_parallel_size", "dtype", "revision", "tokenizer_revision",
        "model_kwargs", "pipeline_parallel_size", "context_parallel_size", "gpus_per_node",
        "moe_cluster_parallel_size", "moe_tensor_parallel_size", "moe_expert_parallel_size",
        "enable_attention_dp", "cp_config", "load_format", "enable_lora", "lora_config",
        "kv_cache_config", "enable_chunked_prefill", "guided_decoding_backend",
        "batched_logits_processor", "iter_stats_max_iterations", "request_stats_max_iterations",
        "peft_cache_config", "scheduler_config", "cache_transceiver_config",
        "sparse_attention_config", "speculative_config", "max_batch_size", "max_input_len",
        "max_seq_len", "max_beam_width", "max_num_tokens", "gather_generation_logits",
        "num_postprocess_workers", "postprocess_tokenizer_dir", "reasoning_parser",
        "decoding_config", "mpi_session", "otlp_traces_endpoint", "backend",
        "return_perf_metrics", "perf_metrics_max_requests", "orchestrator_type", "env_overrides",
        "garbage_collection_gen0_threshold", "cuda_graph_config", "attention_dp_config",
        "disable_overlap_scheduler", "moe_config", "attn_backend", "sampler_type",
        "enable_iter_perf_stats", "enable_iter_req_stats", "print_iter_log",
        "batch_wait_timeout_ms", "torch_compile_config", "enable_autotuner", "stream_interval",
        "checkpoint_loader", "checkpoint_format", "kv_connector_config",
    ))


# ---- params -----------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: Optional[str] = None
    first_gen_tokens: Optional[List[int]] = None
    first_gen_log_probs: Optional[List] = None
    first_gen_logits: Optional[List] = None
    ctx_request_id: Optional[int] = None
    opaque_state: Optional[bytes] = None
    draft_tokens: Optional[List[int]] = None
    disagg_request_id: Optional[int] = None
    ctx_dp_rank: Optional[int] = None
    ctx_info_endpoint: Optional[str] = None
    schedule_style: Optional[int] = None
    multimodal_embedding_handles: Optional[List[dict]] = None
    multimodal_hashes: Optional[List[List[int]]] = None
    mrope_position_ids_handle: Optional[dict] = None
    mrope_position_deltas_handle: Optional[dict] = None

    def __post_init__(self):
        if self.request_type is not None:
            self.request_type = self.request_type.lower()
            if self.request_type not in ("context_only", "generation_only",
                                         "context_and_generation"):
                raise ValueError(f"Unknown request type: {self.request_type}. Must be "
                                 "context_only, generation_only or context_and_generation")


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """tensorrt_llm/sampling_params.py: one of these is set (validated by SamplingParams)."""
    json: Optional[Any] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, List[str]]] = None
    bad_token_ids: Optional[List[int]] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    top_p_min: Optional[float] = None
    top_p_reset_ids: Optional[int] = None
    top_p_decay: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    beam_search_diversity_rate: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    no_repeat_ngram_size: Optional[int] = None
    min_p: Optional[float] = None
    beam_width_array: Optional[List[int]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Optional[List[str]] = None
    lookahead_config: Any = None
    guided_decoding: Any = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.top_p is not None and (self.top_p < 0 or self.top_p > 1):
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")


# ---- outputs ----------------------------------------------------------------------

@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: Optional[List[int]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Any = field(default_factory=list)
    prompt_logprobs: Any = field(default_factory=list)
    finish_reason: Optional[Literal["stop", "length", "timeout", "cancelled"]] = None
    stop_reason: Optional[Union[int, str]] = None
    generation_logits: Any = None
    additional_context_outputs: Any = None
    additional_generation_outputs: Any = None
    disaggregated_params: Optional[DisaggregatedParams] = None
    request_perf_metrics: Any = None
    _last_token_ids_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> List[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass(slots=True)
class _Response:
    tokens: list[int]
    is_final: bool
    finish_reason: str | None = None
    context_params: DisaggregatedParams | None = None
    cached_tokens: int = 0
    error: str | None = None


class RequestError(RuntimeError):
    pass


class RequestOutput:
    """`GenerationResult` as the user sees it: `await` it, or `async for` when streaming."""

    def __init__(self, llm: "LLM", request_id: int, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, streaming: bool,
                 disaggregated_params: DisaggregatedParams | None):
        self._llm = llm
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self._streaming = streaming
        self.disaggregated_params = disaggregated_params
        self.cached_tokens = 0
        self.decoding_iter = 0
        self._done = False
        self._aborted = False
        self._outputs = [CompletionOutput(0)]
        self._queue: asyncio.Queue = asyncio.Queue()   # needs the running loop, like AsyncQueue

    @property
    def outputs(self) -> List[CompletionOutput]:
        return self._outputs[:self.sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def prompt(self) -> Optional[str]:
        return None

    def abort(self) -> None:
        self._llm._abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _handle_response(self, rsp: _Response) -> None:
        if rsp.error is not None:
            self._done = True
            raise RequestError(rsp.error)
        self._done = rsp.is_final
        self.decoding_iter += 1
        self.cached_tokens = rsp.cached_tokens
        if rsp.context_params is not None:
            self.disaggregated_params = rsp.context_params
        out = self._outputs[0]
        out.disaggregated_params = self.disaggregated_params
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(rsp.tokens)
        if self._done:
            out.finish_reason = rsp.finish_reason

    async def _aresult_step(self) -> None:
        self._handle_response(await self._queue.get())

    async def aresult(self) -> "RequestOutput":
        while not self._done:
            await self._aresult_step()
        return self

    def __await__(self):
        return self.aresult().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        await self._aresult_step()
        return self


class IterationResult:
    """What `get_stats_async` returns: stats dicts until `timeout` s pass without one."""

    def __init__(self, source: "queue_mod.Queue[dict]"):
        self._source = source
        self._done = False
        self._timeout = 2.0

    def set_timeout(self, timeout: float) -> None:
        self._timeout = timeout

    def mark_undone(self) -> None:
        self._done = False

    def get_results(self) -> List[dict]:
        results = []
        while not self._done:
            try:
                results.append(self._source.get(timeout=self._timeout))
            except queue_mod.Empty:
                self._done = True
        return results

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self._done:
            raise StopAsyncIteration
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return self._source.get_nowait()
            except queue_mod.Empty:
                if time.monotonic() >= deadline:
                    self._done = True
                    raise StopAsyncIteration from None
                await asyncio.sleep(0.001)


class _EmptyAsyncIterable:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration


# ---- the engine -------------------------------------------------------------------

# The "cache transceiver": context KV waiting to be pulled, by ctx_request_id. A pull
# removes the entry, as the real transceiver frees context blocks once they are sent.
PENDING_CONTEXTS: dict[int, dict] = {}
MIN_GLOBAL_ID = 1 << 40
_ctx_ids = itertools.count(1)


@dataclass(slots=True)
class _Active:
    result: RequestOutput
    prompt: list[int]
    sp: SamplingParams
    kind: str                           # "normal" | "context_only" | "generation_only"
    disagg: DisaggregatedParams | None
    tokens: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    started: bool = False
    cancelled: bool = False


DEFAULT_REQUEST_PRIORITY = 0.5


class LLM:
    instances: list["LLM"] = []

    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs):
        valid = set(TorchLlmArgs.model_fields) | {"_mpi_session", "backend"}
        for key in kwargs:
            if key not in valid:
                raise ValueError(f"LLM got invalid argument: {key}")
        self.model = str(model)
        self.tensor_parallel_size = tensor_parallel_size
        self.kwargs = dict(kwargs)
        self.kv_cache_config = kwargs.get("kv_cache_config") or KvCacheConfig()
        self.cache_transceiver_config = kwargs.get("cache_transceiver_config")
        self.step_s = 0.002
        self.aborted: list[int] = []
        self.submitted: list[tuple[list[int], SamplingParams, bool, DisaggregatedParams | None]] = []
        self.priorities: list[float] = []          # generate_async's priority, per request
        self._active: list[_Active] = []
        self._ids = itertools.count(1)
        self._iter = 0
        self._task: asyncio.Task | None = None
        self._stats: queue_mod.Queue = queue_mod.Queue()
        self._iter_stats_result: IterationResult | None = None
        self._shutdown = False
        LLM.instances.append(self)

    # -- public API --
    def generate_async(self, inputs, sampling_params: Optional[SamplingParams] = None,
                       lora_request=None, prompt_adapter_request=None, streaming: bool = False,
                       kv_cache_retention_config=None,
                       disaggregated_params: Optional[DisaggregatedParams] = None,
                       trace_headers=None, _postproc_params=None, scheduling_params=None,
                       conversation_params=None, cache_salt: Optional[str] = None,
                       priority: float = DEFAULT_REQUEST_PRIORITY) -> RequestOutput:
        # The signature of current main (tensorrt_llm/llmapi/llm.py): `priority` is "the
        # scheduling priority for the request, in the range [0, 1]. Higher values indicate
        # higher priority. Defaults to 0.5."
        loop = asyncio.get_running_loop()
        if not isinstance(priority, float) or not 0.0 <= priority <= 1.0:
            raise ValueError(f"priority must be a float in [0, 1], got {priority!r}")
        self.priorities.append(priority)
        if self._shutdown:
            raise RuntimeError("LLM is shutting down")
        if isinstance(inputs, dict) and "prompt_token_ids" in inputs:
            inputs = inputs["prompt_token_ids"]
        if not isinstance(inputs, list) or not all(isinstance(t, int) for t in inputs):
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        sp = sampling_params if sampling_params is not None else SamplingParams()
        kind = "normal"
        if disaggregated_params is not None:
            kind = {"context_only": "context_only",
                    "generation_only": "generation_only"}.get(disaggregated_params.request_type,
                                                              "normal")
            if kind != "normal" and (self.cache_transceiver_config is None
                                     or self.cache_transceiver_config.backend is None):
                raise ValueError("disaggregated request on an LLM without a cache transceiver")
        if kind == "context_only":
            # The KV transceiver keys its sessions by get_unique_rid(request), which is
            # disaggregated_params.disagg_request_id whenever disaggregated params are set
            # (_torch/disaggregation): without one it asserts. Global ids live in
            # [2**40, 2**63), apart from local request ids.
            rid = disaggregated_params.disagg_request_id
            if not isinstance(rid, int) or not MIN_GLOBAL_ID <= rid < 1 << 63:
                raise AssertionError(f"context_only request needs a disagg_request_id in "
                                     f"[2**40, 2**63), got {rid!r}")
            if any(c["disagg_request_id"] == rid for c in PENDING_CONTEXTS.values()):
                raise AssertionError(f"disagg_request_id {rid} is already in flight")
            sp.max_tokens = 1       # what the PyTorch backend does for context-only requests
        limit = self.kwargs.get("max_num_tokens")
        if kind != "generation_only" and limit and len(inputs) > limit:
            raise ValueError(f"The sum of prompt length ({len(inputs)}), query length (0) "
                             f"should not exceed max_num_tokens ({limit})")
        self.submitted.append((list(inputs), sp, streaming, disaggregated_params))
        result = RequestOutput(self, next(self._ids), list(inputs), sp, streaming,
                               disaggregated_params)
        self._active.append(_Active(result, list(inputs), sp, kind, disaggregated_params))
        if self.kwargs.get("enable_iter_perf_stats"):
            if self._iter_stats_result is None:
                self._iter_stats_result = IterationResult(self._stats)
            self._iter_stats_result.mark_undone()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return result

    def get_stats(self, timeout: Optional[float] = 2) -> List[dict]:
        if self._iter_stats_result is None:
            return []
        self._iter_stats_result.set_timeout(timeout)
        return self._iter_stats_result.get_results()

    def get_stats_async(self, timeout: Optional[float] = 2):
        if self._iter_stats_result is None:
            return _EmptyAsyncIterable()
        self._iter_stats_result.set_timeout(timeout)
        return self._iter_stats_result

    def shutdown(self) -> None:
        self._shutdown = True

    def __getstate__(self):
        raise RuntimeError("LLM object can not be pickled.")

    # -- the "executor" --
    def _abort_request(self, request_id: int) -> None:
        self.aborted.append(request_id)
        for a in self._active:
            if a.result.request_id == request_id:
                a.cancelled = True

    async def _run(self) -> None:
        while self._active:
            t0 = time.perf_counter()
            stamp = datetime.now().strftime("%m-%d-%Y %H:%M:%S.%f")
            batch = list(self._active[:self.kwargs.get("max_batch_size") or 2048])
            ctx = [a for a in batch if not a.started and a.kind != "generation_only"]
            await asyncio.sleep(self.step_s)
            completed = 0
            for a in batch:
                if self._advance(a):
                    self._active.remove(a)
                    completed += 1
            if self.kwargs.get("enable_iter_perf_stats"):
                self._iter += 1
                self._stats.put(self._iteration_stats(stamp, t0, batch, ctx, completed))

    def _advance(self, a: _Active) -> bool:
        """One iteration of one request; True when it is finished."""
        q = a.result._queue
        if a.cancelled:
            q.put_nowait(_Response(a.unsent, True, "cancelled"))
            return True
        ctx_params = None
        if not a.started:
            a.started = True
            if a.kind == "generation_only":
                ctx = PENDING_CONTEXTS.pop(a.disagg.ctx_request_id, None)
                if ctx is None or ctx["opaque_state"] != a.disagg.opaque_state or \
                        ctx["disagg_request_id"] != a.disagg.disagg_request_id:
                    q.put_nowait(_Response([], True, error="KV cache transfer failed: "
                                           f"unknown context {a.disagg.ctx_request_id}"))
                    return True
                new = list(a.disagg.first_gen_tokens) + [next_token(a.disagg.first_gen_tokens[-1],
                                                                    a.sp.seed)]
            else:
                new = [first_token(a.prompt, a.sp.seed)]
        else:
            new = [next_token(a.tokens[-1], a.sp.seed)]
        a.tokens += new
        a.unsent += new
        reason = None
        last = a.tokens[-1]
        if a.sp.stop_token_ids and last in a.sp.stop_token_ids:
            reason = "stop"
        elif last == a.sp.end_id and not a.sp.ignore_eos:
            reason = "stop"
        elif len(a.tokens) >= a.sp.max_tokens:
            reason = "length"
        if a.kind == "context_only" and reason != "stop":
            reason = "not_finished"
            ctx_id = next(_ctx_ids)
            opaque = f"fake-kv:{self.model}:{ctx_id}".encode()
            PENDING_CONTEXTS[ctx_id] = {"prompt": list(a.prompt), "opaque_state": opaque,
                                        "disagg_request_id": a.disagg.disagg_request_id}
            ctx_params = DisaggregatedParams(request_type="context_only",
                                             first_gen_tokens=list(a.tokens),
                                             ctx_request_id=ctx_id, opaque_state=opaque,
                                             draft_tokens=None)
        final = reason is not None
        if final or a.result._streaming:
            a.result._queue.put_nowait(_Response(a.unsent, final, reason, ctx_params))
            a.unsent = []
        return final

    def _iteration_stats(self, stamp: str, t0: float, batch: list[_Active],
                         ctx: list[_Active], completed: int) -> dict:
        tpb = self.kv_cache_config.tokens_per_block
        total = (self.kv_cache_config.max_tokens or 65536) // tpb
        used = sum(-(-(len(a.prompt) + len(a.tokens)) // tpb) for a in self._active)
        return {
            "timestamp": stamp, "iter": self._iter,
            "iterLatencyMS": (time.perf_counter() - t0) * 1e3,
            "newActiveRequestsQueueLatencyMS": 0.0, "numNewActiveRequests": len(ctx),
            "numActiveRequests": len(batch), "numQueuedRequests": 0,
            "numCompletedRequests": completed, "maxNumActiveRequests": 2048,
            "gpuMemUsage": 0, "cpuMemUsage": 0, "pinnedMemUsage": 0,
            "kvCacheStats": {"maxNumBlocks": total, "freeNumBlocks": total - used,
                             "usedNumBlocks": used, "tokensPerBlock": tpb,
                             "allocTotalBlocks": used, "allocNewBlocks": 0,
                             "reusedBlocks": 0, "missedBlocks": 0, "cacheHitRate": 0.0},
            "inflightBatchingStats": {
                "numScheduledRequests": len(batch), "numContextRequests": len(ctx),
                "numGenRequests": len(batch) - len(ctx), "numPausedRequests": 0,
                "numCtxTokens": sum(len(a.prompt) for a in ctx), "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 0.0},
        }


def reset() -> None:
    LLM.instances.clear()
    PENDING_CONTEXTS.clear()


def modules() -> dict[str, types.ModuleType]:
    """Fresh `tensorrt_llm`, `tensorrt_llm.llmapi`, ... module objects for sys.modules."""
    reset()
    root = types.ModuleType("tensorrt_llm")
    root.__path__ = []          # a package, so submodule imports resolve through sys.modules
    root.__version__ = "0.0.0+fake"
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.__path__ = []
    llm_args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    disagg = types.ModuleType("tensorrt_llm.disaggregated_params")
    sampling = types.ModuleType("tensorrt_llm.sampling_params")
    for name, obj in {"LLM": LLM, "SamplingParams": SamplingParams,
                      "DisaggregatedParams": DisaggregatedParams}.items():
        setattr(root, name, obj)
    for name, obj in {"LLM": LLM, "SamplingParams": SamplingParams,
                      "DisaggregatedParams": DisaggregatedParams, "KvCacheConfig": KvCacheConfig,
                      "CacheTransceiverConfig": CacheTransceiverConfig,
                      "RequestOutput": RequestOutput, "CompletionOutput": CompletionOutput,
                      "RequestError": RequestError, "TorchLlmArgs": TorchLlmArgs,
                      "GuidedDecodingParams": GuidedDecodingParams}.items():
        setattr(llmapi, name, obj)
    for name, obj in {"KvCacheConfig": KvCacheConfig, "CacheTransceiverConfig":
                      CacheTransceiverConfig, "TorchLlmArgs": TorchLlmArgs}.items():
        setattr(llm_args, name, obj)
    disagg.DisaggregatedParams = DisaggregatedParams
    sampling.SamplingParams = SamplingParams
    sampling.GuidedDecodingParams = GuidedDecodingParams
    root.llmapi = llmapi
    llmapi.llm_args = llm_args
    return {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi,
            "tensorrt_llm.llmapi.llm_args": llm_args,
            "tensorrt_llm.disaggregated_params": disagg,
            "tensorrt_llm.sampling_params": sampling}

