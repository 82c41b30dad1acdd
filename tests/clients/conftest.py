"""Fixtures for the tests of real clients (the anthropic and ollama SDKs, Claude Code, Codex).

`clients_server`: ONE session-scoped `specexec serve` process on 127.0.0.1 over a tiny target/draft pair
with 2048 positions and a Hermes-style chat template that renders tools (tests/helpers/tool_models.py),
served as `tiny`. The tiny models are random: their text is noise, but it is the same noise on every API
surface for the same prompt and sampling, and under the calls' grammar their tool calls are valid.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import REPO, ServerProcess, free_port, serve_command, wait_healthy
from tests.helpers.tiny_models import make_tiny_pair
from tests.helpers.tool_models import HERMES_TEMPLATE

MODEL = "tiny"


def start_server(folder: Path, *flags: str, max_positions: int = 2048) -> ServerProcess:
    """`specexec serve` over a fresh tiny pair in `folder` with the Hermes template, healthy."""
    target, draft = make_tiny_pair(folder, draft="noisy", max_positions=max_positions)
    template = folder / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    port = free_port()
    log_path = folder / "serve.log"
    cmd = [*serve_command(), "--target", str(target), "--draft", str(draft), "--port", str(port), "--budget", "16",
           "--chat-template", str(template), "--served-model-name", MODEL, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECEXEC_API_KEY", None)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def clients_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("clients_pair"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The built-in pair (models/default) with its tools template (configs/templates/tools-demo.jinja) and a
    context long enough for the agents' prompts (Claude Code's is ~17k tokens, Codex's ~9k): their system
    prompts and tool definitions are far beyond the pair's 1024 trained positions, so the replies are noise,
    but every request runs the whole path (templating, tools, grammar, prefix cache, streaming)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("agent_serve") / "serve.log"
    cmd = [*serve_command(), "--chat-template", str(REPO / "configs" / "templates" / "tools-demo.jinja"),
           "--max-context", "32768", "--allow-long-context", "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECEXEC_API_KEY", None)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server)
        yield server
    finally:
        server.stop()
