"""The grammar of a request's tool calls: an xgrammar structural tag built from the tools' schemas
in the model's call format, so every call the model writes is well-formed, names one of the tools
and has arguments valid under that tool's `parameters` (engine kind `structural_tag`).

- `tool_choice` "required": only calls, at least one; a named function: exactly one call of it;
- "auto": text, and once the model opens a call (the format's marker; Llama: a JSON object at the
  start of the reply) the rest of that call is under the grammar; with `response_format`, either
  a reply under that format or calls;
- `parallel_tool_calls: false`: at most one call, and the reply ends after it.

The exact text of a call is fixed (`<tool_call>\\n{"name": "f", "arguments": ...}\\n</tool_call>`,
as the formats' chat templates print past calls; the XML calls: see `_qwen3_coder`, `_glm45`); the
arguments are compact JSON as those templates print them (", " and ": "), or with `--json-whitespace free` have any whitespace (at most
MAX_JSON_WHITESPACE characters per gap: the engine applies the request's StructuredOutput.json_whitespace),
their properties come in the schema's order and none beyond those it names. The formats are those of server/toolcalls/parsers.py, which reads the
output back.
"""

from __future__ import annotations

import json
from typing import Any

from engine.types import StructuredOutput

MAX_JSON_WHITESPACE = 16  # as engine/speculation/grammar.py allows between JSON elements
LLAMA_TEXT_START = r"[ \t\r\n]*[^{ \t\r\n]"  # a Llama reply that is not a call: its first character is no "{"

Format = dict[str, Any]  # one xgrammar structural-tag format, as JSON


def tool_call_grammar(fmt_name: str, tools: list[tuple[str, dict[str, Any] | None]], *, forced: bool,
                      single: bool, text: Format | None = None, special_tokens: tuple[str, ...] = (),
                      named_args: bool = False) -> StructuredOutput:
    """The structural tag of one request. `tools`: (name, parameters schema) of the callable tools
    (one, for a named tool_choice); `forced`: calls only; `single`: at most one call; `text`: the
    format a reply that is not a call must follow (None: any text); `special_tokens`: markers that
    are special tokens of the tokenizer; `named_args`: Mistral's `[TOOL_CALLS]f[ARGS]{...}` form."""
    builder = {"hermes": _hermes, "llama3_json": _llama, "mistral": _mistral_named if named_args else _mistral,
               "qwen3_coder": _qwen3_coder, "glm45": _glm45}
    fmt = builder[fmt_name](tools, forced, single, text)
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}),
                            special_tokens=special_tokens)


def arguments(schema: dict[str, Any] | None, style: str = "json") -> Format:
    """A call's arguments: a JSON object under `schema` (None or {}: any object; a schema that names no
    type is read as an object's, since arguments are always one); style "qwen_xml": the object as Qwen's
    `<parameter=k>value</parameter>`s, each value a string's text or JSON of the property's type;
    "glm_xml": as GLM's `<arg_key>k</arg_key><arg_value>value</arg_value>`s, the same way."""
    schema = {"type": "object"} | (schema or {}) if not schema or "type" not in schema else schema
    out = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    return out if style == "json" else out | {"style": style}


def text_format(kind: str, spec: str) -> Format:
    """A response_format / guided_* grammar as a structural-tag format (the text of an "auto" reply)."""
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _calls(tags: list[Format], separator: str, forced: bool, single: bool) -> Format:
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": forced,
            "stop_after_first": single}


def _choice(calls: Format, text: Format) -> Format:
    """A reply under `text`, or calls (at least one)."""
    return {"type": "or", "elements": [text, calls | {"at_least_one": True}]}


