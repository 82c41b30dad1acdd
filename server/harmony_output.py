"""A harmony model's chat requests (GPT-OSS): the plan, the reader of a choice's output, past turns.

`plan_harmony` gives every chat request of a harmony model a `HarmonyPlan` (server/harmony.py reads its
output): the request's tools, rendered by the model's own template in its `namespace functions` form,
with `tool_choice` "required" or a named function the forced call's grammar (`forced_call`: the analysis
may come first, then one call in the commentary channel), and the special ids to drop while the harmony
markers stay in the decoded text. `analysis_first`: a `response_format` grammar after the analysis.

`HarmonyOutput` stands where a `ToolOutput` (server/toolcalls/output.py) stands in a Generation:
`feed` / `finish` give `Delta`s, reasoning among them (analysis channel), `finish_reason` is
"tool_calls" after a call, and `whole` gives a reply's (reasoning, content, tool calls). Streamed
(`eager`), a call's arguments go out as they come; whole, a call is sent once its message ended, and a
call cut off by max_tokens (finish reason "length") is content instead (its arguments text, never a
call with broken JSON). Without tools in the request, a call's arguments are content.

`harmony_conversation`: the messages as GPT-OSS's template reads them: an assistant turn's reasoning
(`reasoning_content`; Anthropic thinking blocks, Ollama `thinking`) as `thinking`; with tool calls,
the template takes thinking or content, not both, so the content is left out then.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.types import ReasoningBlock, StructuredOutput
from server.errors import unsupported
from server.harmony import CHANNEL, CONSTRAIN, END, FUNCTIONS, MARKERS, MESSAGE, START, HarmonyReader
from server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from server.toolcalls.detect import special_ids
from server.toolcalls.grammar import arguments
from server.toolcalls.output import Delta, collect, new_call_id
from server.toolcalls.render import conversation, tool_schemas


@dataclass(frozen=True)
class HarmonyPlan:
    tools: list[dict[str, Any]] | None  # as the chat template reads them; None: none rendered
    max_calls: int | None  # parallel_tool_calls false: the first call only
    drop_ids: frozenset[int]  # for the TextStream (server/detok.py): the special ids but the markers
    reasoning: bool  # False (--reasoning-format none): analysis is content
    grammar: StructuredOutput | None = None  # tool_choice required / named: the forced call (forced_call)

    def output(self, eager: bool) -> HarmonyOutput:
        """A reader of one choice's output (eager: streamed)."""
        return HarmonyOutput(calls=self.tools is not None, eager=eager, max_calls=self.max_calls,
                             reasoning=self.reasoning)


# a structured reply's reasoning: the analysis message, then the final message's header
ANALYSIS_BLOCK = ReasoningBlock(f"{CHANNEL}analysis{MESSAGE}", f"{END}{START}assistant{CHANNEL}final{MESSAGE}")


def analysis_first(spec: StructuredOutput) -> StructuredOutput:
    """`spec` for the final channel of a harmony reply: the analysis message may come first (GPT-OSS reasons,
    then answers under the grammar, as vLLM serves it), then the final header; without it, the output is
    `spec`'s alone (a reply with no header is read as content). The markers stay tokens of their text for
    the grammar (engine.types.StructuredOutput.special_tokens)."""
    markers = tuple(dict.fromkeys((*spec.special_tokens, START, END, MESSAGE, CHANNEL)))
    return dataclasses.replace(spec, special_tokens=markers, reasoning=ANALYSIS_BLOCK)


def harmony_drop_ids(tokenizer: Any) -> frozenset[int]:
    """Every special id but the harmony markers' (decoding then keeps the markers as text)."""
    added = tokenizer.get_added_vocab()
    return frozenset(special_ids(tokenizer) - {added[m] for m in MARKERS if m in added})


