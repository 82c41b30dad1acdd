"""Claude Code (`claude -p`) against a scripted server over the Anthropic Messages API, with a stdio MCP
server of its own: the model's `tool_use` of `mcp__weather__get_forecast` is run by Claude Code on the MCP
server, its `tool_result` comes back in the next request, and the model's answer is the turn's result (the
whole tool loop of the Anthropic surface with the real client; tests/helpers/agent_turns.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.agent_turns import CLAUDE, MCP_SERVER, TOOL_OUTPUT, turn_engine
from tests.helpers.tool_models import HERMES_TEMPLATE, last_prompt

CALL = '<tool_call>\n{"name": "mcp__weather__get_forecast", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None or not CLAUDE.is_file(),
                    reason="Claude Code is not installed: npm ci --prefix tests/clients/claude_code")
def test_claude_code_runs_an_mcp_tool_the_model_calls(fake_server, tmp_path: Path) -> None:
    srv = fake_server(turn_engine(HERMES_TEMPLATE, CALL, "It is sunny.<|end|>"))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (tmp_path / "mcp_server.py").write_text(MCP_SERVER)
    mcp = {"mcpServers": {"weather": {"command": sys.executable, "args": [str(tmp_path / "mcp_server.py")]}}}
    env = {"PATH": str(Path(shutil.which("node") or "node").parent) + ":/usr/bin:/bin", "HOME": str(home),
           "LANG": "C.UTF-8", "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": "fake-model", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "fake-model", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    result = subprocess.run(["node", str(CLAUDE), "-p", "Weather in Paris?", "--output-format", "json",
                             "--mcp-config", json.dumps(mcp), "--strict-mcp-config",
                             "--allowedTools", "mcp__weather__get_forecast"],
                            env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    final = json.loads(result.stdout.strip().splitlines()[-1])
    assert final["subtype"] == "success" and final["result"] == "It is sunny.", final
    assert final["num_turns"] == 2, final  # the call, then the answer
    assert TOOL_OUTPUT in last_prompt(srv)  # the MCP server's answer, in the second request's prompt
