"""Attention pieces of a pass: additive masks with aligned rows, grouped-query attention.

Masks are additive ([1, 1, n, kv_len]: 0 where a token may attend a slot, finfo.min elsewhere) and
their rows start at MASK_ALIGN-aligned offsets, as the memory-efficient kernel reads them. `attend`
runs SDPA (`attend_heads`: the same call on a pass's per-layer views); `attend_eager` is the explicit
form for what SDPA cannot express (attention sinks, logit soft-capping), a bounded block of query rows
at a time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MASK_ALIGN = 16  # mask rows start at multiples of 16 elements, as the memory-efficient kernel reads them
EAGER_SCORES_BYTES = 128 * 2**20  # attend_eager: fp32 scores of at most this many bytes at a time
# the global flags `sdpa_kernel` sets (torch.nn.attention), read without it
SDPA_FLAGS = {
    SDPBackend.FLASH_ATTENTION: torch._C._get_flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch._C._get_mem_efficient_sdp_enabled,
    SDPBackend.MATH: torch._C._get_math_sdp_enabled,
    SDPBackend.CUDNN_ATTENTION: torch._C._get_cudnn_sdp_enabled,
    SDPBackend.OVERRIDEABLE: torch._C._get_overrideable_sdp_enabled,
}
NO_CONTEXT = nullcontext()  # reentrant, shared


def attention_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels a pass enables on `device` (SDPA tries them in its own priority order).

    CUDA: the memory-efficient kernel takes an arbitrary additive mask at any size (flash takes no
    mask, cuDNN is left out); CPU: the flash kernel takes masks. Math is the fallback."""
    if device.type == "cuda":  # CUDA-only
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def sdpa_backends(backends: list[SDPBackend], device: torch.device) -> AbstractContextManager[object]:
    """`sdpa_kernel(backends)`, or nothing where the flags SDPA reads on `device` already enable exactly
    `backends`, so that SDPA picks the same kernel either way: a CPU pass under the default flags (~25 us a
    pass saved), or any pass inside a step that entered the same backends (engine.speculation.batch). On
    CUDA SDPA reads every flag, so outside such a step, under the default flags (every backend enabled),
    sdpa_kernel is entered as before and SDPA picks what it picked."""
    if device.type == "cpu":  # SDPA on a CPU tensor reads the flash and math flags alone (ATen's
        # select_sdp_backend_cpp: flash where it applies, else math)
        if (torch._C._get_flash_sdp_enabled() == (SDPBackend.FLASH_ATTENTION in backends)
                and torch._C._get_math_sdp_enabled() == (SDPBackend.MATH in backends)):
            return NO_CONTEXT
    elif all(flag() == (backend in backends) for backend, flag in SDPA_FLAGS.items()):
        return NO_CONTEXT
    return sdpa_kernel(backends)


def masked_rows(num_tokens: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, kv_len rounded up to MASK_ALIGN] filled with finfo.min: storage for aligned mask rows."""
    padded_len = -(-kv_len // MASK_ALIGN) * MASK_ALIGN
    return torch.full((num_tokens, padded_len), torch.finfo(dtype).min, dtype=dtype, device=device)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, kv_len] additive mask (0 where allowed, finfo.min elsewhere) whose rows start at
    MASK_ALIGN-aligned offsets: a view of masked_rows storage, the padding masked too."""
    num_tokens, kv_len = allowed.shape
    rows = masked_rows(num_tokens, kv_len, dtype, allowed.device)[:, :kv_len]
    return rows.masked_fill_(allowed, 0.0)[None, None]


