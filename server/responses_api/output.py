"""Responses API output: the `response` object, its output items, and the stream events that build them.

`OutputItems` turns one generation's deltas (reasoning, content, or tool-call entries:
server/toolcalls/output.py) into output items, `reasoning` (the leading <think> block: server/reasoning.py;
one `reasoning_text` content part, `summary` empty), `message` (one `output_text` part), `function_call`
and `custom_tool_call` (a call of a custom tool: server/responses_api/custom_tools.py), in the order the
model wrote them, and into the typed events OpenAI's SDKs parse: `response.output_item.added`,
`response.content_part.added`, `response.reasoning_text.delta` / `.done` (reasoning),
`response.output_text.delta` / `.done` (message), `response.content_part.done`,
`response.function_call_arguments.delta` / `.done` (`response.custom_tool_call_input.delta` / `.done`),
`response.output_item.done`. The same object serves whole responses (its events unused).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.responses_api.custom_tools import InputReader
from server.toolcalls.output import Delta

Event = tuple[str, dict[str, Any]]  # (type, fields besides type and sequence_number)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(text)]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if status == "in_progress" else [reasoning_part(text)]}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def custom_call_item(item_id: str, call_id: str, name: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "custom_tool_call", "status": status, "call_id": call_id, "name": name,
            "input": text}


@dataclass(frozen=True)
class CallNames:
    """How the model's calls become items: tools offered under these names are custom tools (custom_tool_call
    items), and qualified names of a namespace's tools -> (namespace, name) (server/responses_api/namespaces.py)."""

    custom: frozenset[str] = frozenset()
    members: dict[str, tuple[str, str]] = field(default_factory=dict)


