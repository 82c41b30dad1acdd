"""Exceptions -> OpenAI-shaped error JSON and HTTP status.

Every error a client sees has the shape `{"error": {"message", "type", "param", "code"}}`;
FastAPI's `{"detail": ...}` body never leaves the server. Deterministic failures carry
`x-should-retry: false` so the openai SDK does not retry them.

Engine failures while generating: an `EngineFault` (a CUDA runtime error; the engine is down,
/health answers 503) is 503 `service_unavailable_error` / `engine_down`. An `OutOfMemory` (the
device ran out of memory in this request; the engine freed it and goes on serving, /health stays
200) is 500 `server_error` / `out_of_memory` with `x-should-retry: false`: the same request would
run out again, so the message says what to shorten or change. Before the first byte these are the
HTTP status and body; once a stream has begun, the same body is one `data: {"error": ...}` event.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import ContextLengthError, EngineFault, OutOfMemory, StructuredOutputError

log = logging.getLogger("specexec.server")


class APIError(Exception):
    """An error to send to the client as-is (before the first byte of a response)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        retry: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.retry = retry

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if not self.retry:
            headers["x-should-retry"] = "false"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def context_length_error(exc: ContextLengthError, param: str) -> APIError:
    return APIError(400, str(exc), param=param, code="context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def authentication_error() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key. Send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def queue_full(retry_after: int) -> APIError:
    return APIError(
        429,
        "The server is busy: the request queue is full. Retry later.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
        retry=True,
    )


def loading() -> APIError:
    return APIError(
        503,
        "The model is still loading.",
        type="service_unavailable_error",
        code="model_loading",
        headers={"Retry-After": "5"},
        retry=True,
    )


def engine_down(reason: str) -> APIError:
    return APIError(503, f"The engine is unavailable: {reason}", type="service_unavailable_error", code="engine_down")


def shutting_down() -> APIError:
    """A request refused, or cut off, because the server is shutting down (SIGTERM/SIGINT)."""
    return APIError(503, "The server is shutting down. Retry against a running server.",
                    type="service_unavailable_error", code="server_shutting_down", retry=True)


def forbidden_host(host: str) -> APIError:
    return APIError(403, f"The Host header {host!r} is not allowed: this server answers only to loopback names "
                    "(localhost, 127.0.0.1, [::1]) unless started with --allowed-hosts.",
                    type="permission_error", param="host", code="host_not_allowed")


def unsupported_media_type(content_type: str | None) -> APIError:
    got = f"got {content_type!r}" if content_type else "got none"
    return APIError(415, f"Request bodies must be JSON: send `Content-Type: application/json` ({got}).",
                    param="content-type", code="unsupported_media_type")


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {max_bytes} bytes "
                    "(--max-body-mb).", code="request_too_large")


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body stalled: no data for {seconds:g} seconds (--read-timeout).",
                    code="request_timeout")


def client_closed() -> APIError:
    """The client closed the connection before its request was read (nginx's 499); nobody reads it."""
    return APIError(499, "The client closed the connection while sending its request.", code="client_closed")


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"Internal error while generating: {type(exc).__name__}: {exc}", type="server_error",
                    code="internal_error")


def out_of_memory(exc: OutOfMemory) -> APIError:
    return APIError(500, str(exc), type="server_error", code="out_of_memory")


def generation_error(exc: BaseException) -> APIError:
    """What a request that failed while generating reports, streamed or not."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineFault):
        return engine_down(str(exc))
    if isinstance(exc, OutOfMemory):
        return out_of_memory(exc)
    if isinstance(exc, StructuredOutputError):  # the request's grammar: its own 400, the others go on
        return invalid_request(f"Invalid structured output: {exc}.", None, "invalid_value")
    return internal_error(exc)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    return invalid_request(f"Invalid value for '{param}': {first.get('msg', 'invalid request')}", param).response()


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})).response()


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
