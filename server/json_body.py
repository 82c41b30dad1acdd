"""A request body -> a JSON object of valid Unicode text, or a 400 naming where it is not.

Python's `json` accepts what later layers cannot: `"\\ud800"` decodes to a lone UTF-16 surrogate,
which no tokenizer, template or UTF-8 response can carry, and nesting ~1000 deep overflows the
decoder's recursion. Both are the client's error: 400, with `param` the path of the offending
value (`messages[0].content`). So is an integer literal of more than 4300 digits (Python's limit on
int-string conversion).

Parsing holds the interpreter lock (GIL) from start to end, and validating every value holds it in
small slices, so a body of millions of small values stalls every other thread, the engine's included.
A body may hold at most MAX_JSON_VALUES values, counted before parsing by an upper bound that needs
no parsing (one plus its commas and opening brackets, also those inside strings: a prompt with that
many commas is far beyond any context anyway). A body over PIECES_BYTES is parsed in pieces
(server/json_pieces.py), so the lock changes hands between its values.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.errors import invalid_request
from server.json_pieces import loads_in_pieces

MAX_JSON_DEPTH = 64  # request bodies (tool schemas included) nest far less
MAX_JSON_VALUES = 2**18  # a prompt of token ids up to 262,143 tokens fits
PIECES_BYTES = 64 * 1024  # larger bodies are parsed in pieces (as server/preparation.py's large lane takes them)
_SURROGATE = re.compile("[\ud800-\udfff]")


def load_json_object(raw: bytes) -> dict[str, Any]:
    check_json_size(raw)
    try:
        body = json.loads(raw) if len(raw) <= PIECES_BYTES else loads_in_pieces(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer over 4300 digits
        reason = str(exc).split(";")[0]  # not the int limit's advice to call sys.set_int_max_str_digits()
        raise invalid_request(f"We could not parse the JSON body of your request: {reason}") from None
    except RecursionError:
        raise invalid_request(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.",
                              code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    check_json_text(body)
    return body


def check_json_size(raw: bytes) -> None:
    """A 400 for a body that may hold more than MAX_JSON_VALUES values (three byte counts, no parsing)."""
    bound = 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if bound > MAX_JSON_VALUES:
        raise invalid_request(
            f"The JSON body is too complex: it may hold more than {MAX_JSON_VALUES} values (it has {bound - 1} "
            "commas and opening brackets, counting those inside strings).", code="too_many_json_values")


def check_json_text(body: dict[str, Any]) -> None:
    """No lone surrogate in any string or key, no nesting deeper than MAX_JSON_DEPTH (iterative)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid_request(f"Invalid value for '{path}': nested more than {MAX_JSON_DEPTH} levels deep.",
                                  path, "invalid_value")
        if isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    _surrogate_error(child, key)
                _check_item(item, child, depth, stack)
        else:
            for i, item in enumerate(value):
                _check_item(item, f"{path}[{i}]", depth, stack)


def _check_item(item: Any, path: str, depth: int, stack: list[tuple[Any, str, int]]) -> None:
    if isinstance(item, str):
        if _SURROGATE.search(item):
            _surrogate_error(path, item)
    elif isinstance(item, (dict, list)):
        stack.append((item, path, depth + 1))


def _surrogate_error(path: str, text: str) -> None:
    match = _SURROGATE.search(text)
    assert match is not None
    code_point = f"U+{ord(match.group()):04X}"
    path = path.encode("ascii", "backslashreplace").decode()  # the path may hold the key itself
    raise invalid_request(f"Invalid value for '{path}': the string holds a lone surrogate ({code_point}), "
                          "which is not valid Unicode text.", path, "invalid_value")
