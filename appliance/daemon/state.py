"""What changes while the daemon runs, each kept in one place: the served model, the
live partition, and admission (shutting down, drained by an operator, in flight).

The handlers read it through the Service; workflows change it through `Control`.

The served model is what /v1/models names, what requests are validated against (its
name, its context) and tokenized with, what /metrics labels and what the ledger
records: all read from `ServedModel`, so a swap-model workflow's routing switch changes
them together, in one call.
"""
from __future__ import annotations

import logging
from pathlib import Path

from appliance.partitions import PartitionPlan

from appliance.daemon.setup import model_max_context
from appliance.daemon.tokenizer import ServedTokenizer
from appliance.workflows.machine import ModelRef

log = logging.getLogger("applianced")


class ServedModel:
    """Name, checkpoint, context and tokenizer of the served model; `swap` replaces all
    of them at once."""

    __slots__ = ("name", "model_dir", "model_spec", "max_context", "tool_parser", "reasoning_parser",
                 "tokenizer")

    def __init__(self, name: str, model_dir: Path, model_spec: str | None, max_context: int,
                 tokenizer: ServedTokenizer | None = None, tool_parser: str = "",
                 reasoning_parser: str = ""):
        self.name = name
        self.model_dir = Path(model_dir)
        self.model_spec = model_spec or None
        self.max_context = max_context
        self.tool_parser = tool_parser      # [engine] tool_parser: "" = from the template
        self.reasoning_parser = reasoning_parser    # [engine] reasoning_parser, likewise
        self.tokenizer = tokenizer or ServedTokenizer(self.model_dir, tool_parser,
                                                      reasoning_parser)

    @property
    def ref(self) -> ModelRef:
        """As a workflow names it (what `Control.served_model` answers)."""
        return ModelRef(self.name, str(self.model_dir), self.model_spec)

    def cap_context(self, limits: list[tuple[int, str]]) -> None:
        """A request must fit every worker it may land on, not just the model's context:
        cap to the smallest of `limits` (tokens, why), e.g. the smallest KV pool."""
        limits = [lim for lim in limits if lim[0]]
        if limits and min(limits)[0] < self.max_context:
            self.max_context, why = min(limits)
            log.info("context capped to %d tokens by %s", self.max_context, why)

    def swap(self, model: ModelRef, limits: list[tuple[int, str]]) -> None:
        """Serve `model` from now on: its name, its tokenizer (loaded only when the
        checkpoint changes), its context capped by `limits` (the pools of the workers
        that serve it)."""
        model_dir = Path(model.model_dir)
        if model_dir != self.model_dir:
            self.tokenizer = ServedTokenizer(model_dir, self.tool_parser,
                                             self.reasoning_parser)
        self.name = model.name
        self.model_dir = model_dir
        self.model_spec = model.model_spec or None
        try:
            self.max_context = model_max_context(model_dir, model.model_spec or "")
        except (ValueError, OSError):
            pass
        limits = [lim for lim in limits if lim[0]]
        if limits:
            self.max_context = min(self.max_context, min(limits)[0])


class ServingState:
    """The live partition and admission: what workflows change and handlers check."""

    __slots__ = ("model", "plan", "max_inflight", "inflight", "preparing", "draining",
                 "admission_open")

    def __init__(self, model: ServedModel, plan: PartitionPlan, max_inflight: int,
                 admission_open: bool = True):
        self.model = model
        self.plan = plan                    # the live partition (workflows change it)
        self.max_inflight = max_inflight
        self.inflight = 0                   # generations admitted and not finished
        self.preparing = 0                  # requests being parsed and tokenized right now
        self.draining = False               # shutting down: no new requests
        self.admission_open = admission_open    # False: drained by an operator (workflow)


def context_limits(workers) -> list[tuple[int, str]]:
    """What each of `workers` (started `WorkerLink`s) can hold of one request: its KV
    pool, and what its engine says it serves exactly (the torch engine: the model's
    max_position_embeddings, sliding windows included)."""
    limits = []
    for w in workers:
        if w.hello:
            limits += [(w.hello.kv_blocks_total * w.hello.block_size, "the smallest KV pool"),
                       (w.hello.max_context, f"the {w.hello.engine} engine")]
    return limits
