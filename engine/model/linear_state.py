"""The recurrent state of a sequence's linear-attention layers (Gated DeltaNet), owned by the engine.

Per layer, what the committed tokens left:
- `state` [value heads, dk, dv] fp32: the delta rule's recurrent state;
- `window` [K - 1, conv dim]: the causal convolution's inputs of the last K - 1 committed tokens.
Per pending slot (a token scored but not committed: a tree node, a draft's expanded node, a draft's
catch-up), in a ring of `pending_slots` rows indexed by slot % pending_slots:
- its convolution input x [conv dim], and its delta-rule row (k [key heads, dk], u [value heads, dv],
  gamma [value heads]; engine.model.delta_rule), gamma counted from the committed state.
A pending slot costs key heads x dk + value heads x (dv + 1) floats and a conv row per layer, not a
state (value heads x dk x dv). Committing advances the state along the chosen slots only (the
accepted path, in order); what other pending rows hold is never read again, except a draft's seed
(moved by `move`), whose gammas are re-based on the new committed state.

`settled[layer]` is how many tokens the layer's state holds. It may lag the cache's length: a
length raised over pending slots (a draft's catch-up) is applied when the layer next runs or at the
next commit (`settle`); a length raised before a prefill pass is reached as the pass runs each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.delta_rule import PastRows, TreeRows, advance_state

STATE_BYTES = 4  # the recurrent state and the pending delta-rule rows are float32


@dataclass(frozen=True)
class LinearShape:
    """A Gated DeltaNet layer's state dimensions (config fields linear_*)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, config) -> LinearShape:
        return cls(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def committed_bytes(self, dtype_bytes: int) -> int:
        """One layer's committed state and convolution window."""
        state = self.num_v_heads * self.head_k_dim * self.head_v_dim * STATE_BYTES
        return state + (self.conv_kernel - 1) * self.conv_dim * dtype_bytes

    def pending_bytes(self, dtype_bytes: int) -> int:
        """One layer's row of one pending slot: x, k, u, gamma."""
        rows = self.num_k_heads * self.head_k_dim + self.num_v_heads * (self.head_v_dim + 1)
        return rows * STATE_BYTES + self.conv_dim * dtype_bytes

    def node_state_bytes(self) -> int:
        """A full per-node state (value heads x dk x dv fp32): what a level-by-level tree pass would keep."""
        return self.num_v_heads * self.head_k_dim * self.head_v_dim * STATE_BYTES


class LinearStates:
    def __init__(self, num_layers: int, shape: LinearShape, pending_slots: int, dtype: torch.dtype,
                 device: torch.device):
        s, p = shape, pending_slots
        f32 = dict(dtype=torch.float32, device=device)
        self.shape = shape
        self.pending_slots = p
        self.state = torch.zeros(num_layers, s.num_v_heads, s.head_k_dim, s.head_v_dim, **f32)
        self.window = torch.zeros(num_layers, s.conv_kernel - 1, s.conv_dim, dtype=dtype, device=device)
        self.x = torch.zeros(num_layers, p, s.conv_dim, dtype=dtype, device=device)  # [layers, ring, conv dim]
        self.keys = torch.zeros(num_layers, s.num_k_heads, p, s.head_k_dim, **f32)
        self.values = torch.zeros(num_layers, s.num_v_heads, p, s.head_v_dim, **f32)
        self.gammas = torch.zeros(num_layers, s.num_v_heads, p, **f32)
        self.settled = [0] * num_layers

    @property
    def device(self) -> torch.device:
        return self.state.device

    def ring(self, begin: int, end: int) -> torch.Tensor:
        """Ring rows of slots [begin, end) ([end - begin] long)."""
        return torch.arange(begin, end, device=self.device) % self.pending_slots

    def check_room(self, layer: int, end: int) -> None:
        """Pending slots [settled, end) must fit the ring."""
        if end - self.settled[layer] > self.pending_slots:
            raise RuntimeError(f"linear-attention pending slots overflow: {end - self.settled[layer]} pending "
                               f"tokens > {self.pending_slots} (the tree is larger than its cache was made for)")

    def past(self, layer: int, begin: int, end: int, mask: torch.Tensor) -> PastRows:
        """Rows of pending slots [begin, end); mask [n, end - begin]: which are ancestors of each new row."""
        ring = self.ring(begin, end)
        return PastRows(self.keys[layer][:, ring], self.values[layer][:, ring], self.gammas[layer][:, ring], mask)

    def pending_x(self, layer: int, begin: int, end: int) -> torch.Tensor:
        """Convolution inputs of pending slots [begin, end): [end - begin, conv dim]."""
        return self.x[layer][self.ring(begin, end)]

    def write_x(self, layer: int, start: int, x: torch.Tensor) -> None:
        """x [n, conv dim] of slots [start, start + n)."""
        self.check_room(layer, start + x.shape[0])
        self.x[layer][self.ring(start, start + x.shape[0])] = x

    def write_rows(self, layer: int, start: int, rows: TreeRows) -> None:
        ring = self.ring(start, start + rows.gammas.shape[1])
        self.keys[layer][:, ring] = rows.keys
        self.values[layer][:, ring] = rows.values
        self.gammas[layer][:, ring] = rows.gammas

    def advance(self, layer: int | slice, slots: torch.Tensor) -> None:
        """Commit pending `slots` ([m], in path order) into the state and window of `layer` (an index, or a
        slice of layers settled alike: one batch); re-base the ring's gammas on the new state."""
        num = slots.shape[0]
        if num == 0:
            return
        ring = slots % self.pending_slots
        gammas = self.gammas[layer][..., ring]  # [(layers,) hv, m]
        keys, values = self.keys[layer][..., ring, :], self.values[layer][..., ring, :]
        self.state[layer] = advance_state(self.state[layer], keys, values, gammas)
        keep = self.shape.conv_kernel - 1
        self.window[layer] = torch.cat([self.window[layer], self.x[layer][..., ring, :]], dim=-2)[..., -keep:, :]
        self.gammas[layer] -= gammas[..., -1:]
        for index in range(len(self.settled))[layer] if isinstance(layer, slice) else [layer]:
            self.settled[index] += num

    def settle(self, layer: int, end: int) -> None:
        """Commit the pending slots [settled, end) in order (a length raised over them)."""
        if end > self.settled[layer]:
            self.advance(layer, torch.arange(self.settled[layer], end, device=self.device))

    def commit(self, slots: torch.Tensor, length: int) -> None:
        """Every layer: settle up to `length`, then advance along `slots` (all layers in one batch when
        they are settled alike, as after a pass)."""
        if all(settled == length for settled in self.settled):
            self.advance(slice(None), slots)
            return
        for layer in range(len(self.settled)):
            self.settle(layer, length)
            self.advance(layer, slots)

    def move(self, slots: torch.Tensor, start: int) -> None:
        """Pending rows of `slots` ([m]) to slots [start, start + m) (gathered first)."""
        src = slots % self.pending_slots
        dst = self.ring(start, start + slots.shape[0])
        self.x[:, dst] = self.x[:, src]  # [layers, ring, conv dim]
        for tensor in (self.keys, self.values, self.gammas):  # [layers, heads, ring, ...]
            tensor[:, :, dst] = tensor[:, :, src]

    def reset(self) -> None:
        self.state.zero_()
        self.window.zero_()
        self.settled = [0] * len(self.settled)

    def copy_from(self, source: LinearStates) -> None:
        """The source's committed states (every layer settled at one length) become these."""
        assert len(set(source.settled)) == 1, "copy of a state whose layers are not settled alike"
        self.state.copy_(source.state)
        self.window.copy_(source.window)
        self.settled = list(source.settled)
