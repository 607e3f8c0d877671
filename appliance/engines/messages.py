"""Typed messages that cross the daemon <-> worker process boundary.

Every backend (simulator, torch, TensorRT-LLM) speaks this same contract, so the
daemon never knows which engine sits behind a worker. The KV handle is opaque to
the daemon: it only carries it from the prefill worker to the decode worker and
back as a release. TensorRT-LLM's `DisaggregatedParams` ride in `KvHandle.payload`.

Messages are small slotted dataclasses pickled over a local socket; workers send a
list of events per engine iteration in one frame so the cost stays per-step, not
per-token.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any


def on_the_wire(cls):
    """Pickle as (class, field values). A slots dataclass otherwise pickles through
    dataclasses' own `__getstate__`, which calls `fields()` for every object: ~3× the
    time both ways (2.1 → 0.6 µs a dump, 1.5 → 0.6 µs a load for a request record), and
    these cross a socket for every engine step."""
    names = [f.name for f in dataclasses.fields(cls)]
    if len(names) > 1:
        get = operator.attrgetter(*names)       # a tuple, in C

        def __reduce__(self):
            return (cls, get(self))
    else:
        def __reduce__(self):
            return (cls, tuple(getattr(self, n) for n in names))
    cls.__reduce__ = __reduce__
    return cls


@on_the_wire
@dataclass(slots=True)
class GuidedDecoding:
    """What the output must match, as the request gave it (not compiled: each worker
    compiles it against its own tokenizer, once per distinct grammar, so a decode worker
    that takes a request over rebuilds the same constraint from this and the tokens so far).

    kind: "json_schema" (source: the schema as JSON text), "json_object" (source unused),
    "regex", "choice" (source: a JSON list of strings), "ebnf" (GBNF text), or
    "tagged_json" (source: JSON {"begin", "schema", "end"}: a literal, then JSON valid for
    the schema, then a literal; how a tool call is forced), or "harmony_call" (source:
    JSON {"calls": [[name, schema], ...]}: one harmony tool-call message of one of the
    functions, `grammar.harmony_header(name)` then arguments valid for its schema; how a
    gpt-oss call is forced)."""

    kind: str
    source: str = ""


@on_the_wire
@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0                          # 0 = off
    frequency_penalty: float = 0.0          # OpenAI's, over the generated tokens
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs
    logprobs: int | None = None             # None: none; k: the chosen token's and top k
    prompt_logprobs: int | None = None      # the same for every prompt token after the first
    guided: GuidedDecoding | None = None    # structured output / forced tool call
    min_tokens: int = 0                     # stop tokens are masked until this many
    repetition_penalty: float = 1.0         # vLLM/HF's: over prompt and generated tokens
    min_p: float = 0.0                      # drop tokens below min_p x the top probability


@on_the_wire
@dataclass(slots=True)
class KvHandle:
    """Where a request's prefilled KV lives. Opaque outside the engines."""

    worker: str                 # source (prefill) worker id
    request_id: str
    block_ids: list[int]
    num_tokens: int             # tokens whose KV is in the blocks
    layout: str                 # layout tag; a receiver with another layout refuses
    payload: Any = None         # engine-specific (e.g. TensorRT-LLM DisaggregatedParams)
    # The source keeps the blocks for the decode side until this instant (time.monotonic(),
    # CLOCK_MONOTONIC: one clock for every process on the host), and frees them only after
    # it plus HANDOFF_MARGIN_S unless released first. A decode worker that gets to the
    # import later recomputes the prompt instead of copying blocks that may be reused.
    expires_at: float = float("inf")
    # Which incarnation of the source's pool holds the blocks (a restarted worker has a
    # new pool under the same worker name): an import from another one is refused.
    pool_id: str = ""


# ---- daemon -> worker -------------------------------------------------------

@on_the_wire
@dataclass(slots=True)
class Prefill:
    """Run the prompt. handoff=True: keep the KV and return a handle (disagg);
    handoff=False: generate the whole answer here (agg / conditional disagg)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    handoff: bool
    # Whose request, for the engine's fair queue: an opaque name, its share of the box
    # (weight) and its priority class (lower first). The engine knows nothing else of it.
    tenant: str = ""
    weight: float = 1.0
    priority: int = 0
    # A decode worker's own prompt that may ride on its decode steps (`Scheduler.
    # ride_rows`); False: it runs whole, as a prefill step (the router's choice).
    ride: bool = False


@on_the_wire
@dataclass(slots=True)
class Decode:
    """Continue a request whose prompt KV sits in another worker's pool."""

    request_id: str
    prompt: list[int]
    first_token: int
    params: SamplingParams
    handle: KvHandle
    tenant: str = ""            # as Prefill's
    weight: float = 1.0
    priority: int = 0


@on_the_wire
@dataclass(slots=True)
class Abort:
    request_id: str


@on_the_wire
@dataclass(slots=True)
class Release:
    """The KV of a handed-off request is no longer needed on its source worker."""

    request_id: str


@on_the_wire
@dataclass(slots=True)
class AttachPeer:
    """A peer worker's exported KV pool (sent once after it says Hello)."""

    worker: str
    handle: Any


@on_the_wire
@dataclass(slots=True)
class PeerGone:
    """A peer worker died: drop its KV pool now, and recompute every queued import from
    it (its blocks are freed memory, or soon another incarnation's)."""

    worker: str


@on_the_wire
@dataclass(slots=True)
class Shutdown:
    pass


# ---- worker -> daemon -------------------------------------------------------

