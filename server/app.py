"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine.

build_app(engine_config, server_config, engine=None): with `engine=None` the lifespan loads
the engine in a thread, so /health answers 503 until it is ready; the lifespan starts and
stops the AsyncEngine. Routes under /v1 need the API key when one is configured; POST bodies
must be JSON and Host names loopback unless configured otherwise (server/security.py), bodies are
capped (server/limits.py), and a shutdown drains requests in flight (server/shutdown.py).
A generation request: parse (server/protocol.py) -> prompt ids and max tokens
(server/prompt.py) -> `to_sampling_params` -> `Generation`, streamed (server/sse.py) or
collected (server/generation.py). /v1/responses, /v1/messages (Anthropic) and /api/* (Ollama) map their
bodies to chat or completion requests and take the same path (server/responses_api/,
server/anthropic_api/, server/ollama_api/). /tokenize and /detokenize answer from the tokenizer alone
(server/tokenize_api/).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from engine.config import EngineConfig
from engine.types import GenerationEngine
from server.anthropic_api.routes import messages_router
from server.config import ServerConfig
from server.errors import APIError, authentication_error, install_error_handlers
from server.generation import collect_response
from server.infill import infill
from server.limits import read_body
from server.metrics import CONTENT_TYPE
from server.ollama_api.routes import ollama_router
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from server.responses_api.routes import create_response, delete_response, get_response, list_input_items
from server.responses_api.store import ResponseStore
from server.security import HostCheckMiddleware, allowed_hosts, require_json
from server.shutdown import DrainGate
from server.sse import stream_response
from server.start import start_generations
from server.state import EngineLoader, ServerState, default_loader
from server.tokenize_api.routes import tokenize_router
from server.webui import install_webui


def build_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    engine: GenerationEngine | None = None,
    *,
    loader: EngineLoader = default_loader,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    state = ServerState(engine_config, server_config, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        if engine is not None:
            state.attach(engine)
        else:
            task = asyncio.create_task(state.load(loader))
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            state.shutdown()

    app = FastAPI(title="SpecExec Server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specexec = state
    app.state.response_store = ResponseStore()  # stored /v1/responses (server/responses_api/store.py)
    install_error_handlers(app)
    app.add_middleware(DrainGate, state=state)  # middlewares added later wrap the earlier ones
    if server_config.cors_origins:
        origins = list(server_config.cors_origins)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials="*" not in origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "retry-after"],
        )
    if (hosts := allowed_hosts(server_config)) is not None:
        app.add_middleware(HostCheckMiddleware, allowed=hosts)
    install_webui(app, server_config.webui)  # GET/HEAD /: the chat page, or plain text with --no-webui
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(_v1_router())
    app.add_api_route("/infill", infill, methods=["POST"],  # llama.cpp's route (server/infill.py)
                      dependencies=[Depends(require_api_key), Depends(require_json)])
    app.include_router(ollama_router(), dependencies=[Depends(require_api_key)])  # /api/* (server/ollama_api/)
    # llama.cpp's and vLLM's /tokenize and /detokenize (server/tokenize_api/)
    app.include_router(tokenize_router(), dependencies=[Depends(require_api_key)])
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.specexec


async def require_api_key(request: Request) -> None:
    """Bearer token or x-api-key, compared in constant time as UTF-8 bytes (header values arrive as
    latin-1 text: their own bytes)."""
    key = _state(request).server_config.api_key
    if key is None:
        return
    supplied = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        supplied = auth[7:].strip()
    if supplied is None or not hmac.compare_digest(supplied.encode("latin-1"), key.encode("utf-8")):
        raise authentication_error()


def _v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/models/{model_id:path}", get_model, methods=["GET"])
    json_body = [Depends(require_json)]  # after the API key check
    router.add_api_route("/chat/completions", chat_completions, methods=["POST"], dependencies=json_body)
    router.add_api_route("/completions", completions, methods=["POST"], dependencies=json_body)
    router.add_api_route("/responses", create_response, methods=["POST"], dependencies=json_body)
    router.add_api_route("/responses/{response_id}", get_response, methods=["GET"])
    router.add_api_route("/responses/{response_id}", delete_response, methods=["DELETE"])
    router.add_api_route("/responses/{response_id}/input_items", list_input_items, methods=["GET"])
    router.include_router(messages_router())  # Anthropic's Messages API, its own error shape (server/anthropic_api/)
    return router


async def health(request: Request) -> JSONResponse:
    status, body = _state(request).status()
    return JSONResponse(body, status_code=status)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    """An OpenAI model object, plus `sampling_defaults`: what a request's left-out sampling fields
    default to (from the target's generation_config.json; {} with --generation-config none)."""
    return {"id": name, "object": "model", "created": state.created, "owned_by": "specexec",
            "sampling_defaults": state.sampling_defaults}


async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.require_ready()
    return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}


async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.require_ready()
    state.check_model(model_id)
    return _model_card(state, model_id)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


async def _serve(request: Request, chat: bool) -> Response:
    state = _state(request)
    endpoint = "chat" if chat else "completions"
    try:
        return await _generate(request, state, chat, endpoint)
    except APIError as exc:
        state.metrics.rejected.labels(endpoint, str(exc.status)).inc()
        raise


async def _generate(request: Request, state: ServerState, chat: bool, endpoint: str) -> Response:
    config = state.server_config
    raw = await read_body(request, config.max_body_bytes, config.read_timeout)
    # parsing, templates and tokenization of a large body take seconds: off the event loop, in the
    # server's own threads for bodies of this size (server/preparation.py)
    lane = state.preparation.lane(len(raw))
    req = await lane.run(parse_request, raw, ChatCompletionRequest if chat else CompletionRequest)
    gens, env = await start_generations(state, req, chat, endpoint, lane)
    if req.stream:
        return stream_response(gens, env, state.require_ready()[0], req.include_usage, config.ping_seconds)
    return await collect_response(request, gens, env, state.preparation.render)
