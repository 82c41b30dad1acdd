"""The FastAPI app: OpenAI-compatible routes over the engine loop.

build_app(engine_config, server_config, engine=None): with `engine=None` the lifespan loads
the engine in a thread, so /health answers 503 until it is ready; the lifespan starts and
stops the engine loop. Routes under /v1 need the API key when one is configured.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from engine.config import EngineConfig
from engine.types import Request as EngineRequest
from engine.types import SamplingParams
from server.config import ServerConfig
from server.detok import TextStream
from server.errors import APIError, authentication_error, generation_error, install_error_handlers
from server.generation import Generation
from server.metrics import CONTENT_TYPE
from server.prompt import PromptBuilder
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    max_tokens_of,
    parse_request,
    stop_strings,
)
from server.responses import Envelope
from server.sse import stream_response
from server.state import EngineLoader, ServerState, default_loader

log = logging.getLogger("specexec.server")

DISCONNECT_POLL_SECONDS = 0.25
SEED_MODULUS = 2**63


def build_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    engine: Any = None,
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
    install_error_handlers(app)
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
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(_v1_router())
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.specexec


async def require_api_key(request: Request) -> None:
    """Bearer token or x-api-key, compared in constant time."""
    key = _state(request).server_config.api_key
    if key is None:
        return
    supplied = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        supplied = auth[7:].strip()
    if supplied is None or not hmac.compare_digest(supplied.encode(), key.encode()):
        raise authentication_error()


def _v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/models/{model_id:path}", get_model, methods=["GET"])
    router.add_api_route("/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/completions", completions, methods=["POST"])
    return router


async def health(request: Request) -> JSONResponse:
    status, body = _state(request).status()
    return JSONResponse(body, status_code=status)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "specexec"}


async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.require_ready()
    return {"object": "list", "data": [_model_card(state)]}


async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.require_ready()
    state.check_model(model_id)
    return _model_card(state)


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
    req: SamplingRequest = parse_request(await request.body(), ChatCompletionRequest if chat else CompletionRequest)
    loop, prompt = state.require_ready()
    state.check_model(req.model)
    if isinstance(req, ChatCompletionRequest):
        prompt_ids, param = prompt.chat_ids(req.messages), "messages"
    else:
        assert isinstance(req, CompletionRequest)
        prompt_ids, param = prompt.completion_ids(req), "prompt"
    max_tokens = prompt.max_tokens(len(prompt_ids), max_tokens_of(req), param)
    params = sampling_params(req, max_tokens, prompt)
    env = Envelope(chat, state.model_name, state.fingerprint)
    text = TextStream(prompt.tokenizer, stop_strings(req))
    gen = Generation(loop, EngineRequest(env.id, prompt_ids, params), text, state.metrics, endpoint)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(gen, env, loop, include_usage, state.server_config.ping_seconds)
    return await _collect(request, gen, env)


def sampling_params(req: SamplingRequest, max_tokens: int, prompt: PromptBuilder) -> SamplingParams:
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_p == 0.0:  # the limit of top_p -> 0: only the most likely token
        top_p, top_k = 1.0, 1
    stop_token_ids = tuple(req.stop_token_ids or ())
    prompt.check_token_ids(list(stop_token_ids), "stop_token_ids")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=prompt.logit_bias(req.logit_bias),
        seed=None if req.seed is None else req.seed % SEED_MODULUS,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(req.ignore_eos),
    )


async def _collect(request: Request, gen: Generation, env: Envelope) -> Response:
    """Non-streaming: gather the text; a client that goes away aborts the engine request."""
    parts: list[str] = []

    async def run() -> None:
        async for piece in gen.pieces():
            parts.append(piece)

    task = asyncio.ensure_future(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        task.result()
    except Exception as exc:
        error = generation_error(exc)
        if error.status == 500:
            log.exception("request %s failed", gen.request_id)
        raise error from None
    finally:
        if not task.done():
            task.cancel()
    assert gen.finish_reason is not None
    body = env.completion("".join(parts), gen.finish_reason, gen.usage(), gen.timings())
    return JSONResponse(body, headers={"x-request-id": env.id})
