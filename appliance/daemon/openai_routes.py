"""The OpenAI face of the daemon (aiohttp): completions, chat, models, health, ready.

Errors always leave as OpenAI-shaped JSON: bad input is 4xx with the parameter named,
overload is 503 with Retry-After, and an internal fault is a 500 whose body says so
without a traceback (the traceback goes to the log).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from appliance.daemon.api_schema import Operation, register
from appliance.daemon.completion import Completion
from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.openai_schema import CHAT, COMPLETIONS
from appliance.daemon.responses import (
    OPERATIONS, RETRY_AFTER_S, SERVICE, error_response, json_response, request_id,
)
from appliance.daemon.router import EngineError, NoWorker
from appliance.daemon.structured import capabilities
from appliance.daemon.tenants import Refusal
from appliance.daemon.workers import WorkerGone

if TYPE_CHECKING:
    from appliance.daemon.service import Service

log = logging.getLogger("applianced.http")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
# Engine refusals that are the request's fault (the daemon checks first; engines check again).
DRAINED = ("the appliance is drained for maintenance and takes no new requests "
           "(an operator resumes it: applianced workflow start resume)")
CLIENT_ENGINE_ERRORS = {"kv_capacity", "invalid_request", "context_length_exceeded"}


def _failure(exc: BaseException) -> ApiError:
    if isinstance(exc, NoWorker):
        return ApiError(503, f"{exc}; retry shortly", code="no_worker",
                        headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, WorkerGone):
        return ApiError(503, f"{exc} while serving this request; retry",
                        code="worker_failed", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, EngineError):
        status = 400 if exc.code in CLIENT_ENGINE_ERRORS else 500
        return ApiError(status, str(exc), code=exc.code)
    raise exc


def _refusal(svc: Service, n: int, headers: dict) -> ApiError | None:
    """Why a request of `n` generations is not admitted now, or None. Checked before the
    body is read and parsed (with n = 1: every request is at least one generation), and
    again once it is (its real n; shutdown may have begun meanwhile)."""
    if svc.draining:
        return ApiError(503, "the appliance is shutting down", code="draining",
                        headers={"Retry-After": RETRY_AFTER_S, **headers})
    if not svc.admission_open:
        return ApiError(503, DRAINED, code="draining",
                        headers={"Retry-After": RETRY_AFTER_S, **headers})
    if svc.inflight + n > svc.max_inflight:
        return ApiError(503, f"overloaded: {svc.inflight} generations in flight, this request "
                             f"adds {n} (server.max_inflight = {svc.max_inflight})",
                        code="overloaded", headers={"Retry-After": RETRY_AFTER_S, **headers})
    return None


# OpenAI's `type` of a 429: which limit ("requests", "tokens"), or the quota.
ERROR_TYPES = {"rate_limit_requests": "requests", "rate_limit_tokens": "tokens",
               "budget_exceeded": "insufficient_quota"}


def _limited(refusal: Refusal, headers: dict) -> ApiError:
    """A tenant's limit as OpenAI's API answers it: 429 with Retry-After (whole seconds,
    and `retry-after-ms`, which the official clients read first) and x-ratelimit-*."""
    extra = dict(refusal.headers)
    if refusal.retry_after_s is not None:
        extra["Retry-After"] = str(max(1, math.ceil(refusal.retry_after_s)))
        extra["retry-after-ms"] = str(max(1, math.ceil(refusal.retry_after_s * 1000)))
    return ApiError(429, refusal.message, code=refusal.code,
                    type_=ERROR_TYPES.get(refusal.reason), headers={**extra, **headers})


async def generation(request: web.Request, endpoint: str) -> web.StreamResponse:
    svc: Service = request.app[SERVICE]
    tenant = svc.auth.tenant(request)
    rid = request_id(request)
    headers = {"X-Request-Id": rid}
    arrival = time.time()
    # Refuse before reading, parsing or tokenizing: a 1 MB prompt costs a second of CPU.
    if (err := _refusal(svc, 1, headers)) is not None:
        if err.code == "overloaded":    # demand turned away: the planner counts it
            svc.rejected(endpoint, tenant, rid, arrival, err.message)
        raise err
    policy = svc.tenants
    # A tenant without limits or an enforced budget skips the checks (the usual case).
    limited = policy.limited(tenant)
    # The tenant's spent budget and its requests-per-minute: before the body is read.
    if limited and (refusal := policy.admit(tenant)) is not None:
        svc.rejected(endpoint, tenant, rid, arrival, refusal.message, refusal.reason)
        raise _limited(refusal, headers)
    raw = await request.read()
    # Parse, validate and tokenize in the prepare pool's processes, off the event loop.
    svc.state.preparing += 1
    try:
        req, prompt, max_tokens = await svc.prepare_pool.prepare(raw, endpoint, svc.model_name,
                                                                 svc.max_context, svc.tokenizer)
    finally:
        svc.state.preparing -= 1
    comp = Completion(svc, req, tenant, rid, arrival)
    comp.prompt, comp.max_tokens = prompt, max_tokens
    n = len(comp.choices)   # each choice is a generation of its own on the workers
    reservation = None
    if limited:
        # a spent deprioritizing budget: the lowest class (fair queuing orders by it)
        req.priority = policy.request_priority(tenant, req.priority)
        # Tokens per minute need the count: prompt + the output the request may make.
        asked = len(prompt) + n * (req.max_tokens or 0)
        reservation, refusal = policy.reserve(tenant, asked)
        if refusal is not None:
            svc.rejected(endpoint, tenant, rid, arrival, refusal.message, refusal.reason)
            raise _limited(refusal, headers)
    if (err := _refusal(svc, n, headers)) is not None:
        policy.finished_unstarted(tenant, reservation)
        if err.code == "overloaded":
            comp.status, comp.error = "rejected", err.message
            svc.finished(comp)
        raise err
    if limited:
        headers.update(policy.headers(tenant))
    svc.state.inflight += n
    policy.started(tenant)
    try:
        if req.stream:
            return await _stream(request, comp, headers)
        return await _complete(comp, headers)
    except asyncio.CancelledError:
        comp.status = "aborted"
        comp.error = "client disconnected"
        raise
    finally:
        svc.state.inflight -= n
        policy.finished(tenant, reservation, len(comp.prompt) + comp.completion_tokens)
        svc.finished(comp)


async def _complete(comp: Completion, headers: dict) -> web.Response:
    n = len(comp.choices)
    parts: list[list[str]] = [[] for _ in range(n)]
    entries: list[list] = [[] for _ in range(n)]
    try:
        async for index, text, lps in comp.run():
            parts[index].append(text)
            entries[index].extend(lps)
    except (NoWorker, WorkerGone, EngineError) as exc:
        comp.error = str(exc)
        err = _failure(exc)
        err.headers.update(headers)
        return error_response(err)
    comp.status = "ok"
    return json_response(comp.full(["".join(p) for p in parts], entries), headers=headers)


async def _stream(request: web.Request, comp: Completion, headers: dict) -> web.StreamResponse:
    gen = comp.run()
    # Wait for the first text before sending headers: a request that fails before its
    # first byte still gets a proper HTTP status (503), not a broken stream.
    try:
        first = await anext(gen, None)
    except (NoWorker, WorkerGone, EngineError) as exc:
        comp.error = str(exc)
        err = _failure(exc)
        err.headers.update(headers)
        return error_response(err)
    resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
    await resp.prepare(request)
    try:
        chat = comp.req.endpoint == "chat"
        out = b"".join(comp.chunk(c.index, "", None, first=True) for c in comp.choices) \
            if chat else b""
        sent = [0] * len(comp.choices)   # characters of text so far (completions' text_offset)
        item = first
        while item is not None:
            index, text, lps = item
            out += comp.chunk(index, text, None, logprobs=comp.logprobs(lps, sent[index]))
            sent[index] += len(text)
            await resp.write(out)
            out = b""
            item = await anext(gen, None)
        if out:
            await resp.write(out)
        tail = b"".join(comp.chunk(c.index, None if chat else "", c.finish_reason)
                        for c in comp.choices)
        if comp.req.include_usage:
            tail += comp.usage_chunk()
        await resp.write(tail + DONE)
        comp.status = "ok"
    except (NoWorker, WorkerGone, EngineError) as exc:
        comp.error = str(exc)
        err = _failure(exc)
        await resp.write(b"event: error\ndata: " + orjson.dumps(err.body()) + b"\n\n" + DONE)
    except (ConnectionError, asyncio.CancelledError):
        comp.status = "aborted"
        comp.error = "client disconnected"
        raise
    finally:
        await gen.aclose()
    return resp


async def chat_completions(request: web.Request):
    return await generation(request, "chat")


async def completions(request: web.Request):
    return await generation(request, "completions")


async def models(request: web.Request):
    svc: Service = request.app[SERVICE]
    svc.auth.tenant(request)
    return json_response({"object": "list", "data": [{
        "id": svc.model_name, "object": "model", "created": int(svc.started_at),
        "owned_by": "applianced", "max_model_len": svc.max_context,
        "capabilities": capabilities(svc.setup.engine, svc.tokenizer.tool_parser,
                                     svc.tokenizer.reasoning_parser),
        "simulated": svc.simulated}]})


async def health(request: web.Request):
    svc: Service = request.app[SERVICE]
    return json_response({"status": "ok", "simulated": svc.simulated})


async def ready(request: web.Request):
    svc: Service = request.app[SERVICE]
    if svc.draining:
        raise ApiError(503, "the appliance is shutting down", code="draining")
    if not svc.admission_open:
        raise ApiError(503, DRAINED, code="draining", headers={"Retry-After": RETRY_AFTER_S})
    if not svc.router.ready():
        raise ApiError(503, "workers are not ready", code="no_worker",
                       headers={"Retry-After": RETRY_AFTER_S})
    return json_response({"status": "ready", "simulated": svc.simulated})


_GENERATED = {"200": ("application/json", {"type": "object"}),
              "200 stream": ("text/event-stream", {"type": "string"})}
OPERATIONS_HERE = (
    Operation("POST", "/v1/chat/completions", chat_completions, "Create a chat completion",
              "OpenAI", "tenant", body=CHAT, ok=_GENERATED, errors=(400, 413, 503)),
    Operation("POST", "/v1/completions", completions, "Create a text completion", "OpenAI",
              "tenant", body=COMPLETIONS, ok=_GENERATED, errors=(400, 413, 503)),
    Operation("GET", "/v1/models", models, "List the served model", "OpenAI", "tenant"),
    Operation("GET", "/health", health, "Liveness: the daemon answers", "Probes", "open"),
    Operation("GET", "/ready", ready, "Readiness: workers can serve (503 while not)",
              "Probes", "open", errors=(503,)),
)


def add_routes(app: web.Application) -> None:
    register(app, OPERATIONS_HERE, OPERATIONS)
