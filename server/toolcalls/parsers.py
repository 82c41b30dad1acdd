"""The tool-call formats of the model families the configs ship, one class each.

A format is data for the one incremental reader (server/toolcalls/stream.py): the text that opens
a block of calls, what may follow it, what closes it, and the key that holds the arguments.
Each call inside a block is a JSON object `{"name": ..., "arguments": {...}}` (Llama:
`"parameters"`), or for Mistral's newer tokenizers `name[ARGS]{...}`.

- hermes (Hermes 2 Pro, Qwen2.5, and most templates that print `<tool_call>`):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call.
- llama3_json (Llama 3.1+ with JSON tool calls): the output is `{"name": "f", "parameters":
  {...}}`, optionally after `<|python_tag|>`; several calls are separated by `;`.
- mistral (Mistral v0.3 / Mixtral 8x22B templates): `[TOOL_CALLS][{"name": "f", "arguments":
  {...}}, ...]`, or `[TOOL_CALLS]f[ARGS]{...}` / `[TOOL_CALLS]f{...}` (v11+ tokenizers).
- qwen3_coder (Qwen3-Coder, Qwen3.5): no JSON, `<tool_call>\n<function=f>\n<parameter=k>\nvalue\n
  </parameter>\n</function>\n</tool_call>`, one block per call; values are text, typed by the tool's
  schema. Its reader is server/toolcalls/xml_stream.py (`xml`), not the JSON one.
- glm45 (GLM-4.5 / 4.6 / 4.7): no JSON, `<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>value</arg_value>\n
  </tool_call>` (4.7: without the newlines), one block per call; values typed by the schema as
  qwen3_coder's. Its reader is server/toolcalls/glm_stream.py (`xml` too: past calls print per key).

The grammar that makes the model write calls in these formats is server/toolcalls/grammar.py.
"""

from __future__ import annotations

from typing import ClassVar, Protocol


class ToolFormat(Protocol):
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # texts that open a block of calls
    special_tokens: ClassVar[tuple[str, ...]]  # marker tokens the detokenizer must not drop
    grammar_markers: ClassVar[tuple[str, ...]]  # markers the call grammar writes (server/toolcalls/grammar.py)
    args_keys: ClassVar[tuple[str, ...]]  # object keys that hold the arguments
    bare_json: ClassVar[bool]  # a JSON object at the very start of the output opens a block
    array: ClassVar[bool]  # "[" after the marker opens a list of calls separated by ","
    named_args: ClassVar[bool]  # `name[ARGS]{...}` or `name{...}` after the marker
    end_marker: ClassVar[str]  # closes a block ("": none)
    separators: ClassVar[str]  # characters between two calls of one block
    xml: ClassVar[bool]  # calls are XML-like, one value per key (server/toolcalls/xml_call.py), not JSON objects


class HermesFormat:
    name: ClassVar[str] = "hermes"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    special_tokens: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")
    grammar_markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    bare_json: ClassVar[bool] = False
    array: ClassVar[bool] = False
    named_args: ClassVar[bool] = False
    end_marker: ClassVar[str] = "</tool_call>"
    separators: ClassVar[str] = ""
    xml: ClassVar[bool] = False


class Llama3JsonFormat:
    name: ClassVar[str] = "llama3_json"
    markers: ClassVar[tuple[str, ...]] = ("<|python_tag|>",)
    special_tokens: ClassVar[tuple[str, ...]] = ("<|python_tag|>",)
    grammar_markers: ClassVar[tuple[str, ...]] = ()  # calls are bare JSON
    args_keys: ClassVar[tuple[str, ...]] = ("parameters", "arguments")
    bare_json: ClassVar[bool] = True
    array: ClassVar[bool] = False
    named_args: ClassVar[bool] = False
    end_marker: ClassVar[str] = ""
    separators: ClassVar[str] = ";"
    xml: ClassVar[bool] = False


class MistralFormat:
    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]",)
    special_tokens: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]", "[ARGS]")
    grammar_markers: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]", "[ARGS]")
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)
    bare_json: ClassVar[bool] = False
    array: ClassVar[bool] = True
    named_args: ClassVar[bool] = True
    end_marker: ClassVar[str] = ""
    separators: ClassVar[str] = ""
    xml: ClassVar[bool] = False


class Qwen3CoderFormat:
    name: ClassVar[str] = "qwen3_coder"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "<function=")
    special_tokens: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")
    grammar_markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")
    args_keys: ClassVar[tuple[str, ...]] = ()
    bare_json: ClassVar[bool] = False
    array: ClassVar[bool] = False
    named_args: ClassVar[bool] = False
    end_marker: ClassVar[str] = "</tool_call>"
    separators: ClassVar[str] = ""
    xml: ClassVar[bool] = True


class Glm45Format(Qwen3CoderFormat):
    """qwen3_coder's block, keys and values in GLM's markup (the rest of the record is the same)."""

    name: ClassVar[str] = "glm45"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    special_tokens: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                                 "<arg_value>", "</arg_value>")
    grammar_markers: ClassVar[tuple[str, ...]] = special_tokens


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(),
                                                      Qwen3CoderFormat(), Glm45Format())}
ARGS_MARKER = "[ARGS]"  # between name and arguments in Mistral's named form
