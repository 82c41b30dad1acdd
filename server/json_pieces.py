"""JSON in pieces: large request bodies parsed, and large response bodies written, by many short calls
into json's C code rather than one long one.

A thread holds the interpreter lock (GIL) for the whole of one C call: `json.loads` of a body of 262k
`logit_bias` keys held it 0.16 s, `json.dumps` of an n=8, top_logprobs=20 response longer, and every
other thread (the event loop, the engine's) waited. Between two calls the lock changes hands as the
interpreter's switch interval (5 ms) asks. So, in the preparation lanes (server/preparation.py):

- `loads_in_pieces`: the top two levels of a body walked here (the body's object, then each of its
  arrays and objects: `messages`, `logit_bias`, a prompt of token ids, ...), every value below parsed
  by json's own scanner, one call per value. Same result and same errors (ValueError) as `json.loads`.
- `validate_in_pieces`: pydantic's validation of a body, its long list and object fields (87k chat
  messages held the lock 0.2 s in one call) validated VALIDATE_ITEMS entries per call;
- `dumps_in_pieces`: objects and small arrays walked here, long arrays written PIECE_ITEMS elements per
  `json.dumps` call; the same text as Starlette's JSONResponse writes (compact, UTF-8, no NaN).
"""

from __future__ import annotations

import functools
import json
import json.decoder
import json.scanner
import types
import typing
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)

PIECE_DEPTH = 2  # levels walked here when parsing; deeper values are one scanner call each
PIECE_ITEMS = 64  # array elements per json.dumps call when writing
VALIDATE_ITEMS = 512  # entries of a list or object field validated per call

_scan_once = json.scanner.make_scanner(json.JSONDecoder())
_scanstring = json.decoder.scanstring
_WHITESPACE = json.decoder.WHITESPACE.match
_dumps = partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def loads_in_pieces(raw: bytes | str) -> Any:
    """`json.loads(raw)`, parsed in pieces."""
    text = raw if isinstance(raw, str) else raw.decode(json.detect_encoding(raw), "surrogatepass")
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    value, end = _value(text, _skip(text, 0), PIECE_DEPTH)
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _skip(text: str, index: int) -> int:
    return _WHITESPACE(text, index).end()


def _value(text: str, index: int, depth: int) -> tuple[Any, int]:
    if depth and index < len(text):
        if text[index] == "{":
            return _object(text, index + 1, depth - 1)
        if text[index] == "[":
            return _array(text, index + 1, depth - 1)
    try:
        return _scan_once(text, index)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None


def _object(text: str, index: int, depth: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    index = _skip(text, index)
    if text[index : index + 1] == "}":
        return out, index + 1
    while True:
        if text[index : index + 1] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, index)
        key, index = _scanstring(text, index + 1, True)
        index = _skip(text, index)
        if text[index : index + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, index)
        out[key], index = _value(text, _skip(text, index + 1), depth)
        index = _skip(text, index)
        separator = text[index : index + 1]
        if separator == "}":
            return out, index + 1
        if separator != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, index)
        index = _skip(text, index + 1)


def _array(text: str, index: int, depth: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    index = _skip(text, index)
    if text[index : index + 1] == "]":
        return out, index + 1
    while True:
        value, index = _value(text, index, depth)
        out.append(value)
        index = _skip(text, index)
        separator = text[index : index + 1]
        if separator == "]":
            return out, index + 1
        if separator != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, index)
        index = _skip(text, index + 1)


class PieceError(ValueError):
    """A field validated in pieces failed: `error` is pydantic's first error, `loc` from the body."""

    def __init__(self, error: dict[str, Any]):
        super().__init__(error.get("msg"))
        self.error = error


def validate_in_pieces(cls: type[ModelT], body: dict[str, Any]) -> ModelT:
    """`cls.model_validate(body)`, with each list or object field longer than VALIDATE_ITEMS (`messages`,
    `logit_bias`, ...) validated VALIDATE_ITEMS entries per call. A field's first error is a PieceError
    (its `error` as pydantic's, `loc` from the body), the others' a ValidationError."""
    big = {name: value for name, value in body.items()
           if isinstance(value, (list, dict)) and len(value) > VALIDATE_ITEMS and _piece_adapter(cls, name) is not None}
    if not big:
        return cls.model_validate(body)
    stand_ins = {name: value[:1] if isinstance(value, list) else {} for name, value in big.items()}
    request = cls.model_validate(body | stand_ins)  # the other fields' errors come first, as in one call
    validated = {name: _validate_pieces(name, value, _piece_adapter(cls, name)) for name, value in big.items()}
    return request.model_copy(update=validated)


@functools.cache
def _piece_adapter(cls: type[BaseModel], name: str) -> TypeAdapter | None:
    """A validator of field `name`'s entries when its type is a list or a dict (or one or None)."""
    field = cls.model_fields.get(name)
    if field is None:
        return None
    kinds = [arg for arg in typing.get_args(field.annotation) if arg is not type(None)] \
        if isinstance(field.annotation, types.UnionType) or typing.get_origin(field.annotation) is typing.Union \
        else [field.annotation]
    if len(kinds) != 1 or typing.get_origin(kinds[0]) not in (list, dict):
        return None
    return TypeAdapter(kinds[0], config=ConfigDict(strict=True))


def _validate_pieces(name: str, value: list | dict, adapter: TypeAdapter) -> list | dict:
    pieces: list[Any] = []
    entries = value if isinstance(value, list) else list(value.items())
    for start in range(0, len(entries), VALIDATE_ITEMS):
        piece = entries[start : start + VALIDATE_ITEMS]
        try:
            pieces.append(adapter.validate_python(piece if isinstance(value, list) else dict(piece)))
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = list(first["loc"])
            if isinstance(value, list) and loc and isinstance(loc[0], int):
                loc[0] += start
            raise PieceError(dict(first, loc=(name, *loc))) from None
    if isinstance(value, list):
        return [item for piece in pieces for item in piece]
    return {key: item for piece in pieces for key, item in piece.items()}


def dumps_in_pieces(value: Any) -> bytes:
    """The JSON text of `value` as Starlette's JSONResponse renders it, written in pieces."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts).encode("utf-8")


def _write(value: Any, parts: list[str]) -> None:
    if isinstance(value, dict) and value and all(isinstance(key, str) for key in value):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append(("," if i else "") + _dumps(key) + ":")
            _write(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)) and len(value) > PIECE_ITEMS:
        parts.append("[")
        for start in range(0, len(value), PIECE_ITEMS):
            parts.append(("," if start else "") + _dumps(list(value[start : start + PIECE_ITEMS]))[1:-1])
        parts.append("]")
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
        parts.append("[")
        for i, item in enumerate(value):
            if i:
                parts.append(",")
            _write(item, parts)
        parts.append("]")
    else:
        parts.append(_dumps(value))
