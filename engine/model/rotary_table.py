"""A pass's rotary cos/sin looked up by position in a table the model's own rotary module made.

transformers' rotary modules compute (cos, sin) of position p from p alone, elementwise: p x inv_freq,
cos and sin, the attention scaling, the dtype cast. So where the inverse frequencies are fixed at init
(STATIC_ROPE_TYPES), the module's output over positions [0, n) indexed at a pass's positions is its output
over those positions, bit for bit (tests/model/test_small_pass.py checks every family, fp32 and bf16), and a
pass costs two index_selects per table instead of the module's ~8 ops. Rope types that change their
frequencies with the positions seen (dynamic, longrope) are computed per pass as before.

Bound: a token at position p attends its p predecessors and itself, each in a slot of its segment's
[0, start_slot + n) (the engine's KV never drops a slot), so p < start_slot + n: the table grows, by powers of
two, to the largest start_slot + n of a pass, and past MAX_POSITIONS the pass computes its own (a long
context's table is not held: at most 2 x MAX_POSITIONS x rotary dim values per table).
"""

from __future__ import annotations

import torch
from torch import nn

STATIC_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3"})  # inverse frequencies fixed at init
MIN_POSITIONS = 256  # the smallest table
MAX_POSITIONS = 16384  # the largest table; a pass with a larger bound computes its own cos/sin

RotaryPair = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [1, rows, rotary dim]


def static_rope(rotary_emb: nn.Module) -> bool:
    """Whether the module's frequencies are fixed at init (its rope_type, or each layer type's, is static)."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return all(kind in STATIC_ROPE_TYPES for kind in kinds)


def module_rotary(rotary_emb: nn.Module, like: torch.Tensor, positions: torch.Tensor, key: str | None) -> RotaryPair:
    """The module's own (cos, sin) of `positions` ([1, rows]) on `like`'s device and dtype: [1, rows, rotary
    dim] each (`key`: a layer type, for modules with a table per type)."""
    return rotary_emb(like, positions) if key is None else rotary_emb(like, positions, key)


class RotaryTables:
    """(cos, sin) per rotary key (None, or a layer type for Gemma 3's local and global tables) of positions
    [0, num_positions), made by the model's own module on `like`'s device and dtype."""

    def __init__(self, rotary_emb: nn.Module, keys: list[str | None]):
        self.rotary_emb = rotary_emb
        self.keys = keys
        self.num_positions = 0
        self.tables: dict[str | None, RotaryPair] = {}
        self.like: tuple[torch.device, torch.dtype] | None = None

    def lookup(self, weight: torch.Tensor, positions: torch.Tensor, bound: int) -> dict[str | None, RotaryPair] | None:
        """Every key's (cos, sin) of `positions` ([rows], each < bound) on the device and in the dtype of
        `weight` (the embedding's), or None when bound > MAX_POSITIONS."""
        if bound > MAX_POSITIONS:
            return None
        if bound > self.num_positions or self.like != (weight.device, weight.dtype):
            self.grow(weight[:1, None], bound)
        return {key: (cos.index_select(1, positions), sin.index_select(1, positions))
                for key, (cos, sin) in self.tables.items()}

    def grow(self, like: torch.Tensor, bound: int) -> None:
        """Tables over positions [0, the power of two >= bound, at least MIN_POSITIONS)."""
        num_positions = max(MIN_POSITIONS, 1 << (bound - 1).bit_length())
        positions = torch.arange(num_positions, device=like.device)[None]
        self.tables = {key: module_rotary(self.rotary_emb, like, positions, key) for key in self.keys}
        self.num_positions, self.like = num_positions, (like.device, like.dtype)
