"""KV slots for several sequences, and the prefix cache they double as.

Every slot is a target KV cache plus a draft KV cache (None without a draft), each sized for the whole
context plus the largest tree. A running sequence holds one slot. A slot that is not running keeps the
KV of the last sequence that ran in it (prompt and answer) and remembers those token ids: a new
sequence reuses the free slot whose tokens share the longest prefix with its prompt and prefills only
the rest (when that slot holds more than is shared, the shared prefix is copied into the least
recently used other free slot instead, so the longer entry survives); with no shared prefix it
takes the least recently used free slot (evicting what it held). A hybrid model's cache
(engine.model.hybrid_cache) cannot be cut: it is reused only when the prompt shares everything it holds
(a conversation's next turn), else as no shared prefix.
Slots beyond the running ones are the cache's memory bound; with reuse off every sequence prefills
everything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.model.kv_cache import KVCache


@dataclass
class KVSlot:
    target: KVCache
    draft: KVCache | None
    token_ids: list[int] = field(default_factory=list)  # what the caches hold: target slots [0, target.length)
    last_used: int = 0  # release counter (LRU order among free slots)
    running: bool = False


@dataclass(frozen=True)
class Acquired:
    slot: KVSlot
    cached_tokens: int  # prompt tokens whose target KV the slot already holds (target.length)
    draft_cached_tokens: int  # the same for the draft cache


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    return len(os.path.commonprefix([a, b]))


class KVPool:
    def __init__(self, slots: list[KVSlot], reuse: bool = True):
        assert slots, "a pool needs at least one slot"
        self.slots = slots
        self.reuse = reuse
        self._clock = 0

    @property
    def num_free(self) -> int:
        return sum(not slot.running for slot in self.slots)

    def acquire(self, prompt_ids: list[int]) -> Acquired:
        """A free slot for a sequence with this prompt, caches truncated to the reused prefix (never the
        prompt's last token: it is the first tree's root, scored by the first pass)."""
        free = [slot for slot in self.slots if not slot.running]
        assert free, "acquire needs a free slot (callers check num_free)"
        reusable = prompt_ids[:-1]
        shared = [common_prefix(slot.token_ids, reusable) if self.reuse else 0 for slot in free]
        usable = [slot.target.reusable_prefix(num) for slot, num in zip(free, shared, strict=True)]
        best = max(range(len(free)), key=lambda i: (usable[i], shared[i], free[i].last_used))
        source, prefix = free[best], shared[best]
        target_cached = usable[best]  # a hybrid model's state is reused whole or not at all
        draft_cached = 0 if source.draft is None else source.draft.reusable_prefix(prefix)
        victims = [slot for slot in free if slot is not source]
        if target_cached == 0 or (target_cached < source.target.length and victims):
            # no shared prefix, or the best slot holds more than this prompt shares (another
            # conversation): take the least recently used other slot, copying the shared prefix
            slot = min(victims or free, key=lambda s: s.last_used)
            if slot is not source:
                slot.target.copy_prefix(source.target, target_cached)
                if slot.draft is not None and source.draft is not None:
                    slot.draft.copy_prefix(source.draft, draft_cached)
        else:
            slot = source
        slot.target.length = target_cached
        if slot.draft is not None:
            slot.draft.length = draft_cached
        slot.running = True
        slot.token_ids = []  # holds nothing reusable until released
        return Acquired(slot, target_cached, draft_cached)

    def release(self, slot: KVSlot, token_ids: list[int]) -> None:
        """The sequence in `slot` ended; its caches hold the KV of token_ids[:cache.length]."""
        self._clock += 1
        slot.running = False
        slot.last_used = self._clock
        slot.token_ids = list(token_ids) if self.reuse else []
        if not self.reuse:
            slot.target.reset()
            if slot.draft is not None:
                slot.draft.reset()
