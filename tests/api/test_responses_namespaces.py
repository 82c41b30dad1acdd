"""Namespace tools on /v1/responses (server/responses_api/namespaces.py): Codex (0.171) sends each MCP
server's tools as `{"type": "namespace", "name": "mcp__<server>", "tools": [...]}`. The model is offered
them under qualified names; its call comes back as OpenAI's does (the tool's own `name` and the
`namespace`); a replayed call is rendered under the qualified name again. Last, the real Codex CLI with a
real (stdio) MCP server: the model's call reaches the server's tool and its output comes back; and its
view_image tool, whose image output a text-only model gets as a note."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from server.tool_images import IMAGE_NOTE
from tests.helpers.agent_turns import CODEX, MCP_SERVER, TOOL_OUTPUT, turn_engine
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import (
    HERMES_TEMPLATE,
    last_prompt,
    openai_client,
    scripted_engine,
    tool_tokenizer,
)

FORECAST = {"type": "function", "name": "get_forecast", "description": "Forecast for a city", "strict": False,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER = {"type": "namespace", "name": "mcp__weather", "description": "Tools in the mcp__weather namespace.",
           "tools": [FORECAST]}
CLOCK = {"type": "function", "name": "get_forecast", "description": "A clock's forecast (same name, no namespace).",
         "parameters": {"type": "object", "properties": {}}}
PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
CALL = '<tool_call>\n{"name": "mcp__weather__get_forecast", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'


def server(fake_server: Callable, script: str, engine: FakeEngine | None = None) -> Any:
    engine = engine or scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script, tokens_per_step=3)
    return fake_server(engine, default_max_tokens=300)  # Codex asks for no limit; a call takes ~90 tokens


def test_a_namespaced_tool_is_offered_qualified_and_its_call_names_the_namespace(fake_server) -> None:
    srv = server(fake_server, CALL)
    client = openai_client(srv)
    response = client.responses.create(model="fake-model", input="Weather in Paris?", tools=[WEATHER, CLOCK])
    call = response.output[0]
    assert (call.type, call.name, call.namespace) == ("function_call", "get_forecast", "mcp__weather")
    assert json.loads(call.arguments) == {"city": "Paris"}
    prompt = last_prompt(srv)
    assert '"name": "mcp__weather__get_forecast"' in prompt and '"name": "get_forecast"' in prompt
    added = [e.item for e in client.responses.create(model="fake-model", input="Weather in Paris?",
                                                     tools=[WEATHER], stream=True)
             if e.type in ("response.output_item.added", "response.output_item.done")]
    assert [(item.name, item.namespace) for item in added] == [("get_forecast", "mcp__weather")] * 2


def test_a_replayed_namespaced_call_is_rendered_under_its_qualified_name(fake_server) -> None:
    srv = server(fake_server, "Sunny.<|end|>")
    history = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_forecast", "namespace": "mcp__weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    response = openai_client(srv).responses.create(model="fake-model", input=history, tools=[WEATHER])
    assert response.output_text == "Sunny."
    prompt = last_prompt(srv)
    assert prompt.count("mcp__weather__get_forecast") == 2 and "sunny, 21 C" in prompt  # offered, then called


def test_tool_choice_names_a_namespaced_tool(fake_server) -> None:
    srv = server(fake_server, CALL)
    response = openai_client(srv).responses.create(
        model="fake-model", input="Weather?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_forecast", "namespace": "mcp__weather"})
    assert (response.output[0].name, response.output[0].namespace) == ("get_forecast", "mcp__weather")
    assert srv.engine.requests[-1].params.structured_output is not None  # the named tool's grammar


def test_a_namespace_without_name_or_tools_is_a_400_naming_it(fake_server) -> None:
    client = openai_client(server(fake_server, CALL))
    for tool, param in (({"type": "namespace", "description": "d", "tools": [FORECAST]}, "tools[0].name"),
                        ({"type": "namespace", "name": "n", "description": "d"}, "tools[0].tools"),
                        ({"type": "namespace", "name": "n", "description": "d", "tools": [{"type": "function"}]},
                         "tools[0].tools[0].name")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="fake-model", input="hi", tools=[tool])
        assert caught.value.body["param"] == param, caught.value.body
    assert client.responses.create(model="fake-model", input="hi", tools=[WEATHER]).output  # still serving


# --- the real Codex CLI, an MCP server of its own, and this server

@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None or not CODEX.is_file(),
                    reason="Codex is not installed: npm ci --prefix tests/clients/codex")
def test_codex_calls_an_mcp_servers_tool_through_the_namespace(fake_server, tmp_path: Path) -> None:
    srv = server(fake_server, CALL, turn_engine(HERMES_TEMPLATE, CALL, "It is sunny.<|end|>"))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (tmp_path / "mcp_server.py").write_text(MCP_SERVER)
    (home / "config.toml").write_text(
        'model = "fake-model"\nmodel_provider = "specexec"\napproval_policy = "never"\n\n'
        f'[model_providers.specexec]\nname = "SpecExec"\nbase_url = "{srv.url}/v1"\nenv_key = "SPECEXEC_API_KEY"\n'
        f'wire_api = "responses"\n\n[mcp_servers.weather]\ncommand = "{sys.executable}"\n'
        f'args = ["{tmp_path / "mcp_server.py"}"]\ndefault_tools_approval_mode = "approve"\n')
    env = {"PATH": str(Path(shutil.which("node") or "node").parent) + ":/usr/bin:/bin", "HOME": str(home),
           "CODEX_HOME": str(home), "SPECEXEC_API_KEY": "unused", "LANG": "C.UTF-8"}
    result = subprocess.run(["node", str(CODEX), "exec", "--skip-git-repo-check", "--json", "--ephemeral",
                             "Weather in Paris?"], env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    calls = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "mcp_tool_call"]
    assert calls and calls[0]["server"] == "weather" and calls[0]["tool"] == "get_forecast", events
    assert calls[0]["status"] == "completed" and calls[0]["arguments"] == {"city": "Paris"}, calls
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    assert messages == ["It is sunny."], events
    assert TOOL_OUTPUT in last_prompt(srv)  # the tool's output, in the second turn's prompt


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None or not CODEX.is_file(),
                    reason="Codex is not installed: npm ci --prefix tests/clients/codex")
def test_codex_view_image_output_reaches_a_text_only_model_as_a_note(fake_server, tmp_path: Path) -> None:
    """Codex's view_image answers with the image in the tool's output; a text-only model gets a note
    (server/tool_images.py) and the turn goes on (it was a 400 that ended Codex's turn)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    image = work / "plot.png"
    image.write_bytes(base64.b64decode(PNG_1X1))
    call = f'<tool_call>\n{{"name": "view_image", "arguments": {{"path": "{image}"}}}}\n</tool_call><|end|>'
    srv = server(fake_server, call, turn_engine(HERMES_TEMPLATE, call, "A plot.<|end|>", done_marker=IMAGE_NOTE))
    (home / "config.toml").write_text(
        'model = "fake-model"\nmodel_provider = "specexec"\napproval_policy = "never"\n\n'
        f'[model_providers.specexec]\nname = "SpecExec"\nbase_url = "{srv.url}/v1"\nenv_key = "SPECEXEC_API_KEY"\n'
        'wire_api = "responses"\n')
    env = {"PATH": str(Path(shutil.which("node") or "node").parent) + ":/usr/bin:/bin", "HOME": str(home),
           "CODEX_HOME": str(home), "SPECEXEC_API_KEY": "unused", "LANG": "C.UTF-8"}
    result = subprocess.run(["node", str(CODEX), "exec", "--skip-git-repo-check", "--json", "--ephemeral",
                             "What is in plot.png?"], env=env, cwd=work, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    assert messages == ["A plot."], events
    assert IMAGE_NOTE in last_prompt(srv) and "iVBOR" not in last_prompt(srv)
