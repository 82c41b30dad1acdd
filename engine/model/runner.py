"""Decoder layer loop over the engine's own KV cache (Llama, Mistral, Qwen2, Mixtral families).

The engine calls each decoder layer's submodules itself (norms, q/k/v/o projections, MLP or
MoE block), so it depends neither on how transformers iterates its layer list nor on its
cache classes. Attention takes an additive mask over cache slots [0, start + n): the caller
spells out exactly what every new token may see (prefix + its tree ancestors).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.kv_cache import KVCache

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")


class LayerSource(Protocol):
    """Hands out decoder layers for one pass; the offload streamer implements this too."""

    num_layers: int

    def begin_pass(self) -> None: ...

    def layer(self, idx: int) -> AbstractContextManager[nn.Module]: ...


class ResidentLayers:
    """All layers live on the compute device."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.num_layers = len(layers)

    def begin_pass(self) -> None:
        return None

    @contextmanager
    def layer(self, idx: int) -> Iterator[nn.Module]:
        yield self.layers[idx]


@dataclass
class PassInputs:
    """What every layer of one pass shares."""

    cos: torch.Tensor  # [1, n, head_dim]
    sin: torch.Tensor  # [1, n, head_dim]
    cache: KVCache
    start_slot: int
    masks: dict[int | None, torch.Tensor]  # sliding window -> additive [1, 1, n, kv_len]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderRunner:
    """Runs one HF causal LM (batch 1) over a KVCache with explicit masks and positions."""

    def __init__(self, hf_model: nn.Module, layer_source: LayerSource | None = None):
        arch = type(hf_model).__name__
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHS)}")
        cfg = hf_model.config
        base = hf_model.model
        self.config = cfg
        self.embed_tokens = base.embed_tokens
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = hf_model.lm_head
        self.hf_layers: list[nn.Module] = list(base.layers)
        self.layers: LayerSource = layer_source or ResidentLayers(self.hf_layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.windows = [self._window_of(layer) for layer in self.hf_layers]  # per layer, None = full

    def _window_of(self, layer: nn.Module) -> int | None:
        attn = layer.self_attn
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        if type(attn).__name__.startswith(("Mistral", "Mixtral")):
            return getattr(self.config, "sliding_window", None)
        return None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(
            len(self.hf_layers), self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        start_slot: int,
        allowed: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Score `input_ids` ([n]) written to cache slots [start_slot, start_slot + n).

        allowed: [n, start_slot + n] bool, True where a token may attend a slot.
        logit_rows: which of the n rows need logits (None: all). Returns [rows, vocab] float32.
        """
        num_tokens = input_ids.shape[0]
        kv_len = start_slot + num_tokens
        assert allowed.shape == (num_tokens, kv_len), f"mask {tuple(allowed.shape)} != {(num_tokens, kv_len)}"
        cache.write_positions(start_slot, position_ids)
        masks = self._masks(allowed, position_ids, cache.positions[:kv_len])
        hidden = self.embed_tokens(input_ids)[None]  # [1, n, hidden]
        cos, sin = self.rotary_emb(hidden, position_ids[None])  # [1, n, head_dim]
        inputs = PassInputs(cos, sin, cache, start_slot, masks)
        self.layers.begin_pass()
        for idx in range(self.layers.num_layers):
            with self.layers.layer(idx) as layer:
                hidden = self._layer(layer, idx, hidden, inputs)
        if logit_rows is not None:
            if logit_rows.numel() == 0:
                return None
            hidden = hidden[:, logit_rows]
        return self.lm_head(self.norm(hidden))[0].float()  # [rows, vocab]

    def _masks(
        self, allowed: torch.Tensor, position_ids: torch.Tensor, kv_positions: torch.Tensor
    ) -> dict[int | None, torch.Tensor]:
        """Additive float masks ([1, 1, n, kv_len]) per distinct sliding window."""
        neg = torch.finfo(self.dtype).min
        masks: dict[int | None, torch.Tensor] = {}
        for window in set(self.windows):
            ok = allowed
            if window is not None:
                ok = ok & ((position_ids[:, None] - kv_positions[None, :]) < window)
            mask = torch.zeros(ok.shape, dtype=self.dtype, device=ok.device).masked_fill_(~ok, neg)
            masks[window] = mask[None, None]
        return masks

    def _layer(self, layer: nn.Module, idx: int, hidden: torch.Tensor, inputs: PassInputs) -> torch.Tensor:
        attn_in = layer.input_layernorm(hidden)
        hidden = hidden + self._attention(layer.self_attn, idx, attn_in, inputs)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attention(self, attn: nn.Module, idx: int, hidden: torch.Tensor, inputs: PassInputs) -> torch.Tensor:
        num_tokens = hidden.shape[1]
        cos, sin, cache, start_slot = inputs.cos, inputs.sin, inputs.cache, inputs.start_slot
        query = attn.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)
        key = attn.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)
        value = attn.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)
        query = query * cos + rotate_half(query) * sin  # [heads, n, head_dim]
        key = key * cos + rotate_half(key) * sin  # [kv_heads, n, head_dim]
        cache.write(idx, start_slot, key, value)
        keys, values = cache.view(idx, start_slot + num_tokens)  # [kv_heads, kv_len, head_dim]
        mask = inputs.masks[self.windows[idx]]
        out = F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=mask, scale=attn.scaling, enable_gqa=True
        )  # [1, heads, n, head_dim]
        out = out[0].transpose(0, 1).reshape(1, num_tokens, self.num_heads * self.head_dim)
        return attn.o_proj(out)
