"""HTTP failures that happen before any handler runs, answered in OpenAI's JSON shape.

aiohttp's parser rejects an oversized request line or header, or bytes that are not
HTTP, inside `RequestHandler.data_received`, before routing or middlewares; its
`handle_error` then answers in plain text that echoes the offending input and logs a
traceback. This protocol overrides `handle_error` only: the same status decisions, but
a JSON body that names the limit and never the input, an `X-Request-Id`, and one log line.

The request line and a header field get different size limits so that aiohttp's
`LineTooLong` (which carries the limit it hit) tells a long URL (414) from a long header
(431); both of its parsers (C and pure Python) raise it the same way.
"""
from __future__ import annotations

import logging
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler

from appliance.daemon.openai_protocol import ApiError
from appliance.daemon.responses import json_response

log = logging.getLogger("applianced.http")

MAX_REQUEST_LINE = 8190       # bytes of "METHOD /path?query HTTP/1.1" (aiohttp's default)
MAX_HEADER_FIELD = 16384      # bytes of one header line (bearer tokens can be long)


def protocol_error(exc: BaseException | None, status: int, line_limit: int,
                   field_limit: int) -> ApiError:
    """The JSON error for a failure aiohttp reports to `handle_error`."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == line_limit:
            return ApiError(414, f"request line too long (limit {line_limit} bytes)",
                            code="uri_too_long")
        return ApiError(431, f"request header too large (limit {field_limit} bytes per "
                             f"header line)", code="header_too_large")
    if isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower():
        return ApiError(431, "too many request headers", code="header_too_large")
    if isinstance(exc, BadHttpMessage) or 400 <= status < 500:
        # The parser's own message quotes the input; say only what kind of failure it was.
        return ApiError(400, f"malformed HTTP request ({type(exc).__name__ if exc else status})",
                        code="bad_http_request")
    if status == 504:
        return ApiError(504, "request timed out", code="timeout", type_="server_error")
    return ApiError(500, "internal error (see the daemon log)", code="internal_error")


class JsonErrorProtocol(RequestHandler):
    """aiohttp's connection handler with JSON error answers (see the module docstring)."""

    def __init__(self, manager, *, new_request_id: Callable[[], str], **kwargs):
        super().__init__(manager, **kwargs)
        self.new_request_id = new_request_id

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:    # as aiohttp: a response is already under way
            raise ConnectionError("response already started; cannot send an error")
        err = protocol_error(exc, status, self.max_line_size, self.max_field_size)
        rid = self.new_request_id()
        if err.status >= 500:
            log.error("request %s from %s failed: %s", rid, request.remote, err.message,
                      exc_info=exc)
        elif isinstance(exc, BadHttpMethod):  # not HTTP at all (TLS, scanners): one quiet line
            log.info("request %s from %s: %s", rid, request.remote, err.message)
        else:
            log.warning("request %s from %s: %d %s", rid, request.remote, err.status, err.message)
        resp = json_response(err.body(), err.status, {"X-Request-Id": rid} if rid else None)
        resp.force_close()
        return resp


class _Server(web.Server):
    """aiohttp's Server, making `JsonErrorProtocol`s (only `__call__` differs)."""

    new_request_id: Callable[[], str]

    def __call__(self) -> RequestHandler:
        return JsonErrorProtocol(self, loop=self._loop, new_request_id=self.new_request_id,
                                 **self._kwargs)


class ApplianceRunner(web.AppRunner):
    """An AppRunner whose connections answer parser-level failures in JSON."""

    def __init__(self, app: web.Application, new_request_id: Callable[[], str], **kwargs):
        kwargs.setdefault("max_line_size", MAX_REQUEST_LINE)
        kwargs.setdefault("max_field_size", MAX_HEADER_FIELD)
        super().__init__(app, **kwargs)
        self._new_request_id = new_request_id

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        server.new_request_id = self._new_request_id
        return server
