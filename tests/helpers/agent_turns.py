"""Agent CLIs (Codex, Claude Code) against a scripted server: a stdio MCP server with one tool, and a
FakeEngine that calls it until the prompt holds its output, then answers."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import tool_tokenizer

CLIENTS = Path(__file__).resolve().parents[1] / "clients"
CODEX = CLIENTS / "codex" / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
CLAUDE = CLIENTS / "claude_code" / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
TOOL_OUTPUT = "forecast for Paris: sunny, 21 C"  # what the MCP tool answers for {"city": "Paris"}

MCP_SERVER = '''
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    reply = {"jsonrpc": "2.0", "id": msg.get("id")}
    if msg.get("method") == "initialize":
        reply["result"] = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                           "serverInfo": {"name": "weather", "version": "1"}}
    elif msg.get("method") == "tools/list":
        reply["result"] = {"tools": [{"name": "get_forecast", "description": "Forecast for a city",
                                      "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]}}]}
    elif msg.get("method") == "tools/call":
        city = msg["params"]["arguments"]["city"]
        reply["result"] = {"content": [{"type": "text", "text": f"forecast for {city}: sunny, 21 C"}]}
    elif "id" not in msg:
        continue
    else:
        reply["result"] = {}
    print(json.dumps(reply), flush=True)
'''


class TurnScripts(FakeEngine):
    """Calls the tool, or answers once the prompt holds the tool's output (whatever probes Codex sends), or
    after a few requests (a call that failed: the test then fails instead of looping)."""

    call_ids: list[int]
    answer_ids: list[int]
    done_marker = "forecast for"  # in the prompt once the tool's output came back
    _seen: tuple[int, bool] = (-1, False)  # (id of the last request read, whether it holds the output)

    @property
    def script_ids(self) -> list[int]:
        request = self.requests[-1]
        if self._seen[0] != id(request):
            answer = self.done_marker in self.tokenizer.decode(request.prompt_ids) or len(self.requests) > 4
            self._seen = (id(request), answer)
        return self.answer_ids if self._seen[1] else self.call_ids

    @script_ids.setter
    def script_ids(self, ids: list[int]) -> None:
        pass




def turn_engine(template: str, call: str, answer: str, done_marker: str = TurnScripts.done_marker) -> TurnScripts:
    """A TurnScripts writing `call` (a tool call in the template's format) then `answer`, once the prompt
    holds `done_marker`."""
    tokenizer = tool_tokenizer(template)
    engine = TurnScripts(tokens_per_step=64, max_context=400_000)
    engine.tokenizer = tokenizer
    engine.eos_token_ids = frozenset({tokenizer.eos_token_id})
    engine.call_ids = tokenizer.encode(call, add_special_tokens=False)
    engine.answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    engine.done_marker = done_marker
    return engine
