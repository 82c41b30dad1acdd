"""Parameter values of Qwen's XML tool calls (`<parameter=k>\\nvalue\\n</parameter>`) -> JSON values.

A value is text; the tool's JSON schema for that parameter says what it becomes (as vLLM's
qwen3_coder parser does): a string stays the text verbatim; integer, number, boolean, object and
array (and an untyped enum of non-strings) are read as JSON (Python's `True` / `{'a': 1}` too: the chat templates print past values with
Jinja's `| string`), else the text stays a string; "null" / "None" is null where the schema allows
null or the type is not a string. A parameter the schema does not describe is a string.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

TEXT_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
NULL_WORDS = frozenset({"null", "None"})
KIND_CHECKS = {  # schema type -> does a parsed value have it
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class ValueType:
    kind: str  # a JSON-schema type ("string" for anything not typed; "json": any JSON, an untyped enum's)
    nullable: bool = False  # the schema admits null
    choices: tuple[Any, ...] | None = None  # a string's enum / const values

    @property
    def streams(self) -> bool:
        """Whether the value is the text itself, so it can be sent as it arrives (a JSON string)."""
        return self.kind == "string" and not self.nullable and self.choices is None


def value_type(schema: Any) -> ValueType:
    """The type one parameter's schema (`parameters.properties[name]`, or None) gives its value."""
    if not isinstance(schema, dict):
        return ValueType("string")
    kinds: list[str] = []
    declared = schema.get("type")
    if isinstance(declared, str):
        kinds.append(declared)
    elif isinstance(declared, list):
        kinds.extend(str(kind) for kind in declared)
    for option in schema.get("anyOf") or schema.get("oneOf") or []:
        if isinstance(option, dict) and isinstance(option.get("type"), str):
            kinds.append(option["type"])
    kinds = [kind.strip().lower() for kind in kinds]
    listed = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    if not kinds and any(not isinstance(choice, str) for choice in listed):
        kinds = ["json"]  # an untyped enum / const of numbers, ...: whatever JSON the text is
    nullable = "null" in kinds or (None in listed)
    kind = next((k for k in kinds if k != "null"), "null" if nullable else "string")
    kind = "string" if kind in TEXT_TYPES else kind
    choices = tuple(listed) if kind == "string" and listed else None
    return ValueType(kind, nullable, choices)


def convert(text: str, vtype: ValueType) -> Any:
    """One parameter's text (its one leading and trailing newline already stripped) as a JSON value."""
    word = text.strip()
    if word in NULL_WORDS and (vtype.nullable or vtype.kind != "string"):
        return None
    if vtype.kind == "string":
        if vtype.choices is not None and text not in vtype.choices and word in vtype.choices:
            return word  # an enum value with whitespace around it
        return text
    check = KIND_CHECKS.get(vtype.kind)
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(word)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if check is None or check(value):
            try:  # as JSON data: a Python literal may hold tuples (-> lists), sets, bytes, nan (-> text)
                return json.loads(json.dumps(value, allow_nan=False))
            except (TypeError, ValueError):
                continue
    return text
