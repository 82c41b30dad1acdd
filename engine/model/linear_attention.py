"""The engine's convolution and delta rule inside transformers' own Gated DeltaNet layers.

A linear-attention module's forward (Qwen3-Next, Qwen3.5: transformers 5.17-5.24) runs its own code for
everything per token (projections, the q/k/v/z/b/a split, the gating g and beta, the gated RMSNorm, the
output projection) and calls two functions of its modeling file for what runs along the sequence:

    mixed_qkv = causal_conv1d_fn(mixed_qkv, weight, bias, activation=..., **kwargs)
    out, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, ..., **kwargs)

(with no cache passed, the path the engine's pass takes). `install` puts a router in the place of each
in the modeling file: outside the engine's pass (no `specexec_group` in kwargs) it calls the original;
inside, the layer's kwargs carry the pass's segments (as for attention, engine.model.hf_attention) and
each segment runs against its own cache (engine.model.hybrid_cache):
- a causal prefill chunk: the original convolution over the committed window followed by the chunk,
  and the original chunked delta rule from the committed state, which it advances (transformers' own
  prefill, chunk by chunk);
- tree rows (a target tree, a draft's expansion or catch-up): each row's convolution window is its own
  path's last K - 1 inputs (pending ancestors, then the committed window), through the convolution's
  weights (its sum written out: conv_windows); the delta rule is engine.model.delta_rule.tree_delta_rule over the rows' ancestors and
  earlier pending rows; the rows are kept pending until a commit picks a path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch
import transformers
from transformers.activations import ACT2FN

from engine.model.delta_rule import tree_delta_rule
from engine.model.hf_attention import GroupInputs, SegmentInputs
from engine.model.hybrid_cache import HybridCache

CONV = "causal_conv1d_fn"
RULE = "torch_chunk_gated_delta_rule"
_install_lock = threading.Lock()


def called_names(cls: type) -> set[str]:
    """Global names the class's forward (under its decorators) refers to."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    code = getattr(forward, "__code__", None)
    return set(code.co_names) if code is not None else set()


def install(linear_class: type) -> None:
    """Route `linear_class`'s convolution and chunked delta rule through the engine in its passes
    (idempotent; the originals run everywhere else). ValueError: a transformers version whose layer
    does not call them."""
    module = sys.modules[linear_class.__module__]
    missing = [name for name in (CONV, RULE) if name not in called_names(linear_class) or not hasattr(module, name)]
    if missing:
        raise ValueError(f"{linear_class.__name__} of transformers {transformers.__version__} calls no "
                         f"{' or '.join(missing)}: the engine runs linear-attention layers as transformers "
                         f"5.17-5.24 write them")
    with _install_lock:
        if not getattr(getattr(module, CONV), "specexec_router", False):
            setattr(module, CONV, conv_router(getattr(module, CONV)))
        if not getattr(getattr(module, RULE), "specexec_router", False):
            setattr(module, RULE, rule_router(getattr(module, RULE)))


def conv_router(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, *args, specexec_group=None, specexec_layer=None, **kwargs):
        if specexec_group is None:
            return original(hidden_states, weight, bias, *args, **kwargs)
        return segment_convs(original, specexec_group, specexec_layer, hidden_states, weight, bias, kwargs.get("activation"))

    causal_conv1d_fn.specexec_router = True  # type: ignore[attr-defined]
    causal_conv1d_fn.__wrapped__ = original  # type: ignore[attr-defined]
    return causal_conv1d_fn


def rule_router(original: Callable) -> Callable:
    def chunk_gated_delta_rule(query, key, value, *args, specexec_group=None, specexec_layer=None, **kwargs):
        if specexec_group is None:
            return original(query, key, value, *args, **kwargs)
        assert kwargs.get("use_qk_l2norm_in_kernel"), "the engine's delta rule normalises q and k itself"
        g, beta = args[:2] if len(args) >= 2 else (kwargs["g"], kwargs["beta"])
        return segment_rules(original, specexec_group, specexec_layer, (query, key, value, g, beta)), None

    chunk_gated_delta_rule.specexec_router = True  # type: ignore[attr-defined]
    chunk_gated_delta_rule.__wrapped__ = original  # type: ignore[attr-defined]
    return chunk_gated_delta_rule


def hybrid_cache(segment: SegmentInputs) -> HybridCache:
    cache = segment.cache
    assert isinstance(cache, HybridCache), "a linear-attention layer runs over a HybridCache (DecoderRunner.new_cache)"
    return cache


def segment_convs(original: Callable, group: GroupInputs, layer: int, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """x [1, conv dim, rows] of every segment in the group -> the convolution's output, the same shape."""
    outs = []
    for s in group.segments:
        cache = hybrid_cache(s)
        rows = x[0, :, s.row_begin : s.row_end]  # [conv dim, n]
        if s.allowed is None:
            conv = lambda inputs: original(inputs, weight, bias, activation=activation)  # noqa: E731
            outs.append(prefill_conv(cache, cache.linear_index[layer], s.start_slot, rows, conv))
        else:
            outs.append(tree_conv(cache, cache.linear_index[layer], s, rows, (weight, bias, activation)))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))[None]


