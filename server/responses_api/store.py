"""Stored responses (`store`, the default): `previous_response_id`, `item_reference`, and
`GET` / `DELETE /v1/responses/{id}`. In memory, nothing survives a restart; least recently used
dropped first, beyond MAX_STORED responses or MAX_STORED_BYTES in all.

Bytes are counted as JSON text, an upper bound that needs no serializing: a stored response counts
its request body (its input and the settings the response echoes), its output, and the conversation
it continues (which it keeps alive). Stored input items keep only the fields the API returns
(STORED_FIELDS); items are found by id through an index (`item_reference`), never by a scan. A
request holds at most MAX_ITEMS input items, and with `previous_response_id` its history and input
together at most MAX_ITEMS.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("specexec.server")

MAX_STORED = 256
MAX_STORED_BYTES = 64 * 2**20
MAX_ITEMS = 8192  # input items per request, and history + input items with previous_response_id

Item = dict[str, Any]

# the fields a stored input item keeps, by type (other types are kept whole, and counted)
STORED_FIELDS: dict[str, tuple[str, ...]] = {
    "message": ("id", "type", "role", "content", "status"),
    "function_call": ("id", "type", "call_id", "name", "arguments", "status"),
    "function_call_output": ("id", "type", "call_id", "output", "status"),
    "custom_tool_call": ("id", "type", "call_id", "name", "input", "status"),
    "custom_tool_call_output": ("id", "type", "call_id", "output", "status"),
    "item_reference": ("id", "type"),
    "reasoning": ("id", "type", "summary", "content", "status"),  # not encrypted_content: nothing here reads it
}
PART_FIELDS = ("type", "text", "refusal")  # of a content or summary part


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    history: list[Item]  # the conversation before this response's input (from previous_response_id)
    input: list[Item]  # this response's own input items
    num_bytes: int = 0  # what keeping it costs, as JSON text: request body, output, the history it keeps
    conversation_bytes: int = 0  # its conversation's items as JSON text (what a follow-up carries)

    @property
    def conversation(self) -> list[Item]:
        """What a follow-up with previous_response_id continues: history, input and output."""
        return self.history + self.input + list(self.response["output"])


@dataclass(frozen=True)
class PendingResponse:
    """A response being created with `store`: what it will hold once its output is known."""

    history: list[Item]
    history_bytes: int
    input: list[Item]  # stored_items of its own input
    input_bytes: int
    body_bytes: int  # its request body

    def stored(self, response: dict[str, Any]) -> StoredResponse:
        output_bytes = json_size(response["output"])
        return StoredResponse(response, self.history, self.input,
                              num_bytes=self.body_bytes + output_bytes + self.history_bytes,
                              conversation_bytes=self.history_bytes + self.input_bytes + output_bytes)


def stored_items(items: list[Item]) -> tuple[list[Item], int]:
    """Input items as stored (the fields the API returns) and their size as JSON text."""
    kept = [stored_item(item) for item in items]
    return kept, json_size(kept)


def stored_item(item: Item) -> Item:
    fields = STORED_FIELDS.get(item.get("type", "message"))
    if fields is None:
        return item
    kept = {name: item[name] for name in fields if name in item}
    for name in ("content", "summary"):
        if isinstance(kept.get(name), list):
            kept[name] = [{k: part[k] for k in PART_FIELDS if k in part} if isinstance(part, dict) else part
                          for part in kept[name]]
    return kept


def json_size(value: Any) -> int:
    """About the length of `value` as JSON text (strings by characters, other scalars as 8), no serializing."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, dict):
        return 2 + sum(len(str(key)) + 4 + json_size(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return 2 + sum(json_size(item) + 1 for item in value)
    return 8


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0  # of the responses stored
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, dict[str, tuple[Item, int]]] = {}  # item id -> response id -> (item, its size)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> bool:
        """Store a response, dropping the least recently used beyond the bounds; False (not stored) for
        one larger than max_bytes by itself."""
        response_id = stored.response["id"]
        if stored.num_bytes > self.max_bytes:
            log.warning("response %s not stored: it holds about %d bytes, more than the store's %d",
                        response_id, stored.num_bytes, self.max_bytes)
            return False
        with self._lock:
            self._remove(response_id)
            self._entries[response_id] = stored
            self.num_bytes += stored.num_bytes
            for item in _own_items(stored):
                self._items.setdefault(item["id"], {})[response_id] = (item, json_size(item))
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._remove(response_id)

    def item(self, item_id: str) -> Item | None:
        """A stored input or output item by its id (for item_reference); the most recently stored one
        of that id."""
        with self._lock:
            holders = self._items.get(item_id)
            return None if not holders else next(reversed(holders.values()))[0]

    def item_bytes(self, items: list[Item]) -> int:
        """The size as JSON text of the stored items that `items`' item_references name (unknown: 0)."""
        total = 0
        with self._lock:
            for item in items:
                if item.get("type") == "item_reference" and (holders := self._items.get(str(item.get("id")))):
                    total += next(reversed(holders.values()))[1]
        return total

    def _remove(self, response_id: str) -> bool:
        """Under the lock."""
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self.num_bytes -= stored.num_bytes
        for item in _own_items(stored):
            holders = self._items.get(item["id"])
            if holders is not None:
                holders.pop(response_id, None)
                if not holders:
                    del self._items[item["id"]]
        return True


def _own_items(stored: StoredResponse) -> list[Item]:
    """The items item_reference may name: its own input and output (each with a string id; not its
    references)."""
    return [item for item in stored.input + list(stored.response["output"])
            if isinstance(item, dict) and isinstance(item.get("id"), str) and item.get("type") != "item_reference"]
