"""Errors in each API's own shape, for the routers whose clients expect another error body than OpenAI's
(Anthropic Messages: server/anthropic_api/, the Ollama API: server/ollama_api/).

`shaped_route(render, endpoint)` is an APIRoute class: every error its routes raise, in the handler or
in a dependency (the API key, the JSON content type), is rendered by `render` with the same status and
headers (`Retry-After`, `x-should-retry`) the OpenAI-shaped error would have; an unexpected exception
is logged and answered as a 500 in the same shape. Errors raised before routing (the Host check, a
shutdown's 503: server/security.py, server/shutdown.py) keep the OpenAI shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import APIError, internal_error, invalid_request

log = logging.getLogger("specexec.server")

Render = Callable[[APIError], dict[str, Any]]  # an error -> the API's error body


def shaped_response(error: APIError, render: Render) -> JSONResponse:
    headers = dict(error.headers)
    if not error.retry:
        headers["x-should-retry"] = "false"
    return JSONResponse(render(error), status_code=error.status, headers=headers)


def as_api_error(exc: Exception, request: Request) -> APIError:
    """Whatever a route raised, as the APIError the client gets (an unexpected one logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")) or None
        return invalid_request(f"Invalid value for '{param}': {first.get('msg', 'invalid request')}", param)
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        headers=dict(exc.headers or {}))
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error(exc)


def shaped_route(render: Render, endpoint: str) -> type[APIRoute]:
    """An APIRoute class whose errors are rendered by `render` (and counted as rejected under `endpoint`)."""

    class ShapedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def shaped(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:
                    error = as_api_error(exc, request)
                request.app.state.specexec.metrics.rejected.labels(endpoint, str(error.status)).inc()
                return shaped_response(error, render)

            return shaped

    return ShapedRoute
