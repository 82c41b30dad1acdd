"""`specexec serve --target org/name` serves a model found only in the Hugging Face cache, offline: the
draft chosen for it (`--draft auto`) and said at startup, the model listed under its id."""

from __future__ import annotations

import os
import subprocess

import httpx

from tests.api.conftest import REPO, ServerProcess, free_port, serve_command, wait_healthy
from tests.helpers.fake_hub import put_in_cache
from tests.helpers.tiny_models import make_tiny_pair


def test_serve_a_model_by_its_id_from_the_cache_offline(tmp_path) -> None:
    target, _ = make_tiny_pair(tmp_path / "pair", draft="noisy")
    small = make_tiny_pair(tmp_path / "small", draft="random")[1]
    cache = tmp_path / "hub"
    put_in_cache(cache, "org/tiny", target)
    put_in_cache(cache, "org/tiny-small", small)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("SPECEXEC_API_KEY", None)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*serve_command(), "--target", "org/tiny", "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server)
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["org/tiny"]
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "org/tiny", "prompt": "def add(", "max_tokens": 6, "temperature": 0}).json()
        assert reply["model"] == "org/tiny" and reply["usage"]["completion_tokens"] == 6
        assert "--draft auto: org/tiny-small (in the cache;" in server.log()
    finally:
        server.stop()
