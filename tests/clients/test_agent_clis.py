"""Claude Code (`claude -p`, Anthropic Messages) and OpenAI's Codex CLI (`codex exec`, the Responses API with
a custom provider) complete non-interactive turns against `specexec serve` on the built-in pair with its
tools template (tests/clients/conftest.py `agent_server`), where node and the packages are installed:

    npm ci --prefix tests/clients/claude_code
    npm ci --prefix tests/clients/codex

(.ci/run installs them when node is there). A second turn reads the first one's prompt from the prefix
cache: Claude Code's billing-header system block, different on every request, is dropped before templating.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

CLIENTS = Path(__file__).resolve().parent
CLAUDE = CLIENTS / "claude_code" / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
CODEX = CLIENTS / "codex" / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
MODEL = "specexec-default"
TIMEOUT = 1200  # seconds: the first turn prefills Claude Code's ~17k-token prompt on a CPU

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")]


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: no key or setting of the machine's own clients leaks in."""
    return {"PATH": str(Path(shutil.which("node") or "node").parent) + ":/usr/bin:/bin", "HOME": str(home),
            "LANG": "C.UTF-8"}


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    result = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout


def claude(server: Any, home: Path, workdir: Path, prompt: str, *flags: str) -> dict[str, Any]:
    env = base_env(home) | {
        "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    out = run(["node", str(CLAUDE), "-p", prompt, "--output-format", "json", *flags], env, workdir)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not CLAUDE.is_file(), reason="Claude Code is not installed: npm ci --prefix tests/clients/claude_code")
def test_claude_code_completes_two_turns_and_the_second_reads_the_cache(agent_server: Any, tmp_path: Path) -> None:
    home, workdir = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    first = claude(agent_server, home, workdir, "Write a Python function that adds two numbers.")
    assert first["type"] == "result" and first["subtype"] == "success" and first["is_error"] is False, first
    assert first["stop_reason"] in ("end_turn", "max_tokens") and isinstance(first["result"], str)
    usage = first["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert prompt > 5000 and usage["output_tokens"] > 0  # Claude Code's system prompt and tools
    second = claude(agent_server, home, workdir, "Now make it subtract.", "--continue")
    assert second["subtype"] == "success" and second["is_error"] is False, second
    assert second["usage"]["cache_read_input_tokens"] >= prompt - 1, (first["usage"], second["usage"])


def codex(server: Any, home: Path, workdir: Path, prompt: str) -> list[dict[str, Any]]:
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "specexec"\n\n[model_providers.specexec]\nname = "SpecExec"\n'
        f'base_url = "{server.url}/v1"\nenv_key = "SPECEXEC_API_KEY"\nwire_api = "responses"\n')
    env = base_env(home) | {"CODEX_HOME": str(home), "SPECEXEC_API_KEY": "unused"}
    out = run(["node", str(CODEX), "exec", "--skip-git-repo-check", "--json", "--ephemeral", prompt], env, workdir)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.skipif(not CODEX.is_file(), reason="Codex is not installed: npm ci --prefix tests/clients/codex")
def test_codex_exec_completes_turns_through_the_responses_api(agent_server: Any, tmp_path: Path) -> None:
    home, workdir = tmp_path / "codex_home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    usages = []
    for _ in range(2):
        events = codex(agent_server, home, workdir, "Write a Python function that adds two numbers.")
        kinds = [event["type"] for event in events]
        assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, events
        messages = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
        assert messages and isinstance(messages[-1]["text"], str)
        usages.append(next(e["usage"] for e in events if e["type"] == "turn.completed"))
    assert usages[0]["input_tokens"] > 3000 and usages[0]["output_tokens"] > 0  # Codex's instructions and tools
    assert usages[1]["cached_input_tokens"] >= usages[0]["input_tokens"] - 64, usages  # the same prompt again
