"""An Open WebUI-shaped chat request (its ~36 built-in tool definitions, no tool_choice, streamed)
against the built-in default pair, whose chat template renders no tools: 200 and a text reply."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig, ModelConfig
from tests.helpers.sse_helpers import assert_stream_invariants, post_stream

pytestmark = pytest.mark.slow

DEFAULT_PAIR = Path(__file__).resolve().parents[2] / "models" / "default"

# name -> (description, {parameter: (type, description)}, required)
OPEN_WEBUI_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], list[str]]] = {
    "search_web": ("Search the public web.", {"query": ("string", "search terms"), "count": ("integer", "results")},
                   ["query"]),
    "fetch_url": ("Fetch a web page as text.", {"url": ("string", "the address")}, ["url"]),
    "query_knowledge_files": ("Search the attached knowledge files.", {"query": ("string", "what to find")},
                              ["query"]),
    "view_knowledge_file": ("Read one knowledge file.", {"file_id": ("string", "file id")}, ["file_id"]),
    "search_knowledge_bases": ("Search knowledge bases.", {"query": ("string", "terms")}, ["query"]),
    "list_knowledge_bases": ("List knowledge bases.", {}, []),
    "get_current_timestamp": ("The current date and time.", {}, []),
    "calculate_timestamp": ("Add a duration to a date.", {"base": ("string", "ISO date"),
                                                          "days": ("integer", "days to add")}, ["base"]),
    "search_notes": ("Search the user's notes.", {"query": ("string", "terms")}, ["query"]),
    "view_note": ("Read a note.", {"note_id": ("string", "note id")}, ["note_id"]),
    "write_note": ("Create a note.", {"title": ("string", "title"), "content": ("string", "markdown")},
                   ["title", "content"]),
    "replace_note_content": ("Replace a note's text.", {"note_id": ("string", "id"), "content": ("string", "text")},
                             ["note_id", "content"]),
    "search_chats": ("Search past chats.", {"query": ("string", "terms")}, ["query"]),
    "view_chat": ("Read a past chat.", {"chat_id": ("string", "chat id")}, ["chat_id"]),
    "generate_image": ("Generate an image.", {"prompt": ("string", "description")}, ["prompt"]),
    "edit_image": ("Edit an image.", {"image_id": ("string", "id"), "prompt": ("string", "edit")},
                   ["image_id", "prompt"]),
    "execute_code": ("Run Python code.", {"code": ("string", "source")}, ["code"]),
    "search_memories": ("Search saved memories.", {"query": ("string", "terms")}, ["query"]),
    "add_memory": ("Save a memory.", {"content": ("string", "what to remember")}, ["content"]),
    "replace_memory_content": ("Change a memory.", {"memory_id": ("string", "id"), "content": ("string", "text")},
                               ["memory_id", "content"]),
    "delete_memory": ("Delete a memory.", {"memory_id": ("string", "id")}, ["memory_id"]),
    "list_memories": ("List saved memories.", {}, []),
    "search_channels": ("Search channels.", {"query": ("string", "terms")}, ["query"]),
    "get_channel_messages": ("Read a channel.", {"channel_id": ("string", "id"), "limit": ("integer", "count")},
                             ["channel_id"]),
    "send_channel_message": ("Post to a channel.", {"channel_id": ("string", "id"), "text": ("string", "body")},
                             ["channel_id", "text"]),
    "list_models": ("List the available models.", {}, []),
    "get_user_info": ("The signed-in user's profile.", {}, []),
    "get_weather": ("Weather for a place.", {"location": ("string", "city")}, ["location"]),
    "convert_units": ("Convert a quantity.", {"value": ("number", "amount"), "from_unit": ("string", "unit"),
                                              "to_unit": ("string", "unit")}, ["value", "from_unit", "to_unit"]),
    "calculator": ("Evaluate arithmetic.", {"expression": ("string", "e.g. 2*(3+4)")}, ["expression"]),
    "translate_text": ("Translate text.", {"text": ("string", "text"), "target": ("string", "language")},
                       ["text", "target"]),
    "summarize_url": ("Summarise a web page.", {"url": ("string", "address")}, ["url"]),
    "youtube_transcript": ("Fetch a video's transcript.", {"url": ("string", "video address")}, ["url"]),
    "list_files": ("List the user's uploaded files.", {}, []),
    "read_file": ("Read an uploaded file.", {"file_id": ("string", "id")}, ["file_id"]),
    "create_calendar_event": ("Add a calendar event.", {"title": ("string", "title"), "start": ("string", "ISO"),
                                                         "end": ("string", "ISO")}, ["title", "start"]),
}


def open_webui_tools() -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "required": required,
                           "properties": {p: {"type": t, "description": d} for p, (t, d) in params.items()}}}}
        for name, (description, params, required) in OPEN_WEBUI_TOOLS.items()
    ]


def open_webui_body(model: str) -> dict[str, Any]:
    """What Open WebUI sends for a chat message with default settings: its tools, no tool_choice, stream."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "def fibonacci(n):"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": open_webui_tools(),
    }


@pytest.fixture(scope="module")
def default_pair_engine() -> Any:
    from engine.runtime import Engine

    config = EngineConfig(model=ModelConfig(target=str(DEFAULT_PAIR / "target"), draft=str(DEFAULT_PAIR / "draft"),
                                            name="specexec-default"))
    return Engine.load(config)


def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/health", timeout=10).status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def test_open_webui_request_gets_a_streamed_text_reply(fake_server: Callable, default_pair_engine: Any) -> None:
    assert len(OPEN_WEBUI_TOOLS) == 36
    srv = fake_server(default_pair_engine)
    wait_ready(srv.url)
    assert srv.state.prompt.tools.format is None  # the built-in pair's template renders no tools
    stream = post_stream(srv.url + "/v1/chat/completions", open_webui_body("specexec-default"), timeout=120)
    text = assert_stream_invariants(stream, chat=True, include_usage=True)
    assert stream.status == 200 and text.strip()
    choice_chunks = [c for c in stream.chunks() if c["choices"]]
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in choice_chunks)
    assert choice_chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = open_webui_body("specexec-default")
    full = client.chat.completions.create(model=body["model"], messages=body["messages"], tools=body["tools"],
                                          temperature=0)
    assert full.choices[0].message.content and full.choices[0].message.tool_calls is None
    assert full.choices[0].finish_reason in ("stop", "length")


def test_open_webui_request_against_specexec_serve(live_server: Any, model_id: str) -> None:
    """The same through a `specexec serve` process (the tiny test pair: no tools in its template either)."""
    stream = post_stream(live_server.url + "/v1/chat/completions", {**open_webui_body(model_id), "max_tokens": 16},
                         timeout=120)
    text = assert_stream_invariants(stream, chat=True, include_usage=True)
    assert stream.status == 200 and text
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in stream.chunks() if c["choices"])