class OutputItems:
    def __init__(self, names: CallNames | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._text: list[str] | None = None  # the open message's text
        self._reasoning: list[str] | None = None  # the open reasoning item's text
        self._call_items: dict[int, int] = {}  # tool-call index -> output index
        self._names = names or CallNames()
        self._inputs: dict[int, tuple[InputReader, list[str]]] = {}  # output index -> (reader, arguments so far)

    def feed(self, delta: Delta) -> list[Event]:
        """Events of one delta; an item is done (its `.done` events sent) before the next one is added."""
        if delta.reasoning is not None:
            return self._close_message("completed") + self._close_calls() + self._reasoning_text(delta.reasoning) \
                if delta.reasoning else []
        if delta.content is not None:
            return self._close_reasoning("completed") + self._close_calls() + self._content(delta.content) \
                if delta.content else []
        assert delta.tool_call is not None
        entry = delta.tool_call
        events = self._close_reasoning("completed") + self._close_message("completed")
        if "id" in entry:  # a call starts
            events += self._close_calls()
            index = len(self.items)
            self._call_items[entry["index"]] = index
            self.items.append(self._call_item(index, entry["id"], entry["function"]["name"]))
            events.append(("response.output_item.added", {"output_index": index, "item": dict(self.items[index])}))
            return events
        index = self._call_items[entry["index"]]
        item, fragment = self.items[index], entry["function"]["arguments"]
        if index in self._inputs:
            reader, arguments = self._inputs[index]
            arguments.append(fragment)
            return events + self._input_delta(index, reader.feed(fragment))
        item["arguments"] += fragment
        events.append(("response.function_call_arguments.delta",
                       {"item_id": item["id"], "output_index": index, "delta": fragment}))
        return events

    def _call_item(self, index: int, call_id: str, name: str) -> dict[str, Any]:
        if name not in self._names.custom:
            item = call_item(new_id("fc"), call_id, name, "", "in_progress")
        else:
            self._inputs[index] = (InputReader(), [])
            item = custom_call_item(new_id("ctc"), call_id, name, "", "in_progress")
        if name in self._names.members:  # a namespace's tool: its own name, and the namespace
            item["namespace"], item["name"] = self._names.members[name]
        return item

    def _input_delta(self, index: int, text: str) -> list[Event]:
        if not text:
            return []
        item = self.items[index]
        item["input"] += text
        return [("response.custom_tool_call_input.delta", {"item_id": item["id"], "output_index": index,
                                                            "delta": text})]

    def close(self, status: str) -> list[Event]:
        """End of output (`status`: "completed" or "incomplete"): close what is open; a response always
        has at least one item (an empty message when the model wrote nothing; reasoning alone, as when
        max_output_tokens cut it off, is left alone, as OpenAI's)."""
        events = self._close_reasoning(status)
        if not self.items:
            events += self._content("")
        return events + self._close_message(status) + self._close_calls()

    def _close_calls(self) -> list[Event]:
        """The `.done` events of the calls still open (at most one: calls come one after another)."""
        events: list[Event] = []
        for index in self._call_items.values():
            item = self.items[index]
            if item["status"] != "in_progress":
                continue
            if index in self._inputs:
                events += self._close_input(index)
            else:
                events.append(("response.function_call_arguments.done",
                               {"item_id": item["id"], "output_index": index, "name": item["name"],
                                "arguments": item["arguments"]}))
            item["status"] = "completed"
            events.append(("response.output_item.done", {"output_index": index, "item": dict(item)}))
        return events

    def _close_input(self, index: int) -> list[Event]:
        """A custom call's input is whole: what its arguments hold beyond what was sent is sent first."""
        reader, arguments = self._inputs[index]
        item, whole = self.items[index], reader.finish("".join(arguments))
        sent = item["input"]
        events = self._input_delta(index, whole[len(sent):]) if whole.startswith(sent) else []
        item["input"] = whole
        return events + [("response.custom_tool_call_input.done",
                          {"item_id": item["id"], "output_index": index, "input": whole})]

    def _reasoning_text(self, text: str) -> list[Event]:
        events: list[Event] = []
        index = len(self.items) - 1
        if self._reasoning is None:
            index = len(self.items)
            self.items.append(reasoning_item(new_id("rs"), "", "in_progress"))
            self._reasoning = []
            events += [("response.output_item.added", {"output_index": index, "item": dict(self.items[index])}),
                       ("response.content_part.added", {"item_id": self.items[index]["id"], "output_index": index,
                                                        "content_index": 0, "part": reasoning_part("")})]
        self._reasoning.append(text)
        events.append(("response.reasoning_text.delta", {"item_id": self.items[index]["id"], "output_index": index,
                                                         "content_index": 0, "delta": text}))
        return events

    def _close_reasoning(self, status: str) -> list[Event]:
        if self._reasoning is None:
            return []
        index = len(self.items) - 1
        item = self.items[index]
        text, self._reasoning = "".join(self._reasoning), None
        self.items[index] = reasoning_item(item["id"], text, status)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [("response.reasoning_text.done", where | {"text": text}),
                ("response.content_part.done", where | {"part": reasoning_part(text)}),
                ("response.output_item.done", {"output_index": index, "item": self.items[index]})]

    def _content(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._text is None:
            index = len(self.items)
            self.items.append(message_item(new_id("msg"), "", "in_progress"))
            self._text = []
            item_id = self.items[index]["id"]
            events += [("response.output_item.added", {"output_index": index, "item": dict(self.items[index])}),
                       ("response.content_part.added", {"item_id": item_id, "output_index": index,
                                                        "content_index": 0, "part": text_part("")})]
        self._text.append(text)
        if text:
            index = len(self.items) - 1
            events.append(("response.output_text.delta", {"item_id": self.items[index]["id"], "output_index": index,
                                                          "content_index": 0, "delta": text, "logprobs": []}))
        return events

    def _close_message(self, status: str) -> list[Event]:
        if self._text is None:
            return []
        index = len(self.items) - 1
        item = self.items[index]
        text, self._text = "".join(self._text), None
        self.items[index] = message_item(item["id"], text, status)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [("response.output_text.done", where | {"text": text, "logprobs": []}),
                ("response.content_part.done", where | {"part": text_part(text)}),
                ("response.output_item.done", {"output_index": index, "item": self.items[index]})]


@dataclass
class ResponseHead:
    """What every snapshot of one response shares; `fields` echoes the request's settings."""

    model: str
    fields: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, *,
             incomplete: bool = False, error: dict[str, Any] | None = None,
             timings: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "model": self.model, "output": output, "usage": usage} | self.fields
        if timings is not None:
            body["timings"] = timings
        return body


def response_fields(request: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The request's settings as a response object echoes them."""
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format \
        else {"type": "text"}
    choice = request.tool_choice
    reasoning = getattr(request, "reasoning", None)
    return {
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
        "tools": tools, "text": {"format": fmt}, "store": request.store is not False,
        "metadata": request.metadata or {}, "user": request.user, "truncation": "disabled",
        "reasoning": {"effort": reasoning.effort if reasoning else None, "summary": reasoning.summary if reasoning else None},
        "background": False, "service_tier": "default",
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int) -> dict[str, Any]:
    """`reasoning_tokens`: of the output tokens, the reasoning's (server/reasoning_tokens.py; Codex shows it)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}
