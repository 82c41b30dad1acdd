"""Raw SSE reading for wire-format assertions (the openai SDK hides the framing)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RawStream:
    status: int
    headers: httpx.Headers
    text: str
    data: list[str] = field(default_factory=list)  # `data:` payloads in order ([DONE] included)
    comments: list[str] = field(default_factory=list)

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for d in self.data if d != "[DONE]"]


def parse_sse(text: str) -> tuple[list[str], list[str]]:
    data: list[str] = []
    comments: list[str] = []
    for event in text.split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data: "):
                data.append(line[len("data: ") :])
            elif line.startswith(":"):
                comments.append(line[1:].strip())
            else:
                assert line == "", f"unexpected SSE line {line!r}"
    return data, comments


def post_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                timeout: float = 60.0) -> RawStream:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
        text = "".join(response.iter_text())
    data, comments = parse_sse(text) if response.status_code == 200 else ([], [])
    return RawStream(response.status_code, response.headers, text, data, comments)


def assert_stream_invariants(stream: RawStream, chat: bool, include_usage: bool) -> str:
    """api.md's stream rules; returns the streamed text."""
    assert stream.status == 200 and stream.headers["content-type"].startswith("text/event-stream")
    assert stream.data[-1] == "[DONE]" and stream.data.count("[DONE]") == 1
    assert stream.text.endswith("data: [DONE]\n\n")
    chunks = stream.chunks()
    object_name = "chat.completion.chunk" if chat else "text_completion"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert {c["model"] for c in chunks} == {chunks[0]["model"]}
    assert all(c["object"] == object_name for c in chunks)
    choice_chunks = [c for c in chunks if c["choices"]]
    usage_chunks = [c for c in chunks if "usage" in c]
    if include_usage:
        assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1]["choices"] == []
        usage = usage_chunks[0]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        assert not usage_chunks and len(choice_chunks) == len(chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length")
    last = choice_chunks[-1]
    assert "timings" in last and last["timings"]["target_passes"] >= 1
    if chat:
        assert choice_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert last["choices"][0]["delta"] == {}
        middle = [c["choices"][0]["delta"] for c in choice_chunks[1:-1]]
        assert all(set(d) == {"content"} for d in middle)
        return "".join(d["content"] for d in middle)
    assert last["choices"][0]["text"] == ""
    return "".join(c["choices"][0]["text"] for c in choice_chunks)
