"""KV slots: the longest cached prefix wins, never the prompt's last token, LRU eviction, reuse off."""

from __future__ import annotations

import torch

from engine.model.kv_cache import KVCache
from engine.model.kv_pool import KVPool, KVSlot, common_prefix


def cache() -> KVCache:
    return KVCache(1, 1, 2, 64, torch.float32, torch.device("cpu"))


def finished(pool: KVPool, prompt: list[int], answer: list[int]) -> KVSlot:
    """Run a sequence through the pool as the engine would: its caches end holding all but the last token."""
    acquired = pool.acquire(prompt)
    tokens = prompt + answer
    acquired.slot.target.length = len(tokens) - 1
    acquired.slot.draft.length = len(tokens) - 3  # the draft lags a little
    pool.release(acquired.slot, tokens)
    return acquired.slot


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_longest_prefix_wins_and_the_last_prompt_token_is_never_reused() -> None:
    pool = KVPool([KVSlot(cache(), cache()) for _ in range(3)])
    for slot in pool.slots:
        slot.target.keys.normal_()
    a = finished(pool, [1, 2, 3, 4], [5, 6])
    finished(pool, [1, 2, 9], [9])
    got = pool.acquire([1, 2, 3, 4, 5, 6, 7, 8])
    assert got.slot is a and got.cached_tokens == 5 and got.draft_cached_tokens == 3
    assert a.target.length == 5 and a.draft.length == 3 and a.running
    pool.release(a, [1, 2, 3, 4, 5, 6, 7, 8, 10])
    again = pool.acquire([1, 2, 3, 4])  # all but its last token; `a` holds more: copied, `a` kept
    assert again.slot is not a and again.cached_tokens == 3 and again.slot.target.length == 3
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 10] and not a.running
    assert torch.equal(again.slot.target.keys[:, :, :3], a.target.keys[:, :, :3])


def test_a_continuation_takes_the_slot_it_extends() -> None:
    pool = KVPool([KVSlot(cache(), cache()) for _ in range(2)])
    a = finished(pool, [1, 2, 3], [4, 5])
    got = pool.acquire([1, 2, 3, 4, 5, 6, 7])  # a chat's next turn: everything `a` holds is shared
    assert got.slot is a and got.cached_tokens == 4


def test_without_a_shared_prefix_the_least_recently_used_slot_is_evicted() -> None:
    pool = KVPool([KVSlot(cache(), cache()) for _ in range(2)])
    first = finished(pool, [1, 1, 1], [1])
    second = finished(pool, [2, 2, 2], [2])
    assert first is not second
    got = pool.acquire([3, 3, 3])
    assert got.slot is first and got.cached_tokens == 0 and first.target.length == 0
    assert pool.num_free == 1


def test_reuse_off_prefills_everything() -> None:
    pool = KVPool([KVSlot(cache(), None)], reuse=False)
    finished_slot = pool.acquire([1, 2, 3]).slot
    finished_slot.target.length = 4
    pool.release(finished_slot, [1, 2, 3, 4, 5])
    got = pool.acquire([1, 2, 3, 4, 5, 6])
    assert got.cached_tokens == 0 and got.slot.target.length == 0 and got.draft_cached_tokens == 0
