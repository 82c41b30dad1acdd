"""The /v1/responses endpoints: create (streamed and not), retrieve, delete, list input items.

A create runs as the chat request it maps to (server/responses_api/request.py), through the same
prompt, tool plan, grammar and engine path as /v1/chat/completions (`start_generations`), and its
output is read into output items (server/responses_api/output.py). Streamed: SSE events
`event: <type>` / `data: {"type", "sequence_number", ...}`: `response.created`,
`response.in_progress`, the item events, then `response.completed` (or `response.incomplete`
when max_output_tokens or the context ran out; `response.failed` when generation failed after the
stream began). No `[DONE]`, as OpenAI's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.errors import APIError, generation_error, invalid_request
from server.generation import Generation, collect_texts
from server.json_pieces import dumps_in_pieces
from server.limits import read_body
from server.protocol import ChatCompletionRequest
from server.responses_api.namespaces import flatten
from server.responses_api.output import CallNames, OutputItems, ResponseHead, new_id, response_fields, usage
from server.responses_api.request import (
    ResponsesRequest,
    chat_request,
    custom_tool_names,
    input_items,
    parse_responses,
)
from server.responses_api.store import (
    MAX_ITEMS,
    MAX_STORED,
    MAX_STORED_BYTES,
    PendingResponse,
    ResponseStore,
    StoredResponse,
    stored_items,
)
from server.start import start_generations
from server.state import ServerState

ENDPOINT = "responses"


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.specexec
    try:
        return await _create(request, state)
    except APIError as exc:
        state.metrics.rejected.labels(ENDPOINT, str(exc.status)).inc()
        raise


async def _create(request: Request, state: ServerState) -> Response:
    config = state.server_config
    raw = await read_body(request, config.max_body_bytes, config.read_timeout)
    lane = state.preparation.lane(len(raw))  # the server's own threads for bodies of this size
    req = await lane.run(parse_responses, raw)
    store = _store(request)
    history: list[dict[str, Any]] = []
    history_bytes = 0
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history, history_bytes = previous.conversation, previous.conversation_bytes
    own = [_with_id(item) for item in input_items(req)]
    _check_conversation(len(history), len(own))
    # what the stored items bring counts toward the lane as the body does (server/preparation.py)
    lane = state.preparation.lane(len(raw) + history_bytes + store.item_bytes(own))
    chat, pending, names = await lane.run(_prepare, req, history, history_bytes, own, len(raw), store)
    gens, _ = await start_generations(state, chat, True, ENDPOINT, lane)
    gen = gens[0]
    head = ResponseHead(state.response_model(req.model), response_fields(req, list(req.tools or [])))
    saved = (store, pending) if pending is not None else None
    if req.stream:
        async def on_close(message: Any) -> None:
            gen.cancel()

        events = _events(gen, head, saved, names)
        return EventSourceResponse(events, sep="\n", ping=config.ping_seconds,
                                   ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"),
                                   client_close_handler_callable=on_close, headers={"x-request-id": head.id})
    texts = await collect_texts(request, gens, head.id)
    if texts is None:
        return Response(status_code=499)
    items = OutputItems(names)
    for delta in gen.deltas(texts[0]) + gen.finish_deltas():
        items.feed(delta)
    incomplete = _incomplete(gen)
    items.close("incomplete" if incomplete else "completed")
    body = _final(head, gen, items, incomplete)
    _save(saved, body)
    content = await state.preparation.render.run(dumps_in_pieces, body)  # off the event loop, in pieces
    return Response(content, media_type="application/json", headers={"x-request-id": head.id})


def _incomplete(gen: Generation) -> bool:
    assert gen.finish_reason is not None
    reason = gen.finish_reason if gen.tools is None else gen.tools.finish_reason(gen.finish_reason)
    return reason == "length"


def _final(head: ResponseHead, gen: Generation, items: OutputItems, incomplete: bool) -> dict[str, Any]:
    cached = gen.totals.cached_tokens if gen.totals is not None else 0
    counts = usage(gen.prompt_tokens, gen.completion_tokens, cached, gen.num_reasoning_tokens or 0)
    return head.body("incomplete" if incomplete else "completed", items.items, counts, incomplete=incomplete,
                     timings=gen.timings())


def _check_conversation(num_history: int, num_input: int) -> None:
    if num_history + num_input > MAX_ITEMS:
        raise invalid_request(f"The conversation would hold {num_history + num_input} items ({num_history} from "
                              f"previous_response_id, {num_input} in input), more than {MAX_ITEMS}: start a new one.",
                              "previous_response_id", "invalid_value")


def _prepare(req: ResponsesRequest, history: list[dict[str, Any]], history_bytes: int, own: list[dict[str, Any]],
             body_bytes: int, store: ResponseStore
             ) -> tuple[ChatCompletionRequest, PendingResponse | None, CallNames]:
    """The chat request (in a preparation lane: item_reference lookups and the conversation's messages),
    with `store` what the response will keep, and how the model's calls of the tools offered become items."""
    tools, members = flatten(req.offered_tools(history + own))  # a namespace's tools under qualified names
    chat = chat_request(req, history + own, store.item, tools)
    names = CallNames(custom_tool_names(tools), members)
    if req.store is False:
        return chat, None, names
    kept, kept_bytes = stored_items(own)
    return chat, PendingResponse(history, history_bytes, kept, kept_bytes, body_bytes), names


def _save(saved: tuple[ResponseStore, PendingResponse] | None, body: dict[str, Any]) -> None:
    if saved is not None:
        store, pending = saved
        store.put(pending.stored(body))


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item with an id (for item_reference and the input_items list)."""
    if "id" in item or item.get("type") == "item_reference":
        return item
    prefix = {"function_call": "fc", "function_call_output": "fco", "custom_tool_call": "ctc",
              "custom_tool_call_output": "ctco", "reasoning": "rs", "local_shell_call": "lsh",
              "additional_tools": "at", "agent_message": "amsg"}.get(item.get("type", "message"), "msg")
    return {"id": new_id(prefix), "type": "message"} | item


async def _events(gen: Generation, head: ResponseHead, saved: tuple[ResponseStore, PendingResponse] | None,
                  names: CallNames) -> AsyncIterator[ServerSentEvent]:
    numbers = itertools.count()

    def event(kind: str, fields: dict[str, Any]) -> ServerSentEvent:
        payload = {"type": kind, "sequence_number": next(numbers)} | fields
        return ServerSentEvent(json.dumps(payload, ensure_ascii=False, separators=(",", ":")), event=kind, sep="\n")

    yield event("response.created", {"response": head.body("in_progress", [])})
    yield event("response.in_progress", {"response": head.body("in_progress", [])})
    items = OutputItems(names)
    try:
        async for piece in gen.pieces():
            for delta in gen.deltas(piece):
                for kind, fields in items.feed(delta):
                    yield event(kind, fields)
        for delta in gen.finish_deltas():
            for kind, fields in items.feed(delta):
                yield event(kind, fields)
        incomplete = _incomplete(gen)
        for kind, fields in items.close("incomplete" if incomplete else "completed"):
            yield event(kind, fields)
        body = _final(head, gen, items, incomplete)
        _save(saved, body)
        yield event("response.incomplete" if incomplete else "response.completed", {"response": body})
    except Exception as exc:  # the stream has begun: the failure is the response's
        error = generation_error(exc)
        failed = head.body("failed", items.items, error={"code": error.code or "server_error", "message": error.message})
        yield event("response.failed", {"response": failed})
    finally:
        gen.cancel()


async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(request, response_id).response


async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not _store(request).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def list_input_items(response_id: str, request: Request) -> dict[str, Any]:
    items = _stored(request, response_id).input
    return {"object": "list", "data": items, "first_id": items[0].get("id") if items else None,
            "last_id": items[-1].get("id") if items else None, "has_more": False}


def _stored(request: Request, response_id: str) -> StoredResponse:
    stored = _store(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (responses with store not false are kept in "
                         f"memory, the last {MAX_STORED} or {MAX_STORED_BYTES // 2**20} MiB).", param="response_id",
                    code="not_found")
