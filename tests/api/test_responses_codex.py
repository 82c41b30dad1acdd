"""/v1/responses as OpenAI's Codex CLI (0.171) sends it: developer messages, tools of other types than
`function` (namespace, web_search, image_generation, custom), `strict: false`, `store: false` with
`include: ["reasoning.encrypted_content"]`, `reasoning`, `prompt_cache_key`, `client_metadata`, probes with
`max_output_tokens: 1`, and a previous_response_id of a response that was not stored; and every input item
type current Codex (codex-rs protocol `ResponseItem`) may replay: reasoning with only `encrypted_content`,
`phase` on messages, `namespace` on calls, content-item tool outputs, `local_shell_call`, `web_search_call`,
`image_generation_call`, `tool_search_call` / `_output`, `agent_message`, compaction items, and tools sent
in an `additional_tools` item; with `text.verbosity`, `service_tier` and `reasoning.effort`."""

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
    assert '"name": "exec_command"' in prompt and '"name": "multi_agent_v1__spawn_agent"' in prompt \
        and '"name": "apply_patch"' in prompt
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


def codex_history(call_id: str) -> list[dict[str, Any]]:
    """Every input item type a current Codex (codex-rs protocol ResponseItem) may replay with store false."""
    return first_turn() + [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "**Listing**"}],
         "encrypted_content": "gAAAAB-opaque"},
        {"type": "message", "role": "assistant", "phase": "commentary",
         "content": [{"type": "output_text", "text": "Listing the files."}]},
        {"type": "function_call", "name": "exec_command", "namespace": None, "arguments": '{"cmd": "ls"}',
         "call_id": call_id},
        {"type": "function_call_output", "call_id": call_id,
         "output": [{"type": "input_text", "text": "a.py\nb.py"}, {"type": "encrypted_content",
                                                                   "encrypted_content": "x"}]},
        {"type": "custom_tool_call", "status": "completed", "call_id": "ctc_1", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch"},
        {"type": "custom_tool_call_output", "call_id": "ctc_1", "name": "apply_patch", "output": "Done!"},
        {"type": "local_shell_call", "call_id": "lsh_1", "status": "completed",
         "action": {"type": "exec", "command": ["pwd"], "timeout_ms": 1000, "working_directory": None,
                    "env": None, "user": None}},
        {"type": "function_call_output", "call_id": "lsh_1", "output": "/w"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "weather in Paris"}},
        {"type": "image_generation_call", "id": "ig_1", "status": "completed", "revised_prompt": "a cat",
         "result": "iVBORw0KGgo="},
        {"type": "tool_search_call", "call_id": "ts_1", "status": "completed", "execution": "client",
         "arguments": {"query": "git"}},
        {"type": "tool_search_output", "call_id": "ts_1", "status": "completed", "execution": "client",
         "tools": []},
        {"type": "agent_message", "author": "worker-1", "recipient": "main",
         "content": [{"type": "input_text", "text": "Tests pass."}]},
        {"type": "compaction", "encrypted_content": "cmp-opaque"},
        {"type": "context_compaction", "encrypted_content": "cc-opaque"},
        {"type": "compaction_trigger"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now what?"}]}]


def test_a_current_codex_request_with_every_item_type(fake_server) -> None:
    srv = server(fake_server, "Done.<|end|>")
    body = codex_body(codex_history("call_1"), reasoning={"effort": "medium", "summary": "auto"},
                      text={"verbosity": "low"}, service_tier="priority")
    stream = events(httpx.post(srv.url + "/v1/responses", json=body, timeout=30))
    assert stream[-1]["type"] == "response.completed"
    assert stream[-1]["response"]["reasoning"] == {"effort": "medium", "summary": "auto"}
    prompt = srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)
    turns = prompt[prompt.index("List files"):]  # after the tool definitions
    order = ["Listing the files.", '<tool_call>\n{"name": "exec_command"', "a.py\nb.py", '{"name": "apply_patch"',
             "Done!", '{"name": "local_shell", "arguments": {"command": ["pwd"], "timeout_ms": 1000}}',
             "<tool_response>\n/w\n", "Message from worker-1 to main:\nTests pass.", "Now what?"]
    assert [turns.index(text) for text in order] == sorted(turns.index(text) for text in order)
    for opaque in ("opaque", "weather in Paris", "iVBORw0KGgo"):
        assert opaque not in prompt
    # not streamed, and the same history after a stored response: still a 200
    whole = httpx.post(srv.url + "/v1/responses", json=body | {"stream": False, "store": True}, timeout=30)
    assert whole.status_code == 200 and whole.json()["output"][-1]["content"][0]["text"] == "Done."


def test_tools_sent_in_an_additional_tools_item(fake_server) -> None:
    srv = server(fake_server, CALL)
    tools_item = {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": CODEX_TOOLS}
    body = codex_body([tools_item] + first_turn(), tools=[], max_output_tokens=300)
    final = events(httpx.post(srv.url + "/v1/responses", json=body, timeout=30))[-1]["response"]
    call = next(item for item in final["output"] if item["type"] == "function_call")
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": "ls"}
    prompt = srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)
    assert '"name": "exec_command"' in prompt and '"name": "apply_patch"' in prompt and "at_1" not in prompt
