"""The HTTP face of the daemon (aiohttp): OpenAI API, health, admin status, metrics.

Errors always leave as OpenAI-shaped JSON: bad input is 4xx with the parameter named,
overload is 503 with Retry-After, and an internal fault is a 500 whose body says so
without a traceback (the traceback goes to the log).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from appliance.accounting.records import RequestRecord
from appliance.daemon.openai_api import ApiError, GenerationRequest, bad, parse_request, usage
from appliance.daemon.router import EngineError, NoWorker, Trace
from appliance.daemon.tokenizer import StopMatcher
from appliance.daemon.workers import WorkerGone

if TYPE_CHECKING:
    from appliance.daemon.app import Service

log = logging.getLogger("applianced.http")

SERVICE = web.AppKey("service", object)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
RETRY_AFTER_S = "1"
DONE = b"data: [DONE]\n\n"
# Engine refusals that are the request's fault (the daemon checks first; engines check again).
CLIENT_ENGINE_ERRORS = {"kv_capacity", "invalid_request", "context_length_exceeded"}


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type="application/json")


def error_response(err: ApiError, request_id: str | None = None) -> web.Response:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return json_response(err.body(), err.status, headers)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SERVICE].cfg.server.max_body_bytes
        return error_response(ApiError(413, f"request body too large (limit {limit} bytes, "
                                            f"server.max_body_bytes)", code="body_too_large"))
    except web.HTTPNotFound:
        return error_response(ApiError(404, f"no route {request.method} {request.path}",
                                       code="unknown_route"))
    except web.HTTPMethodNotAllowed as exc:
        return error_response(ApiError(405, f"{request.method} not allowed on {request.path} "
                                            f"(allowed: {', '.join(sorted(exc.allowed_methods))})",
                                       code="method_not_allowed"))
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal error (see the daemon log)",
                                       code="internal_error"))


class Auth:
    """API keys by SHA-256 digest -> tenant; every digest is compared, in constant time."""

    def __init__(self, keys: dict[str, str]):
        self.keys = [(bytes.fromhex(d), t) for d, t in keys.items()]

    def tenant(self, request: web.Request) -> str:
        if not self.keys:
            return "default"
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise ApiError(401, "missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        digest = hashlib.sha256(header[7:].strip().encode()).digest()
        found = None
        for known, tenant in self.keys:
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return found


async def _read_json(request: web.Request):
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"malformed JSON body: {exc}", None, "invalid_json") from None


class Completion:
    """One generation request in flight: tokens in, text and usage out."""

    def __init__(self, svc: "Service", req: GenerationRequest, tenant: str):
        self.svc = svc
        self.req = req
        self.tenant = tenant
        self.request_id = svc.next_request_id()
        self.created = int(time.time())
        self.trace = Trace(self.request_id, time.time())
        self.prompt: list[int] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.status = "error"
        self.error: str | None = None

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.req.endpoint == "chat" else "cmpl-") + self.request_id

    def prepare(self) -> None:
        svc, req = self.svc, self.req
        if req.model != svc.model_name:
            raise ApiError(404, f"model '{req.model}' does not exist (this appliance serves "
                                f"'{svc.model_name}')", "model", "model_not_found")
        tok = svc.tokenizer
        if req.endpoint == "chat":
            try:
                self.prompt = tok.encode_chat(req.messages)
            except ValueError as exc:
                raise bad(f"cannot apply the chat template: {exc}", "messages") from None
        elif req.prompt_ids is not None:
            if any(t < 0 or t >= tok.vocab_size for t in req.prompt_ids):
                raise bad(f"token ids must be within [0, {tok.vocab_size})", "prompt")
            self.prompt = list(req.prompt_ids)
        else:
            self.prompt = tok.encode(req.prompt_text)
        room = svc.max_context - len(self.prompt)
        if room < 1:
            raise bad(f"the prompt has {len(self.prompt)} tokens; this model's context is "
                      f"{svc.max_context}", "messages" if req.endpoint == "chat" else "prompt",
                      "context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise bad(f"max_tokens {req.max_tokens} + prompt {len(self.prompt)} tokens exceed "
                      f"this model's context of {svc.max_context}", "max_tokens",
                      "context_length_exceeded")
        self.max_tokens = req.max_tokens if req.max_tokens is not None else room

    async def run(self):
        """Yield (text delta, logprob entries) until the request finishes; sets
        finish_reason and counts. Entries are (token id, TokenLogprob) of the tokens
        behind the text, when the request asked for logprobs (else always empty)."""
        svc = self.svc
        detok = svc.tokenizer.stream()
        stops = StopMatcher(self.req.stop)
        # max_tokens 0 (echo only): the engine still runs the prompt, for its logprobs,
        # and the one token it samples is dropped.
        params = self.req.sampling(max(1, self.max_tokens))
        gen = svc.router.generate(self.trace, self.prompt, params)
        pending: list = []
        echoing = self.req.echo
        try:
            async for tokens, reason, lps in gen:
                if echoing:
                    echoing = False
                    yield self.prompt_text(), self.prompt_entries()
                    if self.max_tokens == 0:
                        self.finish_reason = "length"
                        return
                self.completion_tokens += len(tokens)
                if lps is None:
                    pieces = [(tokens, reason)]
                else:   # one token at a time: a stop string cuts the entries where it ends
                    pieces = [([t], reason if i == len(tokens) - 1 else None)
                              for i, t in enumerate(tokens)]
                    lps = iter(zip(tokens, lps))
                for ids, why in pieces:
                    if lps is not None:
                        pending.append(next(lps))
                    piece = detok.push(ids)
                    if why is not None:
                        piece += detok.flush()
                    text, hit = stops.feed(piece)
                    if hit:
                        self.finish_reason = "stop"
                        if text or pending:
                            yield text, pending
                        return
                    if why is not None:
                        self.finish_reason = why
                        text += stops.flush()
                    if text or (why is not None and pending):
                        yield text, pending
                        pending = []
                    if why is not None:
                        return
        finally:
            await gen.aclose()

    def prompt_text(self) -> str:
        req = self.req
        return req.prompt_text if req.prompt_text is not None else self.svc.tokenizer.decode(
            self.prompt)

    def prompt_entries(self) -> list:
        """(token id, TokenLogprob or None) for the echoed prompt, when logprobs were asked."""
        lps = self.trace.prompt_logprobs
        if self.req.logprobs is None or lps is None:
            return []
        return list(zip(self.prompt, lps))

    def logprob_entries(self, entries: list) -> list[dict]:
        """OpenAI chat shape: each token's own text, its bytes, logprob and alternatives.
        A token's text is decoded alone, so a piece of a multi-byte character shows as
        U+FFFD (with those bytes), as in vLLM."""
        decode = self.svc.tokenizer.decode

        def one(token: int, logprob: float) -> dict:
            text = decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        out = []
        for token, scored in entries:
            if scored is None:      # an echoed prompt's first token: nothing predicts it
                out.append({**one(token, None), "top_logprobs": None})
            else:
                lp, alts = scored
                out.append({**one(token, lp), "top_logprobs": [one(t, v) for t, v in alts]})
        return out

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """The legacy completions shape; text offsets count from the completion's start."""
        chat = self.logprob_entries(entries)
        offsets = []
        for e in chat:
            offsets.append(offset)
            offset += len(e["token"])
        return {"tokens": [e["token"] for e in chat],
                "token_logprobs": [e["logprob"] for e in chat],
                "top_logprobs": [None if e["top_logprobs"] is None else
                                 {a["token"]: a["logprob"] for a in e["top_logprobs"]}
                                 for e in chat],
                "text_offset": offsets}

    def logprobs(self, entries: list, offset: int = 0) -> dict | None:
        if self.req.logprobs is None:
            return None
        if self.req.endpoint == "chat":
            return {"content": self.logprob_entries(entries), "refusal": None}
        return self.completion_logprobs(entries, offset)

    def usage(self) -> dict:
        return usage(len(self.prompt), self.completion_tokens, self.trace.cached_tokens)

    def record(self) -> RequestRecord:
        t = self.trace
        return RequestRecord(
            request_id=self.request_id, tenant=self.tenant, model=self.svc.model_name,
            endpoint=self.req.endpoint, prompt_tokens=len(self.prompt),
            output_tokens=self.completion_tokens, cached_tokens=t.cached_tokens,
            arrival=t.arrival, first_token=t.first_token, finish=time.time(),
            prefill_worker=t.prefill_worker, decode_worker=t.decode_worker, status=self.status,
            finish_reason=self.finish_reason, error=self.error, simulated=self.svc.simulated)

    # ---- response shapes ---------------------------------------------------
    def chunk(self, text: str | None, finish: str | None, first: bool = False,
              logprobs: dict | None = None) -> bytes:
        if self.req.endpoint == "chat":
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "text_completion"
        return b"data: " + orjson.dumps({
            "id": self.object_id, "object": obj, "created": self.created,
            "model": self.svc.model_name, "choices": [choice],
            "simulated": self.svc.simulated}) + b"\n\n"

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.req.endpoint == "chat" else "text_completion"
        return b"data: " + orjson.dumps({
            "id": self.object_id, "object": obj, "created": self.created,
            "model": self.svc.model_name, "choices": [], "usage": self.usage(),
            "simulated": self.svc.simulated}) + b"\n\n"

    def full(self, text: str, entries: list) -> dict:
        logprobs = self.logprobs(entries)
        if self.req.endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {"id": self.object_id, "object": obj, "created": self.created,
                "model": self.svc.model_name, "choices": [choice], "usage": self.usage(),
                "system_fingerprint": self.svc.fingerprint, "simulated": self.svc.simulated}


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


