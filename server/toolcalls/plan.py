"""One chat request's tool handling: what to render, which grammar the output follows, how to read it.

`plan_tools(support, request)`:
- no tools, `tool_choice: "none"`, or a model whose template cannot render tools with
  `tool_choice` auto: None, plain text (tools are not rendered);
- `tool_choice` "required" or a named function on such a model: a 400 naming `tool_choice`;
- otherwise a `ToolPlan`: the tools rendered into the prompt, the grammar of the calls
  (server/toolcalls/grammar.py; with "auto" it also takes the request's response_format for a
  reply that is not a call), and at most one call for `parallel_tool_calls: false` or a named
  function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.types import StructuredOutput
from server.errors import APIError, invalid_request, unsupported
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.toolcalls.detect import ToolSupport
from server.toolcalls.grammar import Format, text_format, tool_call_grammar
from server.toolcalls.output import ToolOutput
from server.toolcalls.parsers import ToolFormat
from server.toolcalls.render import tool_schemas


@dataclass(frozen=True)
class ToolPlan:
    format: ToolFormat
    tools: list[dict[str, Any]]  # as the chat template reads them
    grammar: StructuredOutput  # every call the output holds is valid under it
    max_calls: int | None
    drop_ids: frozenset[int] | None  # for the TextStream (server/detok.py)
    schemas: dict[str, Any] = field(default_factory=dict)  # tool name -> `parameters` (types XML values)

    def output(self, eager: bool) -> ToolOutput:
        """A reader of one choice's output (eager: streamed)."""
        return ToolOutput(self.format, eager=eager, max_calls=self.max_calls, schemas=self.schemas)


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
    callable_tools = [(tool.function.name, tool.function.parameters) for tool in request.tools
                      if function is None or tool.function.name == function]
    grammar = tool_call_grammar(support.format.name, callable_tools, forced=forced, single=single,
                                text=None if forced else _reply_format(request),
                                special_tokens=support.grammar_tokens, named_args=support.named_args)
    return ToolPlan(
        format=support.format,
        tools=tool_schemas(request.tools),
        grammar=grammar,
        max_calls=1 if single else None,
        drop_ids=support.drop_ids,
        schemas={tool.function.name: tool.function.parameters or {} for tool in request.tools},
    )


def _reply_format(request: ChatCompletionRequest) -> Format | None:
    """The request's response_format (or guided_*) as the format of a reply that is not a call."""
    reply = request.structured_output()
    if reply is None:
        return None
    param, spec = reply
    try:
        return text_format(spec.kind, spec.spec)
    except ValueError as exc:
        raise invalid_request(f"Invalid '{param}': the JSON schema is not JSON ({exc}).", param, "invalid_value") from None


def _cannot_force(choice: Any, reason: str) -> APIError:
    wanted = "a tool call" if choice == "required" else f"a call of '{choice.function.name}'"
    return unsupported("tool_choice", f"tool_choice asks for {wanted}, but this model cannot call tools: {reason}. "
                                      "Use tool_choice 'auto' or 'none' (the reply is then plain text).")
