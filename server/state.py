"""What the app holds while it runs: the engine (loaded in a thread), its AsyncEngine, prompts, metrics."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import GenerationEngine
from server.config import ServerConfig
from server.errors import engine_down, loading, model_not_found
from server.metrics import Metrics
from server.preparation import Preparation
from server.prompt import PromptBuilder
from server.sampling_defaults import sampling_defaults_for

log = logging.getLogger("specexec.server")

EngineLoader = Callable[[EngineConfig], GenerationEngine]


def default_loader(config: EngineConfig) -> GenerationEngine:
    from engine.runtime import Engine

    return Engine.load(config)


def freeze_loaded_objects() -> None:
    """Move every object alive after loading (imports, the model's Python side: hundreds of thousands)
    out of the garbage collector's view (gc.freeze). A full collection, which holds the interpreter lock,
    otherwise walks them all: 0.16 s here, set off by any request that makes many objects (87k chat
    messages), stalling every thread, the event loop's and the engine's included."""
    gc.collect()
    gc.freeze()


class ServerState:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine_config = engine_config
        self.server_config = server_config
        self.metrics = Metrics()
        self.engine: GenerationEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.prompt: PromptBuilder | None = None
        self.load_error: BaseException | None = None
        self._on_fatal = on_fatal
        self._chat_template = server_config.read_chat_template()
        spec = engine_config.speculation
        self.fingerprint = f"fp_specexec_{spec.method}_{spec.budget}"
        self.created = int(time.time())  # /v1/models `created`: fixed for the life of the process
        self.draining = False  # set on SIGTERM/SIGINT: new requests get 503 (server/shutdown.py)
        self.in_flight = 0  # HTTP requests being answered (counted by server/shutdown.py's DrainGate)
        self.cut_off = asyncio.Event()  # set when a drain's grace period ends: bodies still uploading get 503
        self.preparation = Preparation(server_config.grammar_timeout)  # parse/tokenize/compile threads
        # what a request's left-out sampling fields default to (server/sampling_defaults.py); set at attach
        self.sampling_defaults: dict[str, float | int] = {}
        self.load_thread: threading.Thread | None = None  # the engine's load (ServerState.load)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every id a request may name; the first is the one /v1/models lists first."""
        if self.server_config.served_model_name:
            return self.server_config.served_model_name
        return (self.engine.model_name,) if self.engine is not None else ()

    @property
    def model_name(self) -> str:
        return self.model_names[0] if self.model_names else ""

    def response_model(self, requested: str | None) -> str:
        """The `model` of a response: the id the request named (checked already), else the first ("" counts
        as omitted)."""
        return requested or self.model_name

    @property
    def ready(self) -> bool:
        return self.async_engine is not None and self.async_engine.healthy

    def status(self) -> tuple[int, dict[str, str]]:
        if self.draining:
            return 503, {"status": "shutting_down"}
        if self.ready:
            return 200, {"status": "ok"}
        if self.load_error is not None:
            return 503, {"status": "error", "error": f"{type(self.load_error).__name__}: {self.load_error}"}
        if self.async_engine is not None and self.async_engine.fault is not None:
            return 503, {"status": "error", "error": f"engine fault: {self.async_engine.fault}"}
        return 503, {"status": "loading"}

    def require_ready(self) -> tuple[AsyncEngine, PromptBuilder]:
        if self.async_engine is None or self.prompt is None:
            if self.load_error is not None:
                raise engine_down(f"loading failed: {self.load_error}")
            raise loading()
        if not self.async_engine.healthy:
            raise engine_down(str(self.async_engine.fault or "the engine loop stopped"))
        return self.async_engine, self.prompt

    def check_model(self, model: str | None) -> None:
        """An omitted model (null, or "" as some clients send) means the served one (as llama.cpp and vLLM
        do); an unknown id is a 404."""
        if model and model not in self.model_names:
            raise model_not_found(model)

    @property
    def load_unfinished(self) -> bool:
        """A load was started and neither attached an engine nor failed: it still runs (or its engine came
        too late). `specexec serve` then ends the process at once (server/serve.py) rather than wait."""
        return self.load_thread is not None and self.engine is None and self.load_error is None

    async def load(self, loader: EngineLoader) -> None:
        """Load the engine in a daemon thread of its own (the event loop keeps answering /health with 503).
        Not asyncio's default executor: the loop's end waits for that executor's threads, so a signal
        during a load would wait for the whole load (minutes for a 70B) before the process could exit."""
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[GenerationEngine] = loop.create_future()

        def settle(engine: GenerationEngine | None, exc: BaseException | None) -> None:
            if loaded.cancelled():  # the server stopped first: nothing will serve this engine
                if engine is not None:
                    engine.close()
            elif exc is not None:
                loaded.set_exception(exc)
            else:
                loaded.set_result(engine)

        def work() -> None:
            engine, error = None, None
            try:
                engine = loader(self.engine_config)
            except BaseException as exc:  # handed to the loop, which logs it and fails the server
                error = exc
            try:
                loop.call_soon_threadsafe(settle, engine, error)
            except RuntimeError:  # the loop is closed: the server stopped while this loaded
                if engine is not None:
                    engine.close()

        self.load_thread = threading.Thread(target=work, name="specexec-load", daemon=True)
        self.load_thread.start()
        try:
            engine = await loaded
            self.attach(engine)
            freeze_loaded_objects()
        except Exception as exc:
            log.exception("loading the engine failed")
            self.load_error = exc
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def attach(self, engine: GenerationEngine) -> None:
        self.sampling_defaults = sampling_defaults_for(self.server_config.generation_config,
                                                       self.engine_config.model.target)
        self.prompt = PromptBuilder(
            engine.tokenizer,
            max_context=engine.max_context,
            default_max_tokens=self.engine_config.limits.default_max_tokens,
            validate=engine.validate_request,
            chat_template=self._chat_template,
            tool_parser=self.server_config.tool_parser,
            reasoning_format=self.server_config.reasoning_format,
            template_kwargs=self.server_config.chat_template_kwargs,
        )
        max_queue = self.engine_config.limits.max_queue
        async_engine = AsyncEngine(engine, max_queue, on_delta=self.metrics.observe_delta,
                                   on_finish=self.metrics.observe_finish, on_step=self.metrics.observe_step)
        self.metrics.bind_async_engine(async_engine)
        async_engine.start()
        self.engine = engine
        self.async_engine = async_engine
        log.info("serving model %r (max context %d, %d requests per target pass, queue bound %d)",
                 self.model_name, engine.max_context, engine.max_running, max_queue)
        log.info("speculation: %s", self.engine_config.speculation.describe())

    def shutdown(self) -> None:
        self.preparation.shutdown()
        if self.async_engine is not None:
            self.async_engine.stop()
            if self.engine is not None and not self.async_engine.worker_alive:  # no step uses it any more
                self.engine.close()