@on_the_wire
@dataclass(slots=True)
class Hello:
    worker: str
    pid: int
    role: str
    engine: str
    simulated: bool
    devices: tuple[str, ...]
    layout: str
    block_size: int
    kv_blocks_total: int
    peer_handle: Any = None     # shared KV pool handle (torch engine) for peers
    # The longest context the engine serves (its model's, capped by its pool or an
    # unimplemented sliding window); 0 = not known (TensorRT-LLM checks its own).
    max_context: int = 0
    threads: int = 0            # torch threads of a CPU engine; 0 = not a CPU engine
    # A worker of a box that joins another (cluster.role != "both"): its KV pool as
    # registered with its NIXL agent, `appliance.kv.nixl_transport.NixlPoolInfo` as JSON
    # (what a peer box needs to pull from it). None: no NIXL agent (role "both", sim).
    nixl_pool: str | None = None
    # A decode worker whose own prompts ride on its decode steps while fewer than this
    # many sequences decode (`Scheduler.ride_rows`); 0: its prompts run whole.
    ride_rows: int = 0


@on_the_wire
@dataclass(slots=True)
class StartFailed:
    """The engine could not be built (bad checkpoint, no memory...): said once, then exit."""

    worker: str
    message: str


# A sampled token's log-probability and the top-k alternatives as (token id, logprob).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@on_the_wire
@dataclass(slots=True)
class PrefillDone:
    """First token of a disaggregated request; handle is None when it already finished."""

    request_id: str
    first_token: int
    handle: KvHandle | None
    finish_reason: str | None   # "stop" | "length" | None (continue on a decode worker)
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None   # one entry, when the request asked
    # One per prompt token, None for the first (nothing predicts it), when asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Simulator only: simulated seconds from the request's arrival at this worker to its
    # first token, on the simulated device's clock (its modelled steps), whatever the
    # machine's load or `--sim-speed`. None on real engines.
    simulated_ttft_s: float | None = None


@on_the_wire
@dataclass(slots=True)
class Tokens:
    request_id: str
    tokens: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None   # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # with the first token only


@on_the_wire
@dataclass(slots=True)
class KvImported:
    """The decode worker has its own copy of the KV: the source may free it.

    `transport` says how the blocks moved ("shm" between CPU workers, "cuda_ipc" between
    GPUs of one box, "nixl" across boxes, "sim" when the simulator modelled the move) with
    their bytes and the seconds the copy took (modelled for "sim"), for the transfer
    metrics. "" = nothing moved (the import was given up and the prompt recomputed)."""

    request_id: str
    source_worker: str
    transport: str = ""         # "shm" | "cuda_ipc" (within a box) | "nixl" | "sim"
    nbytes: int = 0             # bytes moved (0: an import given up)
    seconds: float = 0.0        # how long the move took


@on_the_wire
@dataclass(slots=True)
class RemoteKv:
    """`KvHandle.payload` of a decode whose prompt KV is on another box: what the decode
    worker pulls it with. Strings of JSON (`appliance.kv.nixl_transport.to_json`), which
    the daemons pass on unread; `pool` is "" when the source has no NIXL agent (the
    simulator: the pull is only timed)."""

    pool: str                   # the source worker's NixlPoolInfo
    handle: str                 # the request's NixlKvHandle


@on_the_wire
@dataclass(slots=True)
class RequestFailed:
    request_id: str
    message: str
    code: str = "engine_error"


@on_the_wire
@dataclass(slots=True)
class IterationRecord:
    """One engine iteration. Telemetry turns these into per-request GPU-seconds,
    so wall time and batch composition must be exact.

    entries: (request_id, new_tokens, context_len) for every request in the batch.
    """

    worker: str
    phase: str                  # "prefill" | "decode" | "kv_import" | "mixed" (chunked prefill)
    start: float                # time.time() at the start of the iteration
    wall_s: float
    devices: tuple[str, ...]
    simulated: bool
    entries: list[tuple[str, int, int]] = field(default_factory=list)
    # True where the engine cannot see its batches exactly (TensorRT-LLM): the entries
    # are reconstructed from streamed outputs. Chargeback must say so where it shows them.
    approximate: bool = False


@on_the_wire
@dataclass(slots=True)
class WorkerStats:
    worker: str
    waiting: int
    running: int
    queued_prefill_tokens: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_handed_off: int
    iterations: int
    busy_s: float
    preemptions: int
    prefix_hit_tokens: int
    # Handed-off requests recomputed here instead of imported (deadline passed, or the
    # source died or restarted): a sign of decode workers too full for the handoff timeout.
    kv_recomputes: int = 0
    # How much of the KV pool's memory is faulted in, 0 to 1: a CPU worker's fills in the
    # background after it starts (`cpu_heap.PoolPopulator`); elsewhere it is all there.
    kv_populated: float = 1.0
    # A CPU decode worker that borrows the prefill worker's core while that one idles
    # (`engine.cpu_decode_helper`): the core (-1: none), the steps that had it, and those
    # that did not because the lender was running (a worker without the shared page) or
    # the helper had held a step up (preempted inside a group by something else), and
    # the weight groups and attention items a step took back from the helper and
    # computed itself rather than wait for it (preempted inside them).
    borrowed_core: int = -1
    borrowed_core_steps: int = 0
    borrowed_core_lender_busy_steps: int = 0
    borrowed_core_taken_steps: int = 0
    borrowed_core_taken_back: int = 0
    # The prefill worker whose core that is: its steps (each takes the core back first),
    # those that waited for a helper to leave its group, that wait, and the waits that
    # ran out (a helper held up there by something else).
    lent_core_steps: int = 0
    lent_core_waits: int = 0
    lent_core_wait_s: float = 0.0
    lent_core_gave_up: int = 0
