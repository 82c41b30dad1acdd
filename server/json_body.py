"""A request body -> a JSON object of valid Unicode text, or a 400 naming where it is not.

Python's `json` accepts what later layers cannot: `"\\ud800"` decodes to a lone UTF-16 surrogate,
which no tokenizer, template or UTF-8 response can carry, and nesting ~1000 deep overflows the
decoder's recursion. Both are the client's error: 400, with `param` the path of the offending
value (`messages[0].content`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.errors import invalid_request

MAX_JSON_DEPTH = 64  # request bodies (tool schemas included) nest far less
_SURROGATE = re.compile("[\ud800-\udfff]")


def load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(f"We could not parse the JSON body of your request: {exc}") from None
    except RecursionError:
        raise invalid_request(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.",
                              code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    check_json_text(body)
    return body


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
