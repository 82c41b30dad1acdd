"""The chat page in a real browser: headless Chromium (the system's, driven by playwright-core from
tests/webui/drive.mjs) against a real `specexec serve` over the built-in pair.

It sends a chat message and waits for the streamed reply; the reply's text, its token spans (draft or
target, pass by pass) and the panel's numbers must be what the server sent (the SSE bodies the browser
received, parsed here) and agree with the response's `timings`. Then an A/B run (seeded sampling,
autoregressive beside speculative: identical text, one pass per token), a completion, a tool call (a
canned stream), and with --api-key the key dialog. No console errors, no request to another host.

Screenshots: SPECEXEC_WEBUI_SHOTS=docs writes docs/webui-chat.png, webui-ab.png and webui-completion.png
(the README shows them). Needs node, `npm ci --prefix tests/webui` and Chromium (CHROMIUM=path, else
chromium / chromium-browser / google-chrome on PATH); skipped, with the reason, without them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.serve_process import stop_process
from tests.api.conftest import ServerProcess, free_port, serve_command, wait_healthy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DRIVER = HERE / "node_modules" / "playwright-core"
DEFAULT_PAIR = REPO / "models" / "default"
KEY = "webui-test-key"


def chromium_path() -> str | None:
    named = os.environ.get("CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


def missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    if not DRIVER.is_dir():
        return "playwright-core is not installed: npm ci --prefix tests/webui"
    if chromium_path() is None:
        return "Chromium is not installed (apt-get install chromium, or CHROMIUM=/path/to/chrome)"
    if not (DEFAULT_PAIR / "target").is_dir():
        return "models/default is missing"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=missing() or "")]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """`specexec serve` over the built-in pair (its defaults, as scripts/serve.sh runs it), with extra flags."""
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        port = free_port()
        log_path = tmp_path_factory.mktemp("webui_serve") / "serve.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("SPECEXEC_API_KEY", None)
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen([*serve_command(), "--port", str(port), *flags], stdout=log_file,
                                       stderr=subprocess.STDOUT, env=env, cwd=REPO)
        server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
        started.append(server)
        wait_healthy(server)
        return server

    yield start
    for server in started:
        stop_process(server.process, grace_seconds=30)


def drive(url: str, scenario: str, shots: Path | None = None) -> dict[str, Any]:
    config = {"url": url, "scenario": scenario, "chromium": chromium_path(), "key": KEY,
              "shots": str(shots) if shots else None}
    done = subprocess.run(["node", str(HERE / "drive.mjs"), json.dumps(config)], capture_output=True, text=True,
                          timeout=900, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert "failure" not in seen, seen["failure"]
    return seen


def parse_sse(text: str) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(content, trace tokens, timings) of one streamed response as the browser received it."""
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    content = "".join(c.get("delta", {}).get("content") or c.get("text") or "" for c in choices)
    tokens = [t for c in choices for t in c["specexec"]["tokens"]]
    return content, tokens, chunks[-1]["timings"]


def check_reply(shown: dict[str, Any], response: dict[str, Any], prompt: str = "") -> dict[str, Any]:
    """The page shows the response's text with every token marked by the trace's origin, and its panel
    numbers are the response's timings. Returns the timings."""
    assert response["status"] == 200 and response["request"]["specexec"]["trace"] is True
    content, tokens, timings = parse_sse(response["text"])
    assert content and shown["text"] == prompt + content
    by_token: dict[int, str] = {}
    for span in shown["spans"]:
        by_token[span["index"]] = by_token.get(span["index"], "") + span["text"]
        assert span["origin"] == tokens[span["index"]]["origin"] and span["pass"] == tokens[span["index"]]["pass"]
    assert "".join(by_token[i] for i in sorted(by_token)) == content  # every character is in a token's span
    assert by_token == {i: t["text"] for i, t in enumerate(tokens) if t["text"]}
    origins = {span["origin"] for span in shown["spans"]}
    assert origins == {"draft", "target"} or timings["draft_tokens_accepted"] == 0
    stats = shown["stats"]
    assert int(stats["passes"]) == timings["target_passes"] == shown["bars"]
    assert int(stats["draft"]) == timings["draft_tokens_accepted"]
    assert int(stats["tokens"]) == timings["predicted_n"] == len(tokens)
    assert stats["per-pass"] == f"{timings['mean_accepted_per_pass']:.2f}"
    assert stats["prefill-ms"] == f"{timings['prompt_ms']:.1f} ms"
    if timings["target_passes"] > 1:  # steps after the prompt's, timed by the trace as by timings
        assert float(stats["tok-s"]) == pytest.approx(timings["generation_tokens_per_second"], rel=0.01, abs=0.1)
    assert stats["agrees"].startswith("✓")
    return timings


