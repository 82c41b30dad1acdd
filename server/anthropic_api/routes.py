"""The Messages API endpoints: `POST /v1/messages` (streamed and not) and `POST /v1/messages/count_tokens`.

A message runs as the chat request it maps to (server/anthropic_api/request.py), through the same
prompt, tool plan, grammar and engine path as /v1/chat/completions (`start_generations`); its output is
read into content blocks (server/anthropic_api/output.py). Streamed: SSE events `event: <type>` /
`data: {"type", ...}`: `message_start`, `ping`, per block `content_block_start`, `content_block_delta`...,
`content_block_stop`, then `message_delta` (`stop_reason`, `stop_sequence`, usage) and `message_stop`;
`ping` events keep a slow connection open; a failure after the stream began is one `error` event.
`stop_reason`: `end_turn`, `max_tokens` (max_tokens, or the context, ran out), `stop_sequence` (with
`stop_sequence`), `tool_use`.

Errors, also those of the API key and content-type checks, have Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` with the status the OpenAI routes would give.
`anthropic-version` and `anthropic-beta` headers and `?beta=true` are accepted and change nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.anthropic_api.output import ContentBlocks, MessageHead, stop_reason, usage
from server.anthropic_api.request import chat_request, parse_messages
from server.error_shapes import shaped_route
from server.errors import APIError, generation_error
from server.generation import Generation, collect_texts
from server.limits import read_body
from server.security import require_json
from server.start import start_generations
from server.state import ServerState

log = logging.getLogger("specexec.server")

ENDPOINT = "messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def messages_router() -> APIRouter:
    """The routes, to be included under /v1 (behind its API key check)."""
    router = APIRouter(route_class=shaped_route(error_body, ENDPOINT))
    json_body = [Depends(require_json)]
    router.add_api_route("/messages", create_message, methods=["POST"], dependencies=json_body)
    router.add_api_route("/messages/count_tokens", count_tokens, methods=["POST"], dependencies=json_body)
    return router


async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.specexec
    config = state.server_config
    raw = await read_body(request, config.max_body_bytes, config.read_timeout)
    lane = state.preparation.lane(len(raw))  # the server's own threads for bodies of this size
    req = await lane.run(parse_messages, raw)
    chat = await lane.run(chat_request, req)
    gens, _ = await start_generations(state, chat, True, ENDPOINT, lane)
    gen = gens[0]
    head = MessageHead(state.response_model(req.model))
    if req.stream:
        async def on_close(message: Any) -> None:
            gen.cancel()

        return EventSourceResponse(_events(gen, head), sep="\n", ping=config.ping_seconds,
                                   ping_message_factory=lambda: _event("ping", {}),
                                   client_close_handler_callable=on_close, headers={"request-id": head.id})
    texts = await collect_texts(request, gens, head.id)
    if texts is None:
        return Response(status_code=499)
    blocks = ContentBlocks()
    for delta in gen.deltas(texts[0]) + gen.finish_deltas():
        blocks.feed(delta)
    blocks.close()
    body = head.body(blocks.blocks, stop_reason(gen), usage(gen)) | {"timings": gen.timings()}
    return JSONResponse(body, headers={"request-id": head.id})


async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's tokens as /v1/messages would template them (tools included), without generating."""
    state: ServerState = request.app.state.specexec
    config = state.server_config
    raw = await read_body(request, config.max_body_bytes, config.read_timeout)
    lane = state.preparation.lane(len(raw))
    req = await lane.run(parse_messages, raw)
    chat = await lane.run(chat_request, req)
    _, prompt = state.require_ready()
    state.check_model(chat.model)
    prompt_ids = await lane.run(prompt.prompt_ids, chat, prompt.tool_plan(chat))
    return {"input_tokens": len(prompt_ids)}


def _event(kind: str, fields: dict[str, Any]) -> ServerSentEvent:
    data = json.dumps({"type": kind} | fields, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data, event=kind, sep="\n")


async def _events(gen: Generation, head: MessageHead) -> AsyncIterator[ServerSentEvent]:
    # the prefix cache's share of the prompt is known at the end: message_delta's usage has it
    start_usage = {"input_tokens": gen.prompt_tokens, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0, "output_tokens": 0}
    yield _event("message_start", {"message": head.body([], (None, None), start_usage)})
    yield _event("ping", {})
    blocks = ContentBlocks()
    try:
        async for piece in gen.pieces():
            for delta in gen.deltas(piece):
                for kind, fields in blocks.feed(delta):
                    yield _event(kind, fields)
        for delta in gen.finish_deltas():
            for kind, fields in blocks.feed(delta):
                yield _event(kind, fields)
        for kind, fields in blocks.close():
            yield _event(kind, fields)
        reason, sequence = stop_reason(gen)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage(gen)})
        yield _event("message_stop", {})
    except Exception as exc:  # the stream has begun: the failure is reported in-band
        error = generation_error(exc)
        if error.status == 500:
            log.exception("message %s failed while streaming", head.id)
        yield _event("error", {"error": error_body(error)["error"]})
    finally:
        gen.cancel()
