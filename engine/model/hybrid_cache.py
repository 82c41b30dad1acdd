"""The cache of a hybrid model: KV slots for its attention layers, recurrent states for its linear ones.

A KVCache whose keys and values exist only for the full-attention layers (the model's layer index is
mapped to its row), plus engine.model.linear_state.LinearStates for the linear-attention layers. The
slot protocol is KVCache's: a pass writes pending slots at or after `length`; `commit(slots)` keeps
the accepted path (the KV rows compacted, the linear states advanced along the path in order); a
length raised over pending slots commits them in slot order (a draft's catch-up). What cannot be done
is truncation: a linear state holds every committed token at once, so `length` never goes back except
to 0, and a prefix is reused only whole (`reusable_prefix`).
"""

from __future__ import annotations

import torch

from engine.model.kv_cache import KVCache
from engine.model.linear_state import LinearShape, LinearStates


class HybridCache(KVCache):
    def __init__(
        self,
        linear_layers: list[bool],  # per model layer: True for a linear-attention layer
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        shape: LinearShape,
        pending_slots: int,
    ):
        attention = [idx for idx, linear in enumerate(linear_layers) if not linear]
        linear = [idx for idx, is_linear in enumerate(linear_layers) if is_linear]
        self.attention_index = {layer: row for row, layer in enumerate(attention)}
        self.linear_index = {layer: row for row, layer in enumerate(linear)}
        self.linear = LinearStates(len(linear), shape, min(pending_slots, capacity), dtype, device)
        self._length = 0
        super().__init__(len(attention), num_kv_heads, head_dim, capacity, dtype, device)
        self.layer_rows = self.attention_index

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        """Raised: the slots up to `value` are committed in order (now, or as each layer next runs).
        Lowered: only to 0 (a reset), or back over slots no layer has settled yet."""
        if value == 0:
            self.linear.reset()
        elif value < max(self.linear.settled, default=0):
            raise AssertionError(f"a linear-attention state cannot be truncated (to {value} of "
                                 f"{max(self.linear.settled)} committed tokens)")
        self._length = value

    def reusable_prefix(self, num_shared: int) -> int:
        """Tokens of the committed prefix a sequence sharing `num_shared` tokens with it can keep: all
        of them or none (the state cannot be cut)."""
        return self._length if num_shared >= self._length else 0

    def room(self, next_slot: int) -> int:
        """Slots a draft may still write from `next_slot`: the KV capacity and the pending ring's."""
        ring_end = min(self.linear.settled, default=self._length) + self.linear.pending_slots
        return min(self.capacity, ring_end) - next_slot

    def write(self, layer_idx: int, start_slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().write(self.attention_index[layer_idx], start_slot, keys, values)

    def view(self, layer_idx: int, end_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return super().view(self.attention_index[layer_idx], end_slot)

    def commit(self, slots: torch.Tensor) -> None:
        self.linear.commit(slots, self._length)
        self.move_kv(slots, self._length)
        self._length += slots.shape[0]

    def move_kv(self, slots: torch.Tensor, start: int) -> None:
        super().move(slots, start)

    def move(self, slots: torch.Tensor, start: int) -> None:
        super().move(slots, start)
        self.linear.move(slots, start)

    def reset(self) -> None:
        self.length = 0

    def settle(self) -> None:
        """Every layer's state at `length` (a length raised over pending slots, applied now)."""
        for layer in range(len(self.linear.settled)):
            self.linear.settle(layer, self._length)

    def copy_prefix(self, source: KVCache, length: int) -> None:
        if length == 0:
            self.reset()
            return
        assert isinstance(source, HybridCache) and length == source.length, \
            f"a linear-attention state is copied whole ({length} of {source.length} tokens asked)"
        source.settle()
        self.linear.copy_from(source.linear)
        super().copy_prefix(source, length)
