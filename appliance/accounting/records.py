"""What the daemon reports about each request and each engine iteration.

`RecordSink` is the seam the ledger plugs into; until then `LogSink` writes one JSON
line per request so nothing is silently dropped.
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass
from typing import Protocol

from appliance.engines.messages import IterationRecord, on_the_wire


@on_the_wire
@dataclass(slots=True)
class RequestRecord:
    request_id: str
    tenant: str
    model: str
    endpoint: str                   # "chat" | "completions"
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    arrival: float                  # unix seconds
    first_token: float | None
    finish: float
    prefill_worker: str | None
    decode_worker: str | None
    status: str                     # "ok" | "error" | "aborted" | "rejected"
    finish_reason: str | None       # rejected: why (overloaded, rate_limit_requests,
                                    # rate_limit_tokens, budget_exceeded)
    error: str | None = None
    simulated: bool = False
    # n > 1: the choices ran as engine requests `request_id`, `request_id.1`, … (their
    # iteration records carry those ids); the token counts above cover all of them.
    choices: int = 1
    # A grammar constrained the output (structured output or a forced tool call): its
    # mask's cost is part of the request's decode time like any other.
    structured: bool = False
    # The simulator only (disaggregated): simulated seconds from the request's arrival at
    # its prefill worker to its first token, on the simulated device's clock, which the
    # daemon's own latency and the machine's load do not stretch (`engines/sim.py`).
    simulated_ttft_s: float | None = None


class RecordSink(Protocol):
    def request(self, record: RequestRecord) -> None: ...
    def iteration(self, record: IterationRecord) -> None: ...


class LogSink:
    """Writes finished requests as JSON lines; ignores iterations (too many to log)."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr

    def request(self, record: RequestRecord) -> None:
        if self.enabled:
            print(json.dumps(asdict(record), separators=(",", ":")), file=self.stream, flush=True)

    def iteration(self, record: IterationRecord) -> None:
        pass


class FanoutSink:
    """Several sinks behind the one seam (the log lines of --log-requests and the
    ledger). A sink that raises is logged and skipped: accounting must never fail a
    request that has already been served."""

    def __init__(self, *sinks):
        self.sinks = [s for s in sinks if s is not None]

    def request(self, record: RequestRecord) -> None:
        for s in self.sinks:
            try:
                s.request(record)
            except Exception:
                logging.getLogger("applianced").exception("request sink %r failed", s)

    def iteration(self, record: IterationRecord) -> None:
        for s in self.sinks:
            try:
                s.iteration(record)
            except Exception:
                logging.getLogger("applianced").exception("iteration sink %r failed", s)
