"""The engine's attention inside transformers' own decoder layers (as vLLM's Transformers backend does).

    with engine_attention(model.config):  # the model's attention modules call `attend_layer` below
        hidden = layer(hidden, position_embeddings=..., specexec_group=group, specexec_layer=idx)

A layer's attention module computes its query, key and value (projections, q/k norms, rotary: the
family's own code), then calls the attention function that `config._attn_implementation` names; the
engine registers ENGINE_ATTENTION with transformers' AttentionInterface and names it for the length of
a pass. The function gets the layer's kwargs (`specexec_group`, `specexec_layer`, passed through the
layer's **kwargs) and the module's `scaling`, `sliding_window`, `softcap` and `s_aux` (GPT-OSS's sinks):
it writes each segment's keys and values to that segment's cache slots and attends over its own slots
under the segment's tree, causal or window mask. Nothing in it reads a tensor on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from engine.model.attention import (
    attend_eager,
    attend_heads,
    causal_additive_mask,
    causal_allowed,
    window_masks,
)
from engine.model.kv_cache import KVCache

ENGINE_ATTENTION = "specexec"


@dataclass
class SegmentInputs:
    cache: KVCache
    start_slot: int
    row_begin: int  # the segment's rows in its group's [1, rows, hidden] block
    row_end: int
    allowed: torch.Tensor | None  # [n, start_slot + n] bool; None: causal prefill (slot == position)
    position_ids: torch.Tensor  # [n]
    masks: dict[int | None, torch.Tensor]  # sliding window -> additive mask [1, 1, n, kv_len], built once per pass
    alone: bool = False  # the group's only segment: its rows are the whole block, attended without slicing

    def __post_init__(self) -> None:
        # once per pass, not per layer (a layer selects its cache row, layer_rows[layer_idx]): KVCache.pass_views,
        # new_keys/new_values [cache rows, 1, kv_heads, n, head_dim] at the segment's slots, keys/values
        # [cache rows, kv_heads, 1, kv_len, head_dim] at slots [0, kv_len); rows: its rows of the group's block
        self.new_keys, self.new_values, self.keys, self.values = self.cache.pass_views(
            self.start_slot, self.row_end - self.row_begin)
        self.layer_rows = self.cache.layer_rows
        self.rows = slice(self.row_begin, self.row_end)

    def write(self, row: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [1, kv_heads, n, head_dim] into the segment's slots of cache row `row` (one copy each)."""
        self.new_keys[row].copy_(key)
        self.new_values[row].copy_(value)


@dataclass
class GroupInputs:
    """What every layer of one pass shares for one group of segments."""

    position_ids: torch.Tensor  # [1, rows]
    rotary: dict[str | None, tuple[torch.Tensor, torch.Tensor]]  # rotary key -> (cos, sin), each [1, rows, dim]
    segments: list[SegmentInputs]
    dtype: torch.dtype  # of the additive masks


def segment_mask(inputs: SegmentInputs, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The segment's additive mask under `window` ([1, 1, n, kv_len]), made on first use in a pass. A causal
    prefill chunk's full mask is made per layer instead (a long prompt never holds every chunk's masks)."""
    mask = inputs.masks.get(window)
    if mask is not None:
        return mask
    num_tokens, start_slot, cache = inputs.row_end - inputs.row_begin, inputs.start_slot, inputs.cache
    kv_len = start_slot + num_tokens
    positions = cache.positions[:kv_len]
    if inputs.allowed is None:
        if window is None or kv_len <= window:  # the window does not bind
            return causal_additive_mask(num_tokens, start_slot, dtype, cache.device)
        allowed = causal_allowed(num_tokens, start_slot, cache.device)
        return window_masks(allowed, positions[start_slot:], positions, {window}, dtype)[window]
    mask = window_masks(inputs.allowed, inputs.position_ids, positions, {window}, dtype)[window]
    inputs.masks[window] = mask
    return mask


@torch.compiler.disable  # run eagerly between compiled layer parts (DecoderRunner.compile_layers)
def attend_layer(
    group: GroupInputs,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [1, heads, rows, head_dim]; key, value [1, kv_heads, rows, head_dim] of every segment in the
    group, as the attention module made them. Each segment writes its rows to its cache at layer
    `layer_idx` (one copy into the pass's view of its slots) and attends over its slots [0, start_slot + n).
    The per-layer Python is a row lookup and the kernels' calls: views, masks and checks are the pass's
    (SegmentInputs). Returns [1, rows, heads, head_dim]."""
    outs = []
    for s in group.segments:
        row = s.layer_rows[layer_idx]
        if s.alone:
            q, k, v = query, key, value
        else:
            q, k, v = query[:, :, s.rows], key[:, :, s.rows], value[:, :, s.rows]
        s.write(row, k, v)  # [1, kv_heads, n, head_dim] into the segment's slots
        mask = segment_mask(s, window, group.dtype)
        if softcap is None and sinks is None:
            outs.append(attend_heads(q, s.keys[row], s.values[row], mask, scaling))  # [1, n, heads, head_dim]
        else:
            keys, values = s.keys[row][:, 0], s.values[row][:, 0]  # [kv_heads, kv_len, head_dim]
            outs.append(attend_eager(q[0], keys, values, mask, scaling, softcap, sinks)[None])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def engine_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    specexec_group: GroupInputs | None = None,
    specexec_layer: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. query [1, heads, rows, head_dim], key and value [1, kv_heads,
    rows, head_dim]: post-norm, post-rotary. attention_mask is transformers' (None here: the engine's
    masks are per segment). Returns ([1, rows, heads, head_dim], no weights)."""
    if specexec_group is None or specexec_layer is None:
        raise RuntimeError(f"{ENGINE_ATTENTION} attention runs only inside the engine's pass (DecoderRunner)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attend_layer(specexec_group, specexec_layer, query, key, value, scale, sliding_window, softcap, s_aux), None


AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)


class engine_attention:  # noqa: N801  # used as a function: with engine_attention(config)
    """The model's attention modules call the engine's attention while inside: the config's
    `_attn_implementation`, which they read at every call, names it; restored after, so the same model's
    own forward runs as loaded (tests compare against it). Set on the field behind the property
    (`_attn_implementation_internal`, transformers 5.17-5.24), not through the property's setter, which
    validates and recurses into sub-configs: ~30 us a pass on the CPU (a text model has none). A class
    rather than a generator-based context manager: ~2 us less a pass."""

    def __init__(self, config):
        self.config = config

    def __enter__(self) -> None:
        self.previous = self.config._attn_implementation_internal
        object.__setattr__(self.config, "_attn_implementation_internal", ENGINE_ATTENTION)

    def __exit__(self, *exc_info: object) -> None:
        object.__setattr__(self.config, "_attn_implementation_internal", self.previous)