def plan_harmony(request: ChatCompletionRequest, drop_ids: frozenset[int], *, tools_on: bool,
                 reasoning: bool) -> HarmonyPlan:
    """`tools_on`: False with --tool-parser none (tools are then not rendered)."""
    choice = request.tool_choice
    rendered = tools_on and bool(request.tools) and choice != "none"
    forced = bool(request.tools) and (choice == "required" or isinstance(choice, NamedToolChoice))
    if forced and not tools_on:
        raise unsupported("tool_choice", "tool_choice asks for a call, but this server runs with --tool-parser none "
                                         "(tools are not offered). Use tool_choice 'auto' or 'none'.")
    tools = [(t.function.name, t.function.parameters) for t in request.tools or []
             if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
    return HarmonyPlan(tool_schemas(request.tools) if rendered and request.tools else None,
                       1 if request.parallel_tool_calls is False else None, drop_ids, reasoning,
                       forced_call(tools) if forced else None)


# before a forced call: the analysis message, then the next message's start (the call's header follows)
CALL_ANALYSIS_BLOCK = ReasoningBlock(f"{CHANNEL}analysis{MESSAGE}", f"{END}{START}assistant")


def forced_call(tools: list[tuple[str, dict[str, Any] | None]]) -> StructuredOutput:
    """tool_choice required (`tools`: every tool) or named (one): the analysis message may come first, then
    exactly one call as GPT-OSS's template prints past calls, `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>` and the arguments under the tool's schema; `<|call|>` (a stop token)
    ends it."""
    tags = [{"type": "tag", "begin": f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}",
             "content": arguments(schema), "end": ""} for name, schema in tools]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
           "stop_after_first": True}
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}),
                            special_tokens=(START, END, MESSAGE, CHANNEL, CONSTRAIN), reasoning=CALL_ANALYSIS_BLOCK)


class HarmonyOutput:
    def __init__(self, *, calls: bool, eager: bool, max_calls: int | None = None, reasoning: bool = True):
        self._reader = HarmonyReader(reasoning=reasoning)
        self.reasoning = reasoning  # False (--reasoning-format none): analysis is content
        self._calls = calls  # False: no tools in the request; a call's arguments are content
        self._eager = eager
        self._max_calls = max_calls
        self._ids: list[str] = []  # id of call i
        self._num_started = 0  # calls the model began (max_calls counts these)
        self._pending: tuple[str, list[str]] | None = None  # not eager: the open call's name and arguments

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        for kind, value in self._reader.feed(text):
            out += self._event(kind, value)
        return out

    def finish(self, finish_reason: str | None = None) -> list[Delta]:
        """The deltas left at the end of the output (`finish_reason` "length": it was cut off)."""
        out: list[Delta] = []
        for kind, value in self._reader.finish():
            out += self._event(kind, value)
        return out + self._settle(cut_off=finish_reason == "length")

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def whole(self, text: str, finish_reason: str | None) -> tuple[str | None, str | None, list[dict[str, Any]] | None]:
        """The whole output: (reasoning, None without an analysis message; content, None when only calls
        were made; tool calls, None without any)."""
        reasoning, content, calls = collect(self.feed(text) + self.finish(finish_reason))
        return reasoning, ((content or None) if calls else content), list(calls.values()) or None

    def _event(self, kind: str, value: str) -> list[Delta]:
        if kind == "call":
            out = self._settle(cut_off=False)  # a new message: the one before ended
            self._num_started += 1
            if self._calls and (self._max_calls is None or self._num_started <= self._max_calls):
                if self._eager:
                    return out + [self._start(value)]
                self._pending = (value, [])
            return out
        if kind == "args":
            if not self._calls:
                return [Delta(content=value)]
            if self._pending is not None:
                self._pending[1].append(value)
                return []
            if self._eager and self._num_started == len(self._ids):  # the open call is sent
                return [Delta(tool_call={"index": len(self._ids) - 1, "function": {"arguments": value}})]
            return []  # a call past max_calls
        out = self._settle(cut_off=False)
        return out + [Delta(reasoning=value) if kind == "reasoning" else Delta(content=value)]

    def _settle(self, *, cut_off: bool) -> list[Delta]:
        """Not eager: the open call, whole (its message ended), or its arguments as content (cut off)."""
        if self._pending is None:
            return []
        (name, pieces), self._pending = self._pending, None
        if cut_off:
            return [Delta(content="".join(pieces))] if pieces else []
        start = self._start(name)
        arguments = "".join(pieces)
        return [start] + ([Delta(tool_call={"index": len(self._ids) - 1, "function": {"arguments": arguments}})]
                          if arguments else [])

    def _start(self, name: str) -> Delta:
        """A call's first entry (as ToolOutput's: its arguments follow in entries of their own)."""
        self._ids.append(new_call_id())
        index = len(self._ids) - 1
        return Delta(tool_call={"index": index, "id": self._ids[index], "type": "function",
                                "function": {"name": name, "arguments": ""}})


def harmony_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages for GPT-OSS's template (transformers' conventions plus `thinking`)."""
    out = conversation(messages, None)
    for message, entry in zip(messages, out, strict=True):
        if message.role != "assistant" or not message.reasoning_content:
            continue
        entry["thinking"] = message.reasoning_content
        if message.tool_calls:
            entry["content"] = ""  # the template renders the analysis of a call turn from one or the other
    return out