async def generation(request: web.Request, endpoint: str) -> web.StreamResponse:
    svc: Service = request.app[SERVICE]
    tenant = svc.auth.tenant(request)
    req = parse_request(await _read_json(request), endpoint)
    comp = Completion(svc, req, tenant)
    headers = {"X-Request-Id": comp.request_id}
    try:
        comp.prepare()
    except ApiError as err:
        err.headers.update(headers)
        raise
    if svc.draining:
        raise ApiError(503, "the appliance is shutting down", code="draining",
                       headers={"Retry-After": RETRY_AFTER_S, **headers})
    if svc.inflight >= svc.max_inflight:
        comp.status = "rejected"
        svc.metrics.rejected()
        raise ApiError(503, f"overloaded: {svc.inflight} requests in flight", code="overloaded",
                       headers={"Retry-After": RETRY_AFTER_S, **headers})
    svc.inflight += 1
    try:
        if req.stream:
            return await _stream(request, comp, headers)
        return await _complete(comp, headers)
    except asyncio.CancelledError:
        comp.status = "aborted"
        comp.error = "client disconnected"
        raise
    finally:
        svc.inflight -= 1
        svc.finished(comp)


async def _complete(comp: Completion, headers: dict) -> web.Response:
    parts, entries = [], []
    try:
        async for text, lps in comp.run():
            parts.append(text)
            entries.extend(lps)
    except (NoWorker, WorkerGone, EngineError) as exc:
        comp.error = str(exc)
        err = _failure(exc)
        err.headers.update(headers)
        return error_response(err)
    comp.status = "ok"
    return json_response(comp.full("".join(parts), entries), headers=headers)


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
        out = comp.chunk("", None, first=True) if comp.req.endpoint == "chat" else b""
        sent = 0        # characters of text so far (completions' text_offset)
        item = first
        while item is not None:
            text, lps = item
            out += comp.chunk(text, None, logprobs=comp.logprobs(lps, sent))
            sent += len(text)
            await resp.write(out)
            out = b""
            item = await anext(gen, None)
        if out:
            await resp.write(out)
        tail = comp.chunk(None if comp.req.endpoint == "chat" else "", comp.finish_reason)
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
        "simulated": svc.simulated}]})


async def health(request: web.Request):
    svc: Service = request.app[SERVICE]
    return json_response({"status": "ok", "simulated": svc.simulated})


async def ready(request: web.Request):
    svc: Service = request.app[SERVICE]
    if svc.draining:
        raise ApiError(503, "the appliance is shutting down", code="draining")
    if not svc.router.ready():
        raise ApiError(503, "workers are not ready", code="no_worker",
                       headers={"Retry-After": RETRY_AFTER_S})
    return json_response({"status": "ready", "simulated": svc.simulated})


async def admin_status(request: web.Request):
    svc: Service = request.app[SERVICE]
    return json_response(svc.status())


async def metrics(request: web.Request):
    svc: Service = request.app[SERVICE]
    body, content_type = svc.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def build_app(svc: "Service", max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors_as_json])
    app[SERVICE] = svc
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/admin/status", admin_status)
    app.router.add_get("/metrics", metrics)
    return app
