"""Fixtures for the API tests.

- `live_server`: ONE session-scoped `specexec serve` process on 127.0.0.1 over a tiny
  target/draft pair (tests/helpers/tiny_models.py); most end-to-end tests share it.
- `start_serve(...)`: spawn another `specexec serve` with extra flags (the queue-bound,
  API-key and CORS tests share one such process).
- `fake_server(...)`: the real app over a FakeEngine, served by uvicorn in a thread: fast
  tests of the HTTP layer (pings, faults, loading) without models.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.serve_process import stop_process
from engine.config import EngineConfig, LimitsConfig
from server.app import build_app
from server.config import ServerConfig
from tests.helpers.fake_engine import FakeEngine

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

STARTUP_TIMEOUT = 240.0  # seconds: torch + transformers imports are slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command() -> list[str]:
    script = Path(sys.executable).with_name("specexec")
    return [str(script), "serve"]


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    health_statuses: list[int] = field(default_factory=list)  # every /health status seen while starting

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_process(self.process, grace_seconds=30)


def wait_healthy(server: ServerProcess, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"specexec serve exited with {server.process.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(f"{server.url}/health", timeout=5).status_code
            server.health_statuses.append(status)
            if status == 200:
                return
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"specexec serve not healthy after {timeout}s:\n{server.log()}")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.helpers.tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny_pair"), draft="noisy")


@pytest.fixture(scope="session")
def start_serve(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable]:
    started: list[ServerProcess] = []

    def start(*flags: str, wait: bool = True) -> ServerProcess:
        target, draft = tiny_pair
        port = free_port()
        log_path = tmp_path_factory.mktemp("serve_log") / "serve.log"
        cmd = [*serve_command(), "--target", str(target), "--draft", str(draft), "--port", str(port), *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("SPECEXEC_API_KEY", None)
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
        started.append(server)
        if wait:
            wait_healthy(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def live_server(start_serve: Callable) -> ServerProcess:
    return start_serve("--budget", "16")


@pytest.fixture(scope="session")
def client(live_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# -- in-thread server over a FakeEngine ----------------------------------------------------


@dataclass
class FakeServer:
    url: str
    engine: FakeEngine | None
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.app.state.specexec


def run_uvicorn(app: Any, port: int, make_server: Callable[[Any], Any] | None = None,
                **config_fields: Any) -> tuple[Any, threading.Thread]:
    """uvicorn serving `app` on 127.0.0.1:`port` in a daemon thread, started (config_fields: uvicorn.Config's;
    make_server: config -> a uvicorn.Server subclass instance, default uvicorn.Server)."""
    import uvicorn

    config_fields = {"log_level": "warning", "timeout_graceful_shutdown": 2, **config_fields}
    config = uvicorn.Config(app, host="127.0.0.1", port=port, **config_fields)
    server = (make_server or uvicorn.Server)(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    return server, thread


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    running: list[FakeServer] = []

    def start(engine: FakeEngine | None = None, *, loader: Callable | None = None, max_queue: int = 4,
              default_max_tokens: int = 64, **server_fields: Any) -> FakeServer:
        port = free_port()
        engine_config = EngineConfig(limits=LimitsConfig(max_queue=max_queue, default_max_tokens=default_max_tokens))
        server_config = ServerConfig(port=port, **server_fields)
        if loader is not None:
            app = build_app(engine_config, server_config, loader=loader)
        else:
            engine = engine or FakeEngine()
            app = build_app(engine_config, server_config, engine)
        server, thread = run_uvicorn(app, port)
        fake = FakeServer(f"http://127.0.0.1:{port}", engine, app, server, thread)
        running.append(fake)
        return fake

    yield start
    for fake in running:
        fake.server.should_exit = True
        fake.thread.join(timeout=15)
