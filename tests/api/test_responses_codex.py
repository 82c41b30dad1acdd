"""/v1/responses as OpenAI's Codex CLI (0.171) sends it: developer messages, tools of other types than
`function` (namespace, web_search, image_generation, custom), `strict: false`, `store: false` with
`include: ["reasoning.encrypted_content"]`, `reasoning`, `prompt_cache_key`, `client_metadata`, probes with
`max_output_tokens: 1`, and a previous_response_id of a response that was not stored."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from tests.helpers.tool_models import HERMES_TEMPLATE, scripted_engine, tool_tokenizer

EXEC_COMMAND = {"type": "function", "name": "exec_command", "strict": False,
                "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
                "parameters": {"type": "object", "properties": {
                    "cmd": {"type": "string", "description": "Shell command to execute."},
                    "workdir": {"type": "string"}, "yield_time_ms": {"type": "number"}},
                    "required": ["cmd"], "additionalProperties": False}}
CODEX_TOOLS = [EXEC_COMMAND,
               {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
                   {"type": "function", "name": "spawn_agent", "strict": False,
                    "parameters": {"type": "object", "properties": {}}}]},
               {"type": "web_search", "external_web_access": False},
               {"type": "image_generation", "output_format": "png"},
               {"type": "custom", "name": "apply_patch", "description": "Edit files.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]
CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call><|end|>'


def codex_body(input_items: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "instructions": "", "input": input_items, "tools": CODEX_TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0192-session",
            "client_metadata": {"thread_id": "0192-session"}} | fields


def first_turn() -> list[dict[str, Any]]:
    return [{"type": "message", "id": "msg_1", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
            {"type": "message", "id": "msg_2", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"}]},
            {"type": "message", "id": "msg_3", "role": "user", "content": [{"type": "input_text", "text": "List files"}]}]


def events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines() if line.startswith("data: ")]


def server(fake_server: Callable, script: str) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script, tokens_per_step=3))


def test_a_codex_turn_with_its_tools_and_store_false(fake_server) -> None:
    srv = server(fake_server, CALL)
    stream = events(httpx.post(srv.url + "/v1/responses", json=codex_body(first_turn(), max_output_tokens=300),
                               timeout=30))
    assert stream[0]["type"] == "response.created" and stream[-1]["type"] == "response.completed"
    final = stream[-1]["response"]
    call = next(item for item in final["output"] if item["type"] == "function_call")
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": "ls"}
    prompt = srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)
    assert '"name": "exec_command"' in prompt and "spawn_agent" not in prompt and '"name": "apply_patch"' in prompt
    assert prompt.index("You are a coding agent") < prompt.index("List files") and final["store"] is False
    # the next turn, as Codex sends it: the whole history again (store is false), the call and its output
    srv.engine.script_ids = srv.engine.tokenizer.encode("Two files.<|end|>", add_special_tokens=False)
    history = first_turn() + [
        {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        {"type": "function_call", "name": "exec_command", "arguments": call["arguments"], "call_id": call["call_id"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py\nb.py"}]
    second = events(httpx.post(srv.url + "/v1/responses", json=codex_body(history), timeout=30))
    assert second[-1]["type"] == "response.completed"
    assert second[-1]["response"]["output"][0]["content"][0]["text"] == "Two files."
    prompt = srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)
    assert "<tool_response>\na.py\nb.py\n</tool_response>" in prompt
    # a previous_response_id of the unstored response: a clean 404, not a 500
    missing = httpx.post(srv.url + "/v1/responses", timeout=30, json=codex_body(
        [{"role": "user", "content": "more"}], previous_response_id=final["id"], stream=False))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "previous_response_not_found"


def test_probes_with_max_output_tokens_1(fake_server) -> None:
    srv = server(fake_server, "Hello there.<|end|>")
    probe = codex_body([{"role": "user", "content": "hi"}], max_output_tokens=1)
    whole = httpx.post(srv.url + "/v1/responses", json=probe | {"stream": False}, timeout=30).json()
    assert whole["status"] == "incomplete" and whole["usage"]["output_tokens"] == 1
    streamed = events(httpx.post(srv.url + "/v1/responses", json=probe, timeout=30))
    assert streamed[-1]["type"] == "response.incomplete" and streamed[-1]["response"]["usage"]["output_tokens"] == 1
    assert srv.engine.requests[-1].params.max_tokens == 1