def prefill_conv(cache: HybridCache, layer: int, start: int, rows: torch.Tensor, conv: Callable) -> torch.Tensor:
    """A causal chunk at slots [start, start + n): the committed window, then the chunk, through the
    convolution; the window moves to the chunk's last K - 1 inputs. rows [conv dim, n] -> [conv dim, n]."""
    states = cache.linear
    states.settle(layer, start)
    keep = states.shape.conv_kernel - 1
    inputs = torch.cat([states.window[layer].T, rows], dim=1)  # [conv dim, K - 1 + n]
    out = conv(inputs[None])[0, :, keep:]
    states.window[layer] = inputs[:, inputs.shape[1] - keep :].T
    return out


def tree_conv(cache: HybridCache, layer: int, s: SegmentInputs, rows: torch.Tensor,
              conv: tuple[torch.Tensor, torch.Tensor | None, str | None]) -> torch.Tensor:
    """Rows at slots [start, start + n) under s.allowed: each row's window is the inputs at positions
    p - K + 1 .. p along its own path (pending ancestors, else the committed window). rows [conv dim, n]."""
    states = cache.linear
    base, start, num_rows = cache.length, s.start_slot, rows.shape[1]
    states.settle(layer, base)
    keep = states.shape.conv_kernel - 1
    sources = torch.cat([states.window[layer], states.pending_x(layer, base, start), rows.T])  # [keep + m, conv dim]
    positions = cache.positions[base : start + num_rows]  # [m] pending positions
    allowed = s.allowed[:, base:]  # [n, m]
    pos = s.position_ids
    columns = []
    for back in range(keep, 0, -1):
        want = pos - back  # [n]
        match = allowed & (positions[None, :] == want[:, None])  # [n, m]: the ancestor at that position
        pending = match.to(torch.uint8).argmax(dim=1) + keep
        columns.append(torch.where(match.any(dim=1), pending, keep - (base - want)))
    columns.append(torch.arange(start - base, start - base + num_rows, device=rows.device) + keep)
    windows = sources[torch.stack(columns, dim=1)]  # [n, K, conv dim]
    states.write_x(layer, start, rows.T)
    return conv_windows(windows, *conv).T


def conv_windows(windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 activation: str | None) -> torch.Tensor:
    """The causal convolution's output at the last position of each window: windows [n, K, conv dim],
    weight [conv dim, K] -> [n, conv dim]. causal_conv1d_fn's sum (a depthwise conv1d) written out: a
    batched conv1d of n windows of K is many times slower on CPU (oneDNN), for the same products. Summed
    in float32 and rounded once to the model dtype before the activation, as a conv1d kernel does."""
    out = (windows.float() * weight.T.float()).sum(dim=1)
    if bias is not None:
        out = out + bias.float()
    out = out.to(windows.dtype)
    return out if activation is None else ACT2FN[activation](out)


def segment_rules(original: Callable, group: GroupInputs, layer: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """q, k [1, rows, key heads, dk], v [1, rows, value heads, dv], g, beta [1, rows, value heads] of
    every segment -> the delta rule's output [1, rows, value heads, dv] (q's dtype)."""
    query = inputs[0]
    outs = []
    for s in group.segments:
        cache = hybrid_cache(s)
        index = cache.linear_index[layer]
        q, k, v, g, beta = (t[0, s.row_begin : s.row_end] for t in inputs)
        if s.allowed is None:
            outs.append(prefill_rule(original, cache, index, s.start_slot, (q, k, v, g, beta)))
        else:
            outs.append(tree_rule(cache, index, s, (q, k, v, g, beta)).to(query.dtype))
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[None]


def prefill_rule(original: Callable, cache: HybridCache, layer: int, start: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """transformers' chunked rule over a causal chunk from the committed state, which it advances."""
    states = cache.linear
    assert states.settled[layer] == start, f"prefill at slot {start} over a state of {states.settled[layer]} tokens"
    q, k, v, g, beta = (t[None] for t in inputs)
    out, final = original(q, k, v, g=g, beta=beta, initial_state=states.state[layer][None],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    states.state[layer] = final[0]
    states.settled[layer] = start + q.shape[1]
    return out[0]


def tree_rule(cache: HybridCache, layer: int, s: SegmentInputs, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tree form over the segment's rows, reading earlier pending rows [length, start) as past rows;
    the rows stay pending (x was kept by tree_conv)."""
    states = cache.linear
    base, start = cache.length, s.start_slot
    num_rows = s.row_end - s.row_begin
    allowed = s.allowed
    assert allowed is not None
    past = states.past(layer, base, start, allowed[:, base:start]) if start > base else None
    out, rows = tree_delta_rule(*inputs, states.state[layer], allowed[:, start : start + num_rows], past)
    states.write_rows(layer, start, rows)
    return out