def _name(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def _hermes(tools: list, forced: bool, single: bool, text: Format | None) -> Format:
    tags = [_tag('<tool_call>\n{"name": ' + _name(name) + ', "arguments": ', arguments(schema), "}\n</tool_call>")
            for name, schema in tools]
    return _tagged_calls(tags, "\n", forced, single, text, "<tool_call>", ["</tool_call>"])


def _llama(tools: list, forced: bool, single: bool, text: Format | None) -> Format:
    """Calls are bare JSON objects at the start of the reply, separated by ";" (the reader opens a
    call only there), so "auto" is: calls, or a reply whose first character is no "{"."""
    tags = [_tag('{"name": ' + _name(name) + ', "parameters": ', arguments(schema), "}") for name, schema in tools]
    calls = _calls(tags, ";", forced, single)
    if forced:
        return calls
    if text is None:
        prose = {"type": "sequence", "elements": [{"type": "regex", "pattern": LLAMA_TEXT_START},
                                                  {"type": "any_text", "excludes": ["<|python_tag|>"]}]}
        text = {"type": "or", "elements": [{"type": "const_string", "value": ""}, prose]}
    return _choice(calls, text)


def _mistral(tools: list, forced: bool, single: bool, text: Format | None) -> Format:
    """`[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`: one block holding the calls."""
    tags = [_tag('{"name": ' + _name(name) + ', "arguments": ', arguments(schema), "}") for name, schema in tools]
    inner = {"type": "sequence", "elements": [{"type": "regex", "pattern": r" ?\["}, _calls(tags, ", ", True, single)]}
    block = _tag("[TOOL_CALLS]", inner, "]")
    if forced:
        return block
    if text is not None:
        return {"type": "or", "elements": [text, block]}
    return {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": [block], "stop_after_first": True}


def _mistral_named(tools: list, forced: bool, single: bool, text: Format | None) -> Format:
    """`[TOOL_CALLS]f[ARGS]{...}` per call (tokenizers with an [ARGS] token)."""
    tags = [_tag("[TOOL_CALLS]" + name + "[ARGS]", arguments(schema), "") for name, schema in tools]
    return _tagged_calls(tags, "", forced, single, text, "[TOOL_CALLS]", ["[ARGS]"])


def _qwen3_coder(tools: list, forced: bool, single: bool, text: Format | None) -> Format:
    """`<tool_call>\n<function=f>\n<parameter=k>\nvalue\n</parameter>\n</function>\n</tool_call>` per call:
    xgrammar's "qwen_xml" style of the tool's schema (properties in the schema's order, required ones
    present; a string's value is any text without "</parameter>", other values JSON of their type, with
    whitespace around them), so what it allows the reader (server/toolcalls/xml_stream.py) types back."""
    tags = [_tag("<tool_call>\n<function=" + name + ">\n", arguments(schema, "qwen_xml"), "</function>\n</tool_call>")
            for name, schema in tools]
    return _tagged_calls(tags, "\n", forced, single, text, "<tool_call>", ["</tool_call>", "<function="])


def _glm45(tools: list, forced: bool, single: bool, text: Format | None) -> Format:
    """`<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>value</arg_value>\n</tool_call>` per call: xgrammar's
    "glm_xml" style of the tool's schema (as its GLM-4.7 structural tag: properties in the schema's order,
    required ones present; up to MAX_JSON_WHITESPACE whitespace before each `<arg_key>`, before each
    `<arg_value>` and before the end, so GLM-4.5's newlines and 4.7's none both pass; a string's value is
    any text without "</arg_value>", taken verbatim, other values JSON of their type with whitespace
    around them), so what it allows the reader (server/toolcalls/glm_stream.py) types back."""
    tags = [_tag("<tool_call>" + name, arguments(schema, "glm_xml"), "</tool_call>") for name, schema in tools]
    return _tagged_calls(tags, "\n", forced, single, text, "<tool_call>",
                         ["</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"])


def _tagged_calls(tags: list[Format], separator: str, forced: bool, single: bool, text: Format | None,
                  trigger: str, excludes: list[str]) -> Format:
    """Calls each opened by `trigger`: forced, the calls alone; with a `text` format, text or calls;
    else free text in which `trigger` starts a call (and `excludes` never appear outside one)."""
    calls = _calls(tags, separator, forced, single)
    if forced:
        return calls
    if text is not None:
        return _choice(calls, text)
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": single,
            "excludes": excludes}
