"""Server-sent events (sse-starlette): deltas -> OpenAI chunks, usage chunk, [DONE], pings.

Stream invariants (docs/api.md): one id/created/model throughout; for chat, the role
chunk first; content chunks carry only `delta.content` (or `delta.reasoning_content`, or `delta.tool_calls`); the last choice chunk has
`delta: {}` and the `finish_reason` (plus our `timings`); with `include_usage`, exactly one
`{"choices": [], "usage": ...}` chunk before `data: [DONE]`. With `n` > 1 each choice has its
own role and finish chunks, every chunk tagged with its choice's `index`; usage and [DONE] come
once. Errors after the first byte are one `data: {"error": ...}` event, then `[DONE]`. A client
disconnect aborts every choice's engine request (close handler, and the generator's cleanup when
it is cancelled).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Message

from engine.async_engine import AsyncEngine
from server.choices import merge_streams
from server.errors import generation_error
from server.generation import Generation, choices_usage
from server.responses import Envelope
from server.trace import traced_chunks

log = logging.getLogger("specexec.server")

SEP = "\n"


def dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep=SEP)


async def choice_chunks(gen: Generation, env: Envelope, index: int) -> AsyncIterator[dict[str, Any]]:
    """One choice's chunks: (chat) the role chunk, content chunks, the finish chunk. Each chunk
    carries the logprobs of the tokens consumed since the previous one, when they were asked for."""
    if env.chat:
        yield env.chunk("", role=True, index=index)
    async for piece in gen.pieces():
        if gen.tools is None and gen.reasoning is None:
            yield env.chunk(piece, index=index, logprobs=gen.take_logprobs())
            continue
        # reasoning, content and tool-call deltas (server/reasoning.py, server/toolcalls/output.py)
        for delta in gen.deltas(piece):
            yield env.chunk(delta.content, index=index, logprobs=gen.take_logprobs(), tool_calls=delta.tool_calls,
                            reasoning=delta.reasoning)
    for delta in gen.finish_deltas():
        yield env.chunk(delta.content, index=index, logprobs=gen.take_logprobs(), tool_calls=delta.tool_calls,
                        reasoning=delta.reasoning)
    assert gen.finish_reason is not None
    reason = gen.finish_reason if gen.tools is None else gen.tools.finish_reason(gen.finish_reason)
    yield env.chunk(None, reason, timings=gen.timings(), index=index,
                    logprobs=gen.take_logprobs(empty_as_none=True))


async def chunk_events(gens: list[Generation], env: Envelope, include_usage: bool) -> AsyncIterator[str]:
    """The `data:` payloads of one stream (every choice's chunks, merged), ending with [DONE]."""
    merged = merge_streams([traced_chunks(gen.trace, gen.text, choice_chunks(gen, env, i)) for i, gen in enumerate(gens)])
    try:
        async for chunk in merged:
            yield dumps(chunk)
        if include_usage:
            yield dumps(env.usage_chunk(choices_usage(gens)))
    except Exception as exc:  # streaming has begun: report in-band (as a 200 would not), then end the stream
        error = generation_error(exc)
        if error.status == 500:
            log.exception("request %s failed while streaming", env.id)
        yield dumps(error.body())
    finally:
        for gen in gens:
            gen.cancel()  # no-op for a finished choice; frees one that never started or was cut off
        await merged.aclose()
    yield "[DONE]"


def stream_response(gens: list[Generation], env: Envelope, async_engine: AsyncEngine, include_usage: bool,
                    ping_seconds: float) -> EventSourceResponse:
    async def on_close(message: Message) -> None:
        for gen in gens:
            async_engine.abort(gen.request_id)

    return EventSourceResponse(
        chunk_events(gens, env, include_usage),
        sep=SEP,
        ping=ping_seconds,
        ping_message_factory=_ping,
        client_close_handler_callable=on_close,
        headers={"x-request-id": env.id},
    )
