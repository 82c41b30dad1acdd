"""Tool-call readers of one format fed as a client would see them (tests of the XML-like formats:
qwen3_coder, glm45): the content and the calls, with arguments parsed as strict JSON."""

from __future__ import annotations

import json
from typing import Any

from server.toolcalls.detect import ToolSupport
from server.toolcalls.output import ToolOutput
from server.toolcalls.parsers import FORMATS
from tests.helpers.tool_models import tool_tokenizer

Calls = list[tuple[str, dict[str, Any]]]


def read_calls(fmt: str, schemas: dict[str, Any], pieces: list[str], eager: bool,
               cut_off: bool = False) -> tuple[str | None, Calls, list[dict]]:
    """`pieces` through format `fmt`'s reader (streamed when `eager`): (content, None when only calls;
    the calls; the raw tool-call entries)."""
    out = ToolOutput(FORMATS[fmt], eager=eager, schemas=schemas)
    deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish("length" if cut_off else "stop")
    content = "".join(d.content for d in deltas if d.content is not None)
    entries = [d.tool_call for d in deltas if d.tool_call is not None]
    names = {e["index"]: e["function"]["name"] for e in entries if "id" in e}
    arguments = {i: "".join(e["function"]["arguments"] for e in entries if e["index"] == i) for i in names}
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]  # strict JSON: raises if not
    return (content if content or not calls else None), calls, entries


def read_whole(fmt: str, schemas: dict[str, Any], text: str) -> tuple[str | None, Calls]:
    content, calls = ToolOutput(FORMATS[fmt], eager=False, schemas=schemas).message(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


def support(template: str, tool_parser: str = "auto") -> ToolSupport:
    return ToolSupport.detect(tool_tokenizer(template), template, tool_parser)
