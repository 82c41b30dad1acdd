"""One tool call being read: its JSON (server/toolcalls/json_scan.py), name and arguments.

`CallReader.feed` reads a `{"name": ..., "arguments": {...}}` object a character at a time
(`begin_named_args` first for the `{...}` of `name[ARGS]{...}`). Once committed (eagerly: when
the name is known and the arguments object opens; else at the end, by `complete`) it pushes
`("start", index, name)` and then `("args", index, fragment)` events. `well_formed` turns
False when a key or the name rules the object out as a call.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from server.toolcalls.json_scan import JsonScanner, Status

HEAD_KEYS = frozenset({"name", "type", "id"})  # keys a call object may have besides its arguments

Event = tuple[str, str] | tuple[str, int, str]
Push = Callable[[Event], None]


class CallReader:
    """One call being read: its JSON, name and arguments, and whether it was committed."""

    def __init__(self, eager: bool, args_keys: tuple[str, ...], index: int):
        self.scanner = JsonScanner()
        self.index = index
        self.eager = eager
        self.args_keys = args_keys
        self.committed = False
        self.well_formed = True  # False once a key or the name rules the object out as a call
        self.name: str | None = None
        self.name_chars: list[str] = []  # `name` of the named form
        self._spans: dict[str, list] = {}  # captured key ("" : the named form's arguments) -> [start, stop, parts]
        self._args_key: str | None = None
        self._named = False

    def begin_named_args(self, push: Push) -> None:
        self.name = "".join(self.name_chars)
        self._named = True
        self._args_key = ""
        self._spans[""] = [0, None, []]
        if self.eager:
            self._commit(push)

    def feed(self, ch: str, push: Push) -> Status:
        status = self.scanner.feed(ch)
        if status is Status.ERROR:
            return status
        events, self.scanner.events = ([], []) if self._named else (self.scanner.events, [])
        for event in events:
            self._track(event)
        piece, stop = self.scanner.last, self.scanner.pos
        for key, (begin, end, parts) in self._spans.items():
            if begin <= stop - len(piece) and (end is None or stop <= end):
                parts.append(piece)
                if key == self._args_key and self.committed:
                    push(("args", self.index, piece))
        for kind, key, *_ in events:
            if kind == "start" and key == self._args_key and self.name is not None and self.eager and ch == "{":
                self._commit(push)
                push(("args", self.index, ch))
            elif kind == "end" and key == "name" and not self.committed:
                self.name = _decode_name("".join(self._spans["name"][2]))
                self.well_formed = self.well_formed and self.name is not None
        return status

    def _track(self, event: tuple) -> None:
        kind, key = event[0], event[1]
        if kind == "key":
            if not self.committed and key not in HEAD_KEYS and key not in self.args_keys:
                self.well_formed = False
        elif kind == "start":
            if key == "name" or (key in self.args_keys and self._args_key is None):
                self._spans[key] = [event[2], None, []]
                if key != "name":
                    self._args_key = key
        elif key in self._spans:
            self._spans[key][1] = event[2]

    def _commit(self, push: Push) -> None:
        self.committed = True
        push(("start", self.index, self.name))

    def complete(self, push: Push) -> bool:
        """Commit a whole call read without committing; False when it is not a valid call."""
        if self.name is None:
            return False
        if self._args_key is None:
            arguments: str | None = "{}"
        else:
            arguments = _arguments("".join(self._spans[self._args_key][2]))
        if arguments is None:
            return False
        self._commit(push)
        push(("args", self.index, arguments))
        return True


def _decode_name(text: str) -> str | None:
    if not text.startswith('"'):
        return None
    try:
        name = json.loads(text)
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) and name else None


def _arguments(text: str) -> str | None:
    """The arguments of a whole call as JSON object text; None when they are not an object."""
    if text.startswith("{"):
        return text
    if text == "null":
        return "{}"
    if text.startswith('"'):  # arguments sent as a JSON string holding the object
        try:
            value = json.loads(json.loads(text), strict=False)
        except json.JSONDecodeError:
            return None
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
    return None