def causal_additive_mask(num_tokens: int, start_slot: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """additive_mask(causal_allowed(num_tokens, start_slot)) without the bool mask: [1, 1, n, start_slot + n]."""
    kv_len = start_slot + num_tokens
    mask = masked_rows(num_tokens, kv_len, dtype, device)
    mask[:, :start_slot] = 0.0
    mask[:, start_slot:kv_len].triu_(1)  # token i sees its own chunk's slots up to start_slot + i
    return mask[None, None, :, :kv_len]


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention with an additive mask, in a layout the memory-efficient kernel takes.

    query: [heads, n, head_dim]; keys, values: [kv_heads, kv_len, head_dim]; mask: [1, 1, n, kv_len].
    Query head h reads KV head h // group (group = heads // kv_heads). Each KV head is one batch
    entry whose heads are its query group: K/V expand over the group as stride-0 views and the mask
    broadcasts, so nothing is copied. SDPA picks among the kernels the caller enabled (see
    attention_backends). Returns [n, heads, head_dim]. (attend_heads on the same views: splitting the
    heads axis is a view whatever the query's strides.)"""
    return attend_heads(query[None], keys[:, None], values[:, None], mask, scale)[0]


def attend_heads(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`attend` on a layer's tensors as a pass holds them, with no reshaping around it: query
    [1, heads, n, head_dim] as the attention module made it; keys, values [kv_heads, 1, kv_len, head_dim]
    (a cache row with the group axis: KVCache.pass_views); mask [1, 1, n, kv_len]. The same SDPA call on
    the same views as `attend` (its query is `query[0].unflatten(...)`, this one's a view of the same
    sizes and strides). Returns [1, n, heads, head_dim]."""
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads, _, kv_len, _ = keys.shape
    group = num_heads // num_kv_heads
    shape = (num_kv_heads, group, kv_len, head_dim)
    out = F.scaled_dot_product_attention(
        query.view(num_kv_heads, group, num_tokens, head_dim), keys.expand(shape), values.expand(shape),
        attn_mask=mask, scale=scale,
    )  # [kv_heads, group, n, head_dim]
    return out.permute(2, 0, 1, 3).reshape(1, num_tokens, num_heads, head_dim)

def attend_eager(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attend` written out, as transformers' eager attention computes it: scores = q k^T x scale,
    soft-capped (cap x tanh(scores / cap)) when softcap is set, plus the mask; with sinks ([heads], one
    logit per head, GPT-OSS) each row's softmax also counts exp(sink), which takes no value. fp32
    softmax. Shapes as `attend`; the scores of a block of query rows ([kv_heads, group x rows, kv_len],
    at most EAGER_SCORES_BYTES) exist at a time. Returns [n, heads, head_dim]."""
    num_heads, num_tokens, head_dim = query.shape
    num_kv_heads, kv_len = keys.shape[:2]
    group = num_heads // num_kv_heads
    grouped = query.unflatten(0, (num_kv_heads, group))  # [kv_heads, group, n, head_dim]
    block = max(1, EAGER_SCORES_BYTES // (4 * num_heads * kv_len))
    outs = []
    for begin in range(0, num_tokens, block):
        rows = min(block, num_tokens - begin)
        q = grouped[:, :, begin : begin + rows].reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(q, keys.transpose(1, 2)).float() * scale  # [kv_heads, group x rows, kv_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(num_kv_heads, group, rows, kv_len) + mask[0, :, begin : begin + rows]
        if sinks is not None:
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, rows, 1)
            scores = torch.cat([scores, sink], dim=-1)  # [kv_heads, group, rows, kv_len + 1]
        probs = scores.softmax(dim=-1)[..., :kv_len].to(values.dtype).view(num_kv_heads, group * rows, kv_len)
        outs.append(torch.bmm(probs, values).view(num_kv_heads, group, rows, head_dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [kv_heads, group, n, head_dim]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)


def causal_allowed(num_tokens: int, start_slot: int, device: torch.device) -> torch.Tensor:
    """[n, start_slot + n] bool: token i (at slot start_slot + i) sees slots [0, start_slot + i]."""
    slots = torch.arange(start_slot + num_tokens, device=device)
    return slots[None, :] <= slots[start_slot:, None]


def window_masks(
    allowed: torch.Tensor,
    position_ids: torch.Tensor,
    kv_positions: torch.Tensor,
    windows: set[int | None],
    dtype: torch.dtype,
) -> dict[int | None, torch.Tensor]:
    """Additive masks ([1, 1, n, kv_len], aligned rows) for each sliding window in `windows`.

    allowed: [n, kv_len] bool; position_ids: [n] of the new tokens; kv_positions: [kv_len] of the slots."""
    masks: dict[int | None, torch.Tensor] = {}
    for window in windows:
        ok = allowed
        if window is not None:
            ok = ok & ((position_ids[:, None] - kv_positions[None, :]) < window)
        masks[window] = additive_mask(ok, dtype)
    return masks
