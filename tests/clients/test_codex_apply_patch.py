"""OpenAI's Codex CLI edits a file through its `apply_patch` custom tool over /v1/responses, where node and
Codex are installed (`npm ci --prefix tests/clients/codex`).

Codex 0.171 offers `apply_patch` as a custom (freeform) tool with a lark grammar to the models its catalog
marks `"apply_patch_tool_type": "freeform"` (its own GPT-5.5 and later), and no apply_patch tool to models it
has no metadata for (the shell then edits files). Here a `model_catalog_json` marks the served model so,
and a scripted engine plays the model: the first turn calls apply_patch with a patch that adds a file,
the turn after the tool's output answers in text. The built-in pair cannot write a patch; the plumbing is
what is checked: the custom tool offered as a function, its call returned as a `custom_tool_call` that
Codex runs, and the `custom_tool_call` / `custom_tool_call_output` items it sends back rendered as a tool
call and its result.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig, LimitsConfig
from engine.types import Request
from server.app import build_app
from server.config import ServerConfig
from tests.api.conftest import free_port, run_uvicorn
from tests.clients.test_agent_clis import CODEX, base_env, run
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import HERMES_TEMPLATE, tool_tokenizer

pytestmark = [pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
              pytest.mark.skipif(not CODEX.is_file(),
                                 reason="Codex is not installed: npm ci --prefix tests/clients/codex")]

MODEL = "fake-model"
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello from apply_patch\n*** End Patch\n"
CALL = ('<tool_call>\n{"name": "apply_patch", "arguments": ' + json.dumps({"input": PATCH}) + "}\n</tool_call><|end|>")
REPLY = "Created hello.txt.<|end|>"
# the fields Codex 0.171 requires of a catalog entry; apply_patch_tool_type makes apply_patch a custom tool
CATALOG_ENTRY = {"slug": MODEL, "display_name": MODEL, "apply_patch_tool_type": "freeform",
                 "base_instructions": "You are a coding agent.", "supported_reasoning_levels": [],
                 "shell_type": "shell_command", "visibility": "list", "supported_in_api": True, "priority": 1,
                 "support_verbosity": False, "truncation_policy": {"mode": "tokens", "limit": 10000},
                 "experimental_supported_tools": []}


class TurnEngine(FakeEngine):
    """Calls apply_patch until a tool result is in the prompt, then replies in text."""

    def output_ids(self, request: Request, count: int) -> list[int]:
        prompt = self.tokenizer.decode(request.prompt_ids)
        script = REPLY if "<tool_response>" in prompt else CALL
        return self.tokenizer.encode(script, add_special_tokens=False)[:count]


@pytest.fixture
def scripted_server() -> Iterator[tuple[str, TurnEngine]]:
    engine = TurnEngine(tokens_per_step=16, max_context=200_000)
    engine.tokenizer = tool_tokenizer(HERMES_TEMPLATE)
    engine.eos_token_ids = frozenset({engine.tokenizer.eos_token_id})
    port = free_port()
    app = build_app(EngineConfig(limits=LimitsConfig(max_queue=4, default_max_tokens=1024)),
                    ServerConfig(port=port), engine)
    server, thread = run_uvicorn(app, port)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=15)


def test_codex_applies_a_patch_through_the_custom_apply_patch_tool(scripted_server: Any, tmp_path: Path) -> None:
    url, engine = scripted_server
    home, workdir = tmp_path / "codex_home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    catalog = home / "catalog.json"
    catalog.write_text(json.dumps({"models": [CATALOG_ENTRY]}))
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "specexec"\nmodel_catalog_json = "{catalog}"\n\n'
        f'[model_providers.specexec]\nname = "SpecExec"\nbase_url = "{url}/v1"\nenv_key = "SPECEXEC_API_KEY"\n'
        'wire_api = "responses"\n')
    env = base_env(home) | {"CODEX_HOME": str(home), "SPECEXEC_API_KEY": "unused"}
    out = run(["node", str(CODEX), "exec", "--skip-git-repo-check", "--json", "--ephemeral",
               "--dangerously-bypass-approvals-and-sandbox", "Add hello.txt"], env, workdir)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kinds = [event["type"] for event in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, events
    assert (workdir / "hello.txt").read_text() == "Hello from apply_patch\n", events
    changes = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "file_change"]
    assert changes and changes[0]["status"] == "completed", events
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message"]
    assert messages[-1] == "Created hello.txt.", events
    first, second = (engine.tokenizer.decode(r.prompt_ids) for r in engine.requests[:2])
    assert '{"name": "apply_patch", "description": ' in first and '"properties": {"input": {"type": "string"' in first
    assert CALL.removesuffix("<|end|>") in second  # the custom_tool_call and custom_tool_call_output Codex sent
    assert "Success. Updated the following files:\nA hello.txt\n" in second.split("<tool_response>")[1]
