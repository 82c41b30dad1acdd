"""Server-sent events (sse-starlette): deltas -> OpenAI chunks, usage chunk, [DONE], pings.

Stream invariants (docs/api.md): one id/created/model throughout; for chat, the role
chunk first; content chunks carry only `delta.content`; the last choice chunk has
`delta: {}` and the `finish_reason` (plus our `timings`); with `include_usage`, exactly one
`{"choices": [], "usage": ...}` chunk before `data: [DONE]`. Errors after the first byte
are one `data: {"error": ...}` event, then `[DONE]`. A client disconnect aborts the engine
request (close handler, and the generator's cleanup when it is cancelled).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Message

from engine.async_engine import AsyncEngine
from server.errors import generation_error
from server.generation import Generation
from server.responses import Envelope

log = logging.getLogger("specexec.server")

SEP = "\n"


def dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep=SEP)


async def chunk_events(gen: Generation, env: Envelope, include_usage: bool) -> AsyncIterator[str]:
    """The `data:` payloads of one stream, ending with [DONE]."""
    try:
        if env.chat:
            yield dumps(env.chunk("", role=True))
        async for piece in gen.pieces():
            yield dumps(env.chunk(piece))
        assert gen.finish_reason is not None
        yield dumps(env.chunk(None, gen.finish_reason, timings=gen.timings()))
        if include_usage:
            yield dumps(env.usage_chunk(gen.usage()))
    except Exception as exc:  # streaming has begun: report in-band (as a 200 would not), then end the stream
        error = generation_error(exc)
        if error.status == 500:
            log.exception("request %s failed while streaming", gen.request_id)
        yield dumps(error.body())
    yield "[DONE]"


def stream_response(gen: Generation, env: Envelope, async_engine: AsyncEngine, include_usage: bool,
                    ping_seconds: float) -> EventSourceResponse:
    async def on_close(message: Message) -> None:
        async_engine.abort(gen.request_id)

    return EventSourceResponse(
        chunk_events(gen, env, include_usage),
        sep=SEP,
        ping=ping_seconds,
        ping_message_factory=_ping,
        client_close_handler_callable=on_close,
        headers={"x-request-id": env.id},
    )
