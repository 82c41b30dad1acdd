"""`specexec serve --draft self` on the built-in pair, resident and streamed: the startup log says what
the self-draft holds, and a greedy completion is the same text as the same server's autoregressive one
(the target alone), in fewer target passes."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from tests.api.conftest import REPO, ServerProcess, free_port, serve_command, wait_healthy

PROMPT = "class Stack:\n    def __init__(self):\n        self."


@pytest.mark.parametrize("flags", [[], ["--offload", "--resident-layers", "2"]], ids=["resident", "streamed"])
def test_serve_with_the_self_draft(tmp_path, flags) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECEXEC_API_KEY", None)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*serve_command(), "--draft", "self", "--budget", "64", "--port", str(port), *flags],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server)
        replies = {}
        for method in ("specexec", "autoregressive"):
            replies[method] = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "specexec": {"method": method}}).json()
        assert replies["specexec"]["choices"][0]["text"] == replies["autoregressive"]["choices"][0]["text"]
        timings = replies["specexec"]["timings"]
        assert timings["predicted_n"] == 32 and timings["target_passes"] < 16
        copies = "4 layers" if not flags else "2 layers"
        assert f"--draft self: 4-bit copies of {copies}" in server.log()
    finally:
        server.stop()
