"""The Responses API's store (server/responses_api/store.py): bounded in count (the last 256, least recently
used out) and in bytes, stored input items keep only the fields the API returns, items are found by id
through an index (never a scan of every stored item), and what stored items bring to a request counts
toward its preparation lane as its body does."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig
from server.preparation import SMALL_BODY_BYTES
from server.responses_api.store import (
    MAX_ITEMS,
    MAX_STORED,
    MAX_STORED_BYTES,
    ResponseStore,
    StoredResponse,
    json_size,
    stored_items,
)
from tests.helpers.fake_engine import FakeEngine


def stored(index: int, num_bytes: int = 100, items: list[dict[str, Any]] | None = None) -> StoredResponse:
    output = [{"id": f"msg_out_{index}", "type": "message", "role": "assistant", "content": []}]
    inputs = items if items is not None else [{"id": f"msg_in_{index}", "type": "message", "role": "user",
                                                "content": "hi"}]
    return StoredResponse({"id": f"resp_{index}", "output": output}, [], inputs, num_bytes=num_bytes)


def test_the_store_keeps_the_last_256_least_recently_used_first_out() -> None:
    store = ResponseStore()
    assert (store.max_entries, store.max_bytes) == (MAX_STORED, MAX_STORED_BYTES) == (256, 64 * 2**20)
    for i in range(MAX_STORED):
        assert store.put(stored(i))
    assert len(store) == MAX_STORED and store.get("resp_0") is not None  # resp_0 is now the most recent
    store.put(stored(MAX_STORED))
    assert len(store) == MAX_STORED and store.get("resp_1") is None and store.get("resp_0") is not None
    assert store.item("msg_in_1") is None and store.item("msg_out_1") is None  # its items left the index too
    assert store.item("msg_in_0")["content"] == "hi"
    for i in range(2 * MAX_STORED, 3 * MAX_STORED):
        store.put(stored(i))
    assert len(store) == MAX_STORED and store.num_bytes == 100 * MAX_STORED
    assert len(store._items) == 2 * MAX_STORED  # the index holds the stored responses' items only


def test_the_apps_store_has_those_bounds() -> None:
    app = build_app(EngineConfig(), ServerConfig(), FakeEngine())
    assert (app.state.response_store.max_entries, app.state.response_store.max_bytes) == (MAX_STORED,
                                                                                          MAX_STORED_BYTES)


def test_the_store_is_bounded_in_bytes() -> None:
    store = ResponseStore(max_bytes=1000)
    for i in range(4):
        assert store.put(stored(i, num_bytes=400))
    assert len(store) == 2 and store.num_bytes == 800 and store.get("resp_3") and store.get("resp_2")
    assert not store.put(stored(9, num_bytes=1001))  # larger than the store by itself: not stored
    assert store.get("resp_9") is None and len(store) == 2
    assert store.delete("resp_2") and store.delete("resp_3") and store.num_bytes == 0 and not store._items


class Unscannable(list):
    """Items whose list fails if anything iterates it once `armed`."""

    armed = False

    def __iter__(self):
        assert not self.armed, "a lookup scanned the stored items"
        return super().__iter__()

    def __add__(self, other):
        assert not self.armed, "a lookup scanned the stored items"
        return super().__add__(other)


def test_items_are_found_by_id_without_a_scan() -> None:
    store = ResponseStore()
    lists = []
    for i in range(10):
        items = Unscannable({"id": f"rs_{i}_{j}", "type": "reasoning", "summary": []} for j in range(2000))
        store.put(stored(i, items=items))
        lists.append(items)
    for items in lists:
        items.armed = True
    assert store.item("rs_7_1999") == {"id": "rs_7_1999", "type": "reasoning", "summary": []}
    assert store.item("rs_nope") is None
    refs = [{"type": "item_reference", "id": f"rs_{i}_5"} for i in range(10)] + [{"type": "message"}]
    assert store.item_bytes(refs) == 10 * json_size({"id": "rs_0_5", "type": "reasoning", "summary": []})


def test_stored_items_keep_only_what_the_api_returns() -> None:
    padding = "x" * 1000
    items = [{"id": "m", "type": "message", "role": "user", "padding": padding,
              "content": [{"type": "input_text", "text": "hi", "padding": padding}]},
             {"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": "{}", "extra": padding},
             {"type": "function_call_output", "id": "fco", "call_id": "c", "output": "ok", "extra": padding},
             {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "s"}],
              "encrypted_content": padding},
             {"type": "item_reference", "id": "m", "extra": padding}]
    kept, num_bytes = stored_items(items)
    assert padding not in json.dumps(kept) and num_bytes < 1000
    assert kept[0] == {"id": "m", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    assert kept[4] == {"id": "m", "type": "item_reference"}


def post(srv: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + "/v1/responses", json={"model": "fake-model", "max_output_tokens": 4, **body},
                      timeout=60)


def test_over_http_unknown_fields_are_not_stored_and_the_body_is_counted(fake_server) -> None:
    srv = fake_server(FakeEngine(max_context=10**5))
    padding = "p" * 50_000
    body = {"input": [{"type": "message", "role": "user", "content": "hi", "padding": padding},
                      {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": padding}]}
    created = post(srv, body)
    assert created.status_code == 200, created.text
    listed = httpx.get(srv.url + f"/v1/responses/{created.json()['id']}/input_items", timeout=30).json()
    assert [item["type"] for item in listed["data"]] == ["message", "reasoning"]
    assert padding not in json.dumps(listed)
    store = srv.app.state.response_store
    assert store.num_bytes >= len(json.dumps(body))  # the request body counts (it held the padding)


def test_item_caps_per_request_and_per_conversation(fake_server) -> None:
    srv = fake_server(FakeEngine(max_context=10**5))
    too_many = post(srv, {"input": [{"type": "reasoning", "summary": []}] * MAX_ITEMS + [{"role": "user",
                                                                                          "content": "hi"}]})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input"
    full = post(srv, {"input": [{"type": "reasoning", "summary": []}] * (MAX_ITEMS - 1) + [{"role": "user",
                                                                                           "content": "hi"}]})
    assert full.status_code == 200, full.text  # MAX_ITEMS input items, one output item
    follow_up = post(srv, {"previous_response_id": full.json()["id"], "input": "and?"})
    assert follow_up.status_code == 400 and follow_up.json()["error"]["param"] == "previous_response_id"
    assert str(MAX_ITEMS) in follow_up.json()["error"]["message"]


@pytest.mark.parametrize("via", ["item_reference", "previous_response_id"])
def test_what_stored_items_bring_counts_toward_the_lane(fake_server, via: str) -> None:
    """A small body that brings a large stored item is prepared in the large lane, as a large body is."""
    srv = fake_server(FakeEngine(max_context=10**6))
    big = {"type": "message", "role": "user", "content": "word " * (SMALL_BODY_BYTES // 4), "id": "msg_big"}
    first = post(srv, {"input": [big]})
    assert first.status_code == 200, first.text
    preparation = srv.state.preparation
    sizes: list[int] = []
    real_lane = preparation.lane

    def lane(body_bytes: int):
        sizes.append(body_bytes)
        return real_lane(body_bytes)

    preparation.lane = lane
    body = {"input": [{"type": "item_reference", "id": "msg_big"}]} if via == "item_reference" else {
        "input": "more", "previous_response_id": first.json()["id"]}
    second = post(srv, body)
    assert second.status_code == 200, second.text
    assert len(json.dumps(body)) < 200 and max(sizes) > SMALL_BODY_BYTES
    assert real_lane(max(sizes)) is preparation.large
