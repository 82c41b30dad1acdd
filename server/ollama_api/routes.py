"""The Ollama API endpoints: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`, and clear refusals for what a one-model server does not do.

A chat or generate request runs as the chat or completion request it maps to
(server/ollama_api/request.py), through the same prompt, tool plan, grammar and engine path as
/v1/chat/completions and /v1/completions (`start_generations`). Streamed (the default): NDJSON, one
object per line (`application/x-ndjson`): `{"model", "created_at", "message": {"role": "assistant",
"content": piece}, "done": false}` (generate: `"response": piece`), a tool call as one whole object in
`message.tool_calls` (`{"id", "function": {"index", "name", "arguments": {...}}}`), then the final
object with `"done": true`, `done_reason` (`stop` or `length`), `total_duration`, `load_duration` (0:
the model is loaded at start), `prompt_eval_count`, `prompt_eval_duration`, `eval_count`,
`eval_duration` (durations in nanoseconds). `"stream": false`: the final object with the whole
`message` (`response`). A chat without messages, or a generate without prompt and suffix, answers at
once with `done_reason: "load"` (the model is always loaded).

Errors, also those of the API key and content-type checks, have Ollama's shape `{"error": "..."}`
with the status the OpenAI routes would give; after a stream began, one `{"error": "..."}` line ends it.
`/api/pull` of the served model answers success (nothing to download); other models, `/api/push`,
`/api/create`, `/api/copy`, `/api/delete`, `/api/embed`, `/api/embeddings` and `/api/blobs` are 400s
that say how the model is chosen here; any other `/api/...` path is a 404.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.error_shapes import shaped_route
from server.errors import APIError, generation_error, invalid_request
from server.generation import Generation, collect_texts
from server.json_body import load_json_object
from server.limits import read_body
from server.ollama_api.models import OLLAMA_VERSION, ollama_name, running, served_id, show, tags
from server.ollama_api.request import (
    ChatRequest,
    GenerateRequest,
    chat_request,
    generate_request,
    parse_ollama,
)
from server.security import require_json
from server.start import start_generations
from server.state import ServerState
from server.toolcalls.output import Delta, collect

log = logging.getLogger("specexec.server")

ENDPOINT = "ollama"
NDJSON = "application/x-ndjson"
NOT_HERE = ("this server serves one model, chosen when it starts (specexec serve --target/--config, "
            "--served-model-name); it does not {what}")


def error_body(error: APIError) -> dict[str, Any]:
    return {"error": error.message}


def ollama_router() -> APIRouter:
    router = APIRouter(prefix="/api", route_class=shaped_route(error_body, ENDPOINT))
    json_body = [Depends(require_json)]
    router.add_api_route("/version", version, methods=["GET"])
    router.add_api_route("/tags", list_tags, methods=["GET"])
    router.add_api_route("/ps", list_running, methods=["GET"])
    router.add_api_route("/show", show_model, methods=["POST"], dependencies=json_body)
    router.add_api_route("/chat", chat, methods=["POST"], dependencies=json_body)
    router.add_api_route("/generate", generate, methods=["POST"], dependencies=json_body)
    router.add_api_route("/pull", pull, methods=["POST"], dependencies=json_body)
    for path, what in (("/push", "push models"), ("/create", "create models"), ("/copy", "copy models"),
                       ("/delete", "delete models"), ("/embed", "compute embeddings"),
                       ("/embeddings", "compute embeddings"), ("/blobs/{digest}", "store blobs")):
        router.add_api_route(path, _refusal(what), methods=["POST", "DELETE", "HEAD"])
    router.add_api_route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"])
    return router


def _state(request: Request) -> ServerState:
    return request.app.state.specexec


def created_at() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


async def list_tags(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.require_ready()
    return tags(state)


async def list_running(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.require_ready()
    return running(state)


async def _body(request: Request) -> dict[str, Any]:
    config = _state(request).server_config
    return load_json_object(await read_body(request, config.max_body_bytes, config.read_timeout))


async def show_model(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = await _body(request)
    name = body.get("model") or body.get("name")  # `name`: older clients
    if not isinstance(name, str) or not name:
        raise invalid_request("missing required field 'model'", "model", "missing_required_parameter")
    state.require_ready()
    return show(state, served_id(state, name) or state.model_name)


async def pull(request: Request) -> Response:
    state = _state(request)
    body = await _body(request)
    name = body.get("model") or body.get("name")
    state.require_ready()
    if not isinstance(name, str) or not name:
        raise invalid_request("missing required field 'model'", "model", "missing_required_parameter")
    try:
        served_id(state, name)
    except APIError as exc:
        raise APIError(404, f"{exc.message}; {NOT_HERE.format(what='download models')}", param="model",
                       code="model_not_found") from None
    if body.get("stream") is False:
        return JSONResponse({"status": "success"})
    return Response(json.dumps({"status": "success"}) + "\n", media_type=NDJSON)


def _refusal(what: str) -> Any:
    async def refuse(request: Request) -> Response:
        raise APIError(400, NOT_HERE.format(what=what), code="unsupported")

    return refuse


async def not_found(path: str, request: Request) -> Response:
    raise APIError(404, f"{request.method} /api/{path}: not an Ollama API endpoint served here", code="not_found")


async def chat(request: Request) -> Response:
    return await _generate(request, chat=True)


async def generate(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, chat: bool) -> Response:
    started = time.monotonic_ns()
    state = _state(request)
    config = state.server_config
    raw = await read_body(request, config.max_body_bytes, config.read_timeout)
    lane = state.preparation.lane(len(raw))
    req = await lane.run(parse_ollama, raw, ChatRequest if chat else GenerateRequest)
    _, prompt = state.require_ready()
    model_id = served_id(state, req.model)
    name = req.model or ollama_name(state.model_name)
    if (chat and not req.messages) or (not chat and not req.prompt and not req.suffix):
        return JSONResponse(_head(name) | _empty(chat) | {"done": True, "done_reason": "load"})
    convert = chat_request if chat else generate_request
    inner = await lane.run(convert, req, prompt.max_context)
    inner = inner.model_copy(update={"model": model_id})
    gens, _ = await start_generations(state, inner, chat, ENDPOINT, lane)  # stream false: whole tool calls
    gen = gens[0]
    think = req.think is not False  # false: reasoning the model writes anyway is dropped
    if req.stream is not False:
        return StreamingResponse(_lines(gen, name, chat, started, think), media_type=NDJSON)
    texts = await collect_texts(request, gens, gen.request_id)
    if texts is None:
        return Response(status_code=499)
    thinking, content, calls = _split(gen.deltas(texts[0]) + gen.finish_deltas(), think)
    return JSONResponse(_head(name) | _payload(chat, content, calls, thinking) | _final(gen, started))


def _head(name: str) -> dict[str, Any]:
    return {"model": name, "created_at": created_at()}


def _empty(chat: bool) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}


def _payload(chat: bool, content: str, calls: list[dict[str, Any]], thinking: str = "") -> dict[str, Any]:
    if not chat:
        return {"response": content} | ({"thinking": thinking} if thinking else {})
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:  # the reply's reasoning block (server/reasoning.py)
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


def _split(deltas: list[Delta], think: bool = True) -> tuple[str, str, list[dict[str, Any]]]:
    """Deltas -> (thinking, "" when not `think`; content; whole tool calls). Read with eager=False, a call's
    entries (its start and its arguments) come in the same batch."""
    reasoning, content, calls = collect(deltas)
    thinking = (reasoning or "") if think else ""
    return thinking, content, [{"id": call["id"], "function": {"index": index, "name": call["function"]["name"],
                                                              "arguments": json.loads(call["function"]["arguments"] or "{}")}}
                               for index, call in calls.items()]


def _final(gen: Generation, started: int) -> dict[str, Any]:
    assert gen.finish_reason is not None
    timings = gen.timings()
    return {"done": True, "done_reason": "length" if gen.finish_reason == "length" else "stop",
            "total_duration": time.monotonic_ns() - started, "load_duration": 0,
            "prompt_eval_count": gen.prompt_tokens, "prompt_eval_duration": int(timings["prompt_ms"] * 1e6),
            "eval_count": gen.completion_tokens, "eval_duration": int(timings["predicted_ms"] * 1e6)}


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


async def _lines(gen: Generation, name: str, chat: bool, started: int, think: bool) -> AsyncIterator[str]:
    try:
        async for piece in gen.pieces():
            thinking, content, calls = _split(gen.deltas(piece), think)
            if thinking or content or calls:
                yield _line(_head(name) | _payload(chat, content, calls, thinking) | {"done": False})
        thinking, content, calls = _split(gen.finish_deltas(), think)
        if thinking or content or calls:
            yield _line(_head(name) | _payload(chat, content, calls, thinking) | {"done": False})
        yield _line(_head(name) | _payload(chat, "", []) | _final(gen, started))
    except Exception as exc:  # the stream has begun: the failure is reported in-band
        error = generation_error(exc)
        if error.status == 500:
            log.exception("Ollama request %s failed while streaming", gen.request_id)
        yield _line({"error": error.message})
    finally:
        gen.cancel()
