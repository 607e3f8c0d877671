"""The one error type of the API: an HTTP status and OpenAI's error body fields.

Its own module so that every request parser (the OpenAI protocol, structured outputs,
tool calls) raises it without importing each other.
"""
from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _default_type(status)
        self.headers = headers or {}

    def __reduce__(self):       # crosses the prepare pool's process boundary whole
        return (ApiError, (self.status, self.message, self.param, self.code, self.type,
                           self.headers))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _default_type(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)
