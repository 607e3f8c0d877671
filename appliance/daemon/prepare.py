"""Request preparation off the event loop, in a small pool of processes.

Parsing a 1 MB body, rendering a chat template over 30,000 messages and tokenizing a
megabyte of text take 0.5-1 s of CPU. On the event loop that stalls every stream and
`/health` for as long; in a thread it still does: `tokenizers`' `encode` holds the GIL
for the whole encoding (measured: 4 turns of the event loop in 2 s), `encode_batch`
releases it but building and dropping a million-token `Encoding` does not (~50 ms),
and JSON parsing and Jinja rendering are GIL-bound Python. So preparation runs in child
processes (one per core, spawned at start-up, each with its own tokenizer): the daemon
sends the raw body and gets back the parsed request (its chat messages dropped: they
are no longer needed) and at most `max_context` token ids.

Small bodies are prepared on the event loop instead: a 4 KB body costs at most ~1 ms
there (measured on the worst contents: one long word, CJK, 140 messages), while the
round trip through the executor's queues, threads and pickling costs the daemon ~300 µs
of CPU and two thread hand-offs per request, which at high concurrency was most of
what the daemon spent per request. Bodies that may ask for a grammar (structured outputs,
tool calls) go to the children whatever their size (`may_ask_for_a_grammar`).

Each request is prepared with the tokenizer of the model served when it arrived, which a
swap-model workflow changes while the daemon runs: the caller passes that tokenizer, and a
child that holds another model's loads the new one (from its checkpoint directory) before
preparing, so no request is tokenized for the model that was served at start-up.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from appliance.daemon.completion import prepare_prompt
from appliance.daemon.openai_protocol import ApiError, GenerationRequest, parse_body
from appliance.daemon.openai_schema import BODIES
from appliance.daemon.tokenizer import ServedTokenizer

_tokenizer: ServedTokenizer | None = None      # in a child: the last model's tokenizer
_tool_parser = ""


def machine_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # not Linux
        return max(1, os.cpu_count() or 1)


def _exit_with(parent: int) -> None:
    """A child holds both ends of the executor's call queue, so it never sees EOF when the
    daemon is killed: it watches for its parent to go instead."""
    while os.getppid() == parent:
        time.sleep(0.25)
    os._exit(0)


def _child_init(model_dir: str, tool_parser: str = "") -> None:
    # Ctrl-C reaches the whole process group: the daemon drains, then ends the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    global _tokenizer, _tool_parser
    _tool_parser = tool_parser
    _tokenizer = ServedTokenizer(Path(model_dir), tool_parser)
    _compile_schemas()


def _compile_schemas() -> None:
    """The request schemas' checks are compiled once per process (~0.2 s each), before
    the first request rather than in its time."""
    for body in BODIES.values():
        body.compile()


def _child_tokenizer(model_dir: str) -> ServedTokenizer:
    """The tokenizer of `model_dir`, loaded here the first time it is asked for after a
    swap (tens of milliseconds for a tokenizer.json)."""
    global _tokenizer
    if _tokenizer is None or str(_tokenizer.model_dir) != model_dir:
        _tokenizer = ServedTokenizer(Path(model_dir), _tool_parser)
    return _tokenizer


def prepare_request(tok: ServedTokenizer, raw: bytes, endpoint: str, model_name: str,
                    max_context: int) -> tuple[GenerationRequest, list[int], int]:
    req = parse_body(raw, endpoint)
    prompt, max_tokens = prepare_prompt(tok, req, model_name, max_context)
    req.messages = None
    return req, prompt, max_tokens


def _child_prepare(raw: bytes, endpoint: str, model_name: str, max_context: int,
                   model_dir: str) -> tuple[GenerationRequest, list[int], int]:
    return prepare_request(_child_tokenizer(model_dir), raw, endpoint, model_name, max_context)


# A body that may ask for a grammar is prepared in the children even when small: checking
# its grammar compiles it with xgrammar, whose import (with transformers and torch, ~2 s the
# first time, ~300 MB) must neither stall the event loop nor grow the daemon, which never
# loads torch. A byte search (~1 µs on 4 KB): a false hit costs only the pool's round trip.
_GRAMMAR_FIELDS = (b'"response_format"', b'"tools"', b'"tool_choice"', b'"structured_outputs"',
                   b'"guided_')


def may_ask_for_a_grammar(raw: bytes) -> bool:
    return any(field in raw for field in _GRAMMAR_FIELDS)


class PreparePool:
    """Parse, validate and tokenize requests with the served model's tokenizer: bodies of
    up to `inline_bytes` here, bigger ones in `processes` child processes (started with
    the tokenizer of `model_dir`, the model served at start-up)."""

    def __init__(self, model_dir: Path, processes: int | None = None, inline_bytes: int = 0,
                 tool_parser: str = ""):
        self.processes = processes or machine_cores()
        self._model_dir = str(model_dir)
        self._tool_parser = tool_parser
        self._executor = self._new_executor()
        self.inline_bytes = inline_bytes
        if self.inline_bytes:
            _compile_schemas()
        self.inline = 0             # how many were prepared here, and in the children
        self.pooled = 0

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_child_init,
                                   initargs=(self._model_dir, self._tool_parser))

    async def start(self) -> None:
        """Start the children now (they load the tokenizer), not on the first request."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(self._executor, os.getpid)
                                   for _ in range(self.processes)))
        except BrokenProcessPool as exc:
            raise OSError(f"the request preparation processes did not start ({exc}); "
                          "see the log above") from None

    def pids(self) -> list[int]:
        return [p.pid for p in (self._executor._processes or {}).values()]

    async def prepare(self, raw: bytes, endpoint: str, model_name: str, max_context: int,
                      tokenizer: ServedTokenizer) -> tuple[GenerationRequest, list[int], int]:
        """`tokenizer`: the served model's (the children load the one of its directory)."""
        if len(raw) <= self.inline_bytes and not may_ask_for_a_grammar(raw):
            self.inline += 1
            return prepare_request(tokenizer, raw, endpoint, model_name, max_context)
        self.pooled += 1
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, _child_prepare, raw, endpoint,
                                              model_name, max_context, str(tokenizer.model_dir))
        except BrokenProcessPool:
            # A child died (killed, out of memory): the pool cannot be used again.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            raise ApiError(503, "request preparation failed (a tokenizer process died); retry",
                           code="prepare_failed", headers={"Retry-After": "1"}) from None

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
