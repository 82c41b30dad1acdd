"""Stored responses (`store`, the default): `previous_response_id`, `item_reference`, and
`GET` / `DELETE /v1/responses/{id}`. In memory, the last MAX_STORED responses of this process
(least recently used dropped); nothing survives a restart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED = 256

Item = dict[str, Any]


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    history: list[Item]  # the conversation before this response's input (from previous_response_id)
    input: list[Item]  # this response's own input items

    @property
    def conversation(self) -> list[Item]:
        """What a follow-up with previous_response_id continues: history, input and output."""
        return self.history + self.input + list(self.response["output"])


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._entries[stored.response["id"]] = stored
            self._entries.move_to_end(stored.response["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def item(self, item_id: str) -> Item | None:
        """A stored input or output item by its id (for item_reference)."""
        with self._lock:
            entries = list(self._entries.values())
        for stored in reversed(entries):
            for item in stored.input + list(stored.response["output"]):
                if item.get("id") == item_id:
                    return item
        return None
