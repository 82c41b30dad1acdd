"""Slot-indexed KV cache owned by the engine (one sequence at a time).

Slots [0, length) hold the committed prefix, in order. A pass writes its tokens' keys and
values to any free slots at or after `length`; `commit(slots)` then compacts the chosen slots
(the accepted path) to [length, length + len(slots)) for every layer in one gather.
"""

from __future__ import annotations

import torch


class KVBlock:
    """The keys and values of `count` caches in one allocation, [layers, kv_heads, count, capacity, head_dim]
    each: at a layer, slot s of cache c is row c * capacity + s of `flat`'s [kv_heads, count * capacity,
    head_dim] view, so that one indexed write or read reaches several caches (engine.model.draft_graphs)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, count: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, count, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.count = capacity, count

    @staticmethod
    def flat(tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """keys or values of one layer: [kv_heads, count * capacity, head_dim], a view."""
        return tensor[layer].flatten(1, 2)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        block: KVBlock | None = None,
        index: int = 0,
    ):
        # the cache is entry `index` of `block` (a block of its own when None)
        self.block = block or KVBlock(num_layers, num_kv_heads, head_dim, capacity, 1, dtype, device)
        self.block_index = index
        self.keys = self.block.keys[:, :, index]  # [layers, kv_heads, capacity, head_dim]
        self.values = self.block.values[:, :, index]
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)  # [capacity] rotary position
        self.capacity = capacity
        self.length = 0  # committed slots
        # model layer -> its row of keys/values (every layer here; a hybrid cache maps attention layers only)
        self.layer_rows: range | dict[int, int] = range(num_layers)
        # every slot with pass_views' extra axes, once (a pass then takes one slice of each)
        self.grouped = tuple(t.unsqueeze(axis) for axis in (1, 2) for t in (self.keys, self.values))

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def reset(self) -> None:
        self.length = 0

    def write(self, layer_idx: int, start_slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [kv_heads, n, head_dim] into slots [start_slot, start_slot + n)."""
        end = start_slot + keys.shape[1]
        assert end <= self.capacity, f"KV cache overflow: slot {end} > capacity {self.capacity}"
        self.keys[layer_idx, :, start_slot:end] = keys
        self.values[layer_idx, :, start_slot:end] = values

    def reusable_prefix(self, num_shared: int) -> int:
        """Committed slots a sequence sharing `num_shared` tokens with them can keep (any prefix)."""
        return min(num_shared, self.length)

    def room(self, next_slot: int) -> int:
        """Slots that may still be written from `next_slot` on."""
        return self.capacity - next_slot

    def write_positions(self, start_slot: int, position_ids: torch.Tensor) -> None:
        self.positions[start_slot : start_slot + position_ids.shape[0]] = position_ids

    def view(self, layer_idx: int, end_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, end_slot): each [kv_heads, end_slot, head_dim]."""
        return self.keys[layer_idx, :, :end_slot], self.values[layer_idx, :, :end_slot]

    def pass_views(self, start_slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views over every row for one pass that writes slots [start_slot, start_slot + n) and reads slots
        [0, start_slot + n), taken once so that a layer only selects its row (layer_rows[layer_idx]):
        - new keys, new values [rows, 1, kv_heads, n, head_dim]: `new_keys[row].copy_(keys)` is `write`;
        - keys, values [rows, kv_heads, 1, kv_len, head_dim]: row r is `view`'s with the axis that grouped-
          query attention expands over a KV head's query group (the strides of `view(...)[0][:, None]`)."""
        end = start_slot + num_tokens
        assert end <= self.capacity, f"KV cache overflow: slot {end} > capacity {self.capacity}"
        new_keys, new_values, keys, values = self.grouped  # the size-1 axis's stride aside, the same views as
        # keys[:, :, start_slot:end].unsqueeze(1) and keys[:, :, :end].unsqueeze(2) (expanded, or dropped, by every reader)
        return new_keys[:, :, :, start_slot:end], new_values[:, :, :, start_slot:end], keys[:, :, :, :end], values[:, :, :, :end]

    def commit(self, slots: torch.Tensor) -> None:
        """Append the rows at `slots` ([m], ascending positions) to the committed prefix."""
        self.move(slots, self.length)  # gathered first: overlapping source/target is safe
        self.length += slots.shape[0]

    def move(self, slots: torch.Tensor, start: int) -> None:
        """Copy the rows at `slots` ([m]) to slots [start, start + m) (gathered first: the ranges may
        overlap); the committed length is unchanged."""
        end = start + slots.shape[0]
        assert end <= self.capacity, f"KV cache overflow on move: {end} > {self.capacity}"
        self.keys[:, :, start:end] = self.keys[:, :, slots]
        self.values[:, :, start:end] = self.values[:, :, slots]
        self.positions[start:end] = self.positions[slots]

    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Slots [0, length) of `source` (every layer, positions too) become this cache's committed prefix."""
        assert length <= min(self.capacity, source.length), f"copy of {length} slots from {source.length}"
        self.keys[:, :, :length] = source.keys[:, :, :length]
        self.values[:, :, :length] = source.values[:, :, :length]
        self.positions[:length] = source.positions[:length]
        self.length = length
