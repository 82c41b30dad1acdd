"""One chat request's tool handling: what to render, what to prefill, how to read the output.

`plan_tools(support, request)`:
- no tools, `tool_choice: "none"`, or a model whose template cannot render tools with
  `tool_choice` auto: None, plain text (tools are not rendered);
- `tool_choice` "required" or a named function on such a model: a 400 naming `tool_choice`;
- otherwise a `ToolPlan`: the tools rendered into the prompt, the format's prefill for
  "required" / a named function, and at most one call for `parallel_tool_calls: false` or a
  named function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.errors import APIError, unsupported
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.toolcalls.detect import ToolSupport
from server.toolcalls.output import ToolOutput
from server.toolcalls.parsers import ToolFormat
from server.toolcalls.render import tool_schemas


@dataclass(frozen=True)
class ToolPlan:
    format: ToolFormat
    tools: list[dict[str, Any]]  # as the chat template reads them
    prefill: str  # text after the generation prompt: the model continues it
    max_calls: int | None
    drop_ids: frozenset[int] | None  # for the TextStream (server/detok.py)

    def output(self, eager: bool) -> ToolOutput:
        """A reader of one choice's output (eager: streamed)."""
        return ToolOutput(self.format, eager=eager, prefill=self.prefill, max_calls=self.max_calls)


def plan_tools(support: ToolSupport, request: ChatCompletionRequest) -> ToolPlan | None:
    choice = request.tool_choice
    if not request.tools or choice == "none":
        return None
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if support.format is None:
        if forced:
            raise _cannot_force(choice, support.reason)
        return None
    function = choice.function.name if isinstance(choice, NamedToolChoice) else None
    single = function is not None or request.parallel_tool_calls is False
    return ToolPlan(
        format=support.format,
        tools=tool_schemas(request.tools),
        prefill=support.format.prefill(function) if forced else "",
        max_calls=1 if single else None,
        drop_ids=support.drop_ids,
    )


def _cannot_force(choice: Any, reason: str) -> APIError:
    wanted = "a tool call" if choice == "required" else f"a call of '{choice.function.name}'"
    return unsupported("tool_choice", f"tool_choice asks for {wanted}, but this model cannot call tools: {reason}. "
                                      "Use tool_choice 'auto' or 'none' (the reply is then plain text).")
