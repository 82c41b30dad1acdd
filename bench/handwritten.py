"""The hand-written Llama layer path the engine ran before issue 35, kept as bench.families' baseline.

Until the generic path (each family's own transformers decoder layer with the engine's attention
registered through transformers' attention interface), the runner called a Llama-family layer's
submodules itself: input norm, q/k/v projections, rotary, the engine's attention per segment, o_proj,
post-attention norm, MLP. HandwrittenRunner is the DecoderRunner with that layer step instead: same
loop, streaming, masks and attention kernels, so the two differ only in how a layer runs. Llama, Mistral
and Qwen2 layouts only (no q/k norms, no fused projections, no sinks).

HandwrittenTodayRunner is the same layer step calling the engine's attention of today
(hf_attention.attend_layer, as the generic path does): against it the generic path differs only in
transformers' own per-layer Python (the attention module's call and its wrapper, the config's lookup of
the attention implementation, the rotary helper, the attention interface's entry).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import attend
from engine.model.hf_attention import GroupInputs, attend_layer, segment_mask
from engine.model.runner import DecoderRunner


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HandwrittenRunner(DecoderRunner):
    """DecoderRunner whose layer step is the pre-issue-35 hand-written Llama layer."""

    def _run_layer(self, layer: nn.Module, idx: int, hidden: torch.Tensor, plan: GroupInputs) -> torch.Tensor:
        attn_in = layer.input_layernorm(hidden)
        hidden = hidden + self._attention(layer.self_attn, idx, attn_in, plan)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attention(self, attn: nn.Module, idx: int, hidden: torch.Tensor, plan: GroupInputs) -> torch.Tensor:
        """hidden: [1, rows, hidden] of every segment in the group; each attends over its own cache."""
        num_rows = hidden.shape[1]
        cos, sin = plan.rotary[None]  # [1, rows, head_dim]
        query = attn.q_proj(hidden).view(num_rows, self.num_heads, self.head_dim).transpose(0, 1)
        key = attn.k_proj(hidden).view(num_rows, self.num_kv_heads, self.head_dim).transpose(0, 1)
        value = attn.v_proj(hidden).view(num_rows, self.num_kv_heads, self.head_dim).transpose(0, 1)
        query = query * cos + rotate_half(query) * sin  # [heads, rows, head_dim]
        key = key * cos + rotate_half(key) * sin  # [kv_heads, rows, head_dim]
        outs = []
        for s in plan.segments:
            rows = slice(s.row_begin, s.row_end)
            s.cache.write(idx, s.start_slot, key[:, rows], value[:, rows])
            keys, values = s.cache.view(idx, s.start_slot + s.row_end - s.row_begin)  # [kv_heads, kv_len, head_dim]
            mask = segment_mask(s, self.windows[idx], plan.dtype)
            outs.append(attend(query[:, rows], keys, values, mask, attn.scaling))  # [n, heads, head_dim]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [rows, heads, head_dim]
        return attn.o_proj(out.reshape(1, num_rows, self.num_heads * self.head_dim))


class HandwrittenTodayRunner(HandwrittenRunner):
    """HandwrittenRunner whose attention is today's engine attention, on the tensors laid out as a
    transformers attention module lays them out ([1, heads, rows, head_dim] views)."""

    def _attention(self, attn: nn.Module, idx: int, hidden: torch.Tensor, plan: GroupInputs) -> torch.Tensor:
        num_rows = hidden.shape[1]
        cos, sin = (table[:, None] for table in plan.rotary[None])  # [1, 1, rows, head_dim]
        query = attn.q_proj(hidden).view(1, num_rows, self.num_heads, self.head_dim).transpose(1, 2)
        key = attn.k_proj(hidden).view(1, num_rows, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = attn.v_proj(hidden).view(1, num_rows, self.num_kv_heads, self.head_dim).transpose(1, 2)
        query = query * cos + rotate_half(query) * sin  # [1, heads, rows, head_dim]
        key = key * cos + rotate_half(key) * sin  # [1, kv_heads, rows, head_dim]
        out = attend_layer(plan, idx, query, key, value, attn.scaling, self.windows[idx])  # [1, rows, heads, head_dim]
        return attn.o_proj(out.reshape(1, num_rows, self.num_heads * self.head_dim))
