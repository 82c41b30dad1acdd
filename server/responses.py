"""OpenAI response and stream-chunk shapes (chat.completion, text_completion and their chunks).

Plain dicts, built exactly as docs/api.md spells them: keys that must be present with
`null` are present, keys that must be absent (`usage` on ordinary chunks) are absent.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one request shares: id, created, model, fingerprint."""

    chat: bool
    model: str
    fingerprint: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", new_request_id(self.chat))

    def _head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def choice(self, index: int, text: str | None, finish_reason: str, logprobs: dict[str, Any] | None = None,
               tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
        """One entry of a response's `choices` (chat: `message.tool_calls` when calls were made,
        `message.reasoning_content` when the reply had a reasoning block: server/reasoning.py)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if tool_calls is not None:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": text}
        return choice | {"logprobs": logprobs, "finish_reason": finish_reason}

    def completion(self, choices: list[dict[str, Any]], usage: dict[str, Any],
                   timings: dict[str, Any]) -> dict[str, Any]:
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": choices, "usage": usage, "timings": timings}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              timings: dict[str, Any] | None = None, index: int = 0,
              logprobs: dict[str, Any] | None = None,
              tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": index, "delta": delta}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or ""}
            head = self._head("text_completion")
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        out = head | {"choices": [choice]}
        if timings is not None:
            out["timings"] = timings
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(object_name) | {"choices": [], "usage": usage}