def check_clean(seen: dict[str, Any], allowed_console: tuple[str, ...] = ()) -> None:
    errors = [m for m in seen["console"] if not any(a in m for a in allowed_console)]
    assert errors == [] and seen["pageErrors"] == []
    assert seen["foreignRequests"] == []  # every asset from the server itself
    # (a finished event stream is reported as aborted by the browser's network events: only assets count)
    assert [r for r in seen["failedRequests"] if "/v1/" not in r] == []


def test_page_in_chromium(serve: Callable[..., ServerProcess]) -> None:
    server = serve()
    shots = Path(os.environ["SPECEXEC_WEBUI_SHOTS"]).resolve() if os.environ.get("SPECEXEC_WEBUI_SHOTS") else None
    seen = drive(server.url, "page", shots)
    check_clean(seen)
    assert seen["model"] == "specexec-default"

    [chat] = seen["chat"]["responses"]
    timings = check_reply(seen["chat"], chat)
    assert timings["draft_tokens_accepted"] > 0 and timings["target_passes"] < timings["predicted_n"]
    assert seen["passBoundaries"] == "solid"
    assert any(0 < length < len(seen["chat"]["text"]) for length in seen["chat"]["partial"])  # it streamed
    assert seen["regenerated"] == {"text": seen["chat"]["text"], "articles": 2}
    assert seen["stopped"]["errors"] == ["stopped"] and 0 < int(seen["stopped"]["stats"]["tokens"]) < 900

    ab = seen["ab"]
    first, second = ab["responses"]
    assert "method" not in first["request"]["specexec"] and second["request"]["specexec"]["method"] == "autoregressive"
    assert first["request"]["seed"] == second["request"]["seed"] == 1234
    speculative = check_reply(ab["a"], first)
    autoregressive = check_reply(ab["b"], second)
    assert ab["a"]["text"] == ab["b"]["text"] and ab["verdict"].startswith("✓ identical text")
    assert autoregressive["target_passes"] == autoregressive["predicted_n"] > speculative["target_passes"]
    assert autoregressive["draft_tokens_accepted"] == 0

    [completion] = seen["completion"]["responses"]
    check_reply(seen["completion"], completion, prompt=seen["completion"]["prompt"])
    assert completion["request"]["prompt"] == seen["completion"]["prompt"]

    assert seen["tool"]["toolCalls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert seen["tool"]["errors"] == []
    assert seen["invalid"] == {"flash": "seed: not a number", "articles": 2}


def test_page_asks_for_the_api_key(serve: Callable[..., ServerProcess]) -> None:
    server = serve("--api-key", KEY, "--budget", "16")
    seen = drive(server.url, "key")
    check_clean(seen, allowed_console=("status of 401",))  # the browser logs each refused call
    assert seen["keyError"] == "That key was not accepted."
    assert seen["model"] == "specexec-default"
    [chat] = seen["chat"]["responses"]
    check_reply(seen["chat"], chat)
    assert seen["storage"]["session"] == KEY and KEY not in seen["storage"]["local"]
