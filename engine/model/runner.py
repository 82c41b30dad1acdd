"""Decoder layer loop over the engine's own KV cache (Llama, Mistral, Qwen2, Mixtral families).

The engine calls each decoder layer's submodules itself (norms, q/k/v/o projections, MLP or
MoE block), so it depends neither on how transformers iterates its layer list nor on its
cache classes. Attention takes an additive mask over cache slots [0, start + n): the caller
spells out exactly what every new token may see (prefix + its tree ancestors). `prefill` runs a
long prompt layer-major, so a streamed target brings each layer to the device once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model.kv_cache import KVCache

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")
MASK_ALIGN = 16  # mask rows start at multiples of 16 elements, as the memory-efficient kernel reads them


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


def attention_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels a pass enables on `device` (SDPA tries them in its own priority order).

    CUDA: the memory-efficient kernel takes an arbitrary additive mask at any size (flash takes no
    mask, cuDNN is left out); CPU: the flash kernel takes masks. Math is the fallback."""
    if device.type == "cuda":  # CUDA-only
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def masked_rows(num_tokens: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, kv_len rounded up to MASK_ALIGN] filled with finfo.min: storage for aligned mask rows."""
    padded_len = -(-kv_len // MASK_ALIGN) * MASK_ALIGN
    return torch.full((num_tokens, padded_len), torch.finfo(dtype).min, dtype=dtype, device=device)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, kv_len] additive mask (0 where allowed, finfo.min elsewhere) whose rows start at
    MASK_ALIGN-aligned offsets: a view of masked_rows storage, the padding masked too."""
    num_tokens, kv_len = allowed.shape
    mask = masked_rows(num_tokens, kv_len, dtype, allowed.device)
    mask[:, :kv_len].masked_fill_(allowed, 0.0)
    return mask[None, None, :, :kv_len]


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
    attention_backends). Returns [n, heads, head_dim]."""
    num_heads, num_tokens, head_dim = query.shape
    num_kv_heads, kv_len = keys.shape[:2]
    group = num_heads // num_kv_heads
    grouped = query.unflatten(0, (num_kv_heads, group))  # [kv_heads, group, n, head_dim]
    shape = (num_kv_heads, group, kv_len, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys[:, None].expand(shape), values[:, None].expand(shape), attn_mask=mask, scale=scale
    )  # [kv_heads, group, n, head_dim]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)


def causal_allowed(num_tokens: int, start_slot: int, device: torch.device) -> torch.Tensor:
    """[n, start_slot + n] bool: token i (at slot start_slot + i) sees slots [0, start_slot + i]."""
    slots = torch.arange(start_slot + num_tokens, device=device)
    return slots[None, :] <= slots[start_slot:, None]


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
        self.attention_backends: list[SDPBackend] | None = None  # None: by device; a GPU check may pin one

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
        masks = self._masks(allowed, position_ids, cache.positions[:kv_len], set(self.windows))
        hidden = self.embed_tokens(input_ids)[None]  # [1, n, hidden]
        cos, sin = self.rotary_emb(hidden, position_ids[None])  # [1, n, head_dim]
        inputs = PassInputs(cos, sin, cache, start_slot, masks)
        self.layers.begin_pass()
        with self._attention_kernels():
            for idx in range(self.layers.num_layers):
                with self.layers.layer(idx) as layer:
                    hidden = self._layer(layer, idx, hidden, inputs)
        if logit_rows is not None:
            if logit_rows.numel() == 0:
                return None
            hidden = hidden[:, logit_rows]
        return self.lm_head(self.norm(hidden))[0].float()  # [rows, vocab]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: KVCache, chunk_len: int) -> None:
        """Write the KV of `input_ids` ([L]) to slots [cache.length, cache.length + L), each at the
        position equal to its slot, causally; computes no logits and leaves cache.length as it is.

        Layer-major, one pass over the layers: each layer runs every `chunk_len`-token chunk in order
        while it is on the device; chunk c reads the slots that chunks <= c wrote at that layer."""
        start, num_tokens = cache.length, input_ids.shape[0]
        positions = torch.arange(start, start + num_tokens, device=input_ids.device)  # [L]
        cache.write_positions(start, positions)
        hidden = self.embed_tokens(input_ids)[None]  # [1, L, hidden]
        cos, sin = self.rotary_emb(hidden, positions[None])  # [1, L, head_dim]
        bounds = [(begin, min(begin + chunk_len, num_tokens)) for begin in range(0, num_tokens, chunk_len)]
        chunks = [hidden[:, begin:end] for begin, end in bounds]  # each [1, chunk, hidden]
        self.layers.begin_pass()
        with self._attention_kernels():
            for idx in range(self.layers.num_layers):
                window = self.windows[idx]
                with self.layers.layer(idx) as layer:
                    for c, (begin, end) in enumerate(bounds):
                        masks = {window: self._prefill_mask(window, start + begin, end - begin, cache)}
                        inputs = PassInputs(cos[:, begin:end], sin[:, begin:end], cache, start + begin, masks)
                        chunks[c] = self._layer(layer, idx, chunks[c], inputs)

    def _attention_kernels(self) -> AbstractContextManager[None]:
        """Enables the SDPA kernels of this pass: attention_backends, unless a check pinned its own."""
        return sdpa_kernel(self.attention_backends or attention_backends(self.device))

    def _prefill_mask(self, window: int | None, start_slot: int, num_tokens: int, cache: KVCache) -> torch.Tensor:
        """[1, 1, n, start_slot + n] causal mask of prompt tokens (slot == position) under `window`."""
        kv_len = start_slot + num_tokens
        if window is None or kv_len <= window:  # the window does not bind
            return causal_additive_mask(num_tokens, start_slot, self.dtype, cache.device)
        allowed = causal_allowed(num_tokens, start_slot, cache.device)
        positions = cache.positions[:kv_len]
        return self._masks(allowed, positions[start_slot:], positions, {window})[window]

    def attention_accepts(self, backend: SDPBackend, cache: KVCache, num_tokens: int) -> bool:
        """Whether `backend` alone runs this model's attention over `num_tokens` new tokens after the
        cache's committed slots, laid out as a pass lays it out (GPU checks ask for
        EFFICIENT_ATTENTION). Reads layer 0's cache slots, writes nothing."""
        kv_len = cache.length + num_tokens
        query = torch.zeros(num_tokens, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        keys, values = cache.view(0, kv_len)  # [kv_heads, kv_len, head_dim]
        allowed = torch.ones(num_tokens, kv_len, dtype=torch.bool, device=self.device)
        try:
            with sdpa_kernel([backend]):
                attend(query.transpose(0, 1), keys, values, additive_mask(allowed, self.dtype), 1.0)
        except RuntimeError:
            return False
        return True

    def _masks(
        self,
        allowed: torch.Tensor,
        position_ids: torch.Tensor,
        kv_positions: torch.Tensor,
        windows: set[int | None],
    ) -> dict[int | None, torch.Tensor]:
        """Additive masks ([1, 1, n, kv_len], aligned rows) for each sliding window in `windows`."""
        masks: dict[int | None, torch.Tensor] = {}
        for window in windows:
            ok = allowed
            if window is not None:
                ok = ok & ((position_ids[:, None] - kv_positions[None, :]) < window)
            masks[window] = additive_mask(ok, self.dtype)
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
        out = attend(query, keys, values, mask, attn.scaling)  # [n, heads, head_dim]
        return attn.o_proj(out.reshape(1, num_tokens, self.num_heads * self.head_dim))
