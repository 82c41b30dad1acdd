"""Decoder layer loop over the engine's own KV cache, for every family of engine.model.families.

The engine owns the loop: which layer runs when and from which buffer (resident, or a streamed ring
slot: engine.offload), layer-major prefill, several segments per pass. Inside a layer the model's own
transformers code runs (its decoder layer's `forward`: norms, projections, q/k norms, rotary, MLP or
MoE block), with the engine's attention registered through transformers' attention interface
(engine.model.hf_attention): it writes keys and values to the segment's cache slots and attends under
an additive mask over slots [0, start + n) that spells out exactly what every new token may see
(prefix + its tree ancestors). Embeddings, rotary tables, final norm and head come from the model's own
modules; the few model-level multipliers transformers keeps in `forward` come from engine.model.families.
A hybrid's Gated DeltaNet layers run their own code too, with the engine's convolution and delta rule
over each segment's tree (engine.model.linear_attention) and their state in a HybridCache (new_cache).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model import families, linear_attention
from engine.model.attention import additive_mask, attend, attention_backends, sdpa_backends, window_masks
from engine.model.hf_attention import GroupInputs, SegmentInputs, engine_attention
from engine.model.hybrid_cache import HybridCache
from engine.model.kv_cache import KVBlock, KVCache
from engine.model.linear_state import LinearShape
from engine.model.rotary_table import RotaryTables, module_rotary, static_rope

# wrappers transformers puts around a decoder layer's forward that do nothing in the engine's pass, skipped
# (by the wrapper function's own name): gradient checkpointing (training only; 5.24 wraps forward, 5.17
# overrides __call__) and deprecate_kwarg (renames a cache kwarg the engine never passes). ~10 us a layer.
PASS_THROUGH_WRAPPERS = ("forward_with_checkpointing", "wrapped_func")


COMPILED_LAYER_SHAPES = 16  # compile_layers: graphs dynamo may keep per layer forward (pass kinds)


def plain_forward(layer_class: type) -> Callable[..., torch.Tensor]:
    """The layer class's forward without the pass-through wrappers (any other wrapper is kept)."""
    forward = layer_class.forward
    while getattr(forward, "__code__", None) is not None and forward.__code__.co_name in PASS_THROUGH_WRAPPERS:
        forward = forward.__wrapped__
    return forward


class LayerSource(Protocol):
    """Hands out decoder layers for one pass; the offload streamer implements this too."""

    num_layers: int

    def begin_pass(self) -> None: ...

    def layer(self, idx: int) -> AbstractContextManager[nn.Module]: ...


class GroupForward(Protocol):
    """Runs one group's pass another way (engine.model.draft_graphs), or returns None to leave it to the loop."""

    def forward(self, group: list[Segment]) -> list[torch.Tensor | None] | None: ...

    def forget(self) -> None: ...  # drop what was made for caches that are going away


class ResidentLayers:
    """All layers live on the compute device."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.num_layers = len(layers)

    def begin_pass(self) -> None:
        return None

    def layer(self, idx: int) -> AbstractContextManager[nn.Module]:
        return nullcontext(self.layers[idx])  # a generator-based context manager cost ~2 us a layer


@dataclass
class Segment:
    """One sequence's tokens in a pass: input_ids [n] written to `cache` slots [start_slot, start_slot + n)."""

    input_ids: torch.Tensor  # [n] long
    # [n] long, each < start_slot + n: a token's predecessors and itself sit in slots below that (rotary tables)
    position_ids: torch.Tensor
    cache: KVCache
    start_slot: int
    allowed: torch.Tensor | None  # [n, start_slot + n] bool; None: causal, each token at position == slot
    logit_rows: torch.Tensor | None = None  # rows that need logits (None: all; empty: none)


def prefill_groups(input_ids: torch.Tensor, cache: KVCache, start_slot: int, chunk_len: int) -> list[list[Segment]]:
    """Causal prefill of input_ids ([L]) at slots (= positions) from start_slot, one group per chunk."""
    groups = []
    for begin in range(0, input_ids.shape[0], chunk_len):
        chunk = input_ids[begin : begin + chunk_len]
        positions = torch.arange(start_slot + begin, start_slot + begin + chunk.shape[0], device=chunk.device)
        no_rows = positions[:0]
        groups.append([Segment(chunk, positions, cache, start_slot + begin, None, no_rows)])
    return groups


class DecoderRunner:
    """Runs one HF causal LM (batch 1) over a KVCache with explicit masks and positions."""

    def __init__(self, hf_model: nn.Module, layer_source: LayerSource | None = None):
        self.family = families.family_of(hf_model)  # ValueError: a family the engine cannot run
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
        self.vocab_size = cfg.vocab_size  # logits per row
        self.num_embeddings = self.embed_tokens.num_embeddings  # input ids this model can embed
        # an id in [num_embeddings, vocab of the ids fed in) is embedded as this one (a draft whose
        # embedding is smaller than the target's padded vocabulary); None: every fed id is embeddable
        self.fallback_input_id: int | None = None
        self.windows = families.layer_windows(cfg, self.hf_layers)  # per layer, None = full
        self.window_set = set(self.windows)
        # per layer: a Gated DeltaNet layer (recurrent state in a HybridCache) rather than attention
        self.linear_layers = [hasattr(layer, "linear_attn") for layer in self.hf_layers]
        self.attention_layers = [idx for idx, linear in enumerate(self.linear_layers) if not linear]
        for layer in self.hf_layers:
            if hasattr(layer, "linear_attn"):
                linear_attention.install(type(layer.linear_attn))
        self.rotary_keys = self._rotary_keys()  # per layer: which rotary table it reads
        self.rotary_key_set = sorted(set(self.rotary_keys), key=str)
        # cos/sin by position from tables the rotary module made (None: computed per pass, engine.model.rotary_table)
        self.rotary_tables = RotaryTables(self.rotary_emb, self.rotary_key_set) if static_rope(self.rotary_emb) else None
        # per layer: its class's forward, called as forward(layer, ...): no module hooks (the engine sets none)
        self.layer_forwards = [plain_forward(type(layer)) for layer in self.hf_layers]
        self.attention_backends: list[SDPBackend] | None = None  # None: by device; a GPU check may pin one
        self.graphs: GroupForward | None = None  # a draft's one-group passes as CUDA graphs (engine.model.draft_graphs)

    def compile_layers(self) -> None:
        """The decoder layers' forwards through torch.compile (dynamic shapes): their norms, rotary and MLP
        glue fused into fewer kernels where kernel launches bound a small pass (a draft's tree forward on a
        GPU); the engine's attention runs eagerly between the compiled parts. Layers of one class share
        one compiled forward. Experimental (bench.gpu_check's draftpass section measures it): outputs
        agree with the eager forward to rounding, so only a draft (whose proposals verification checks)
        should run compiled."""
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_LAYER_SHAPES)
        compiled: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {}
        self.layer_forwards = [compiled.setdefault(forward, torch.compile(forward, dynamic=True))
                               for forward in self.layer_forwards]

    def _rotary_keys(self) -> list[str | None]:
        """Per layer, the argument its rotary table is computed with: its layer type where the model's
        rotary module takes one (Gemma 3's local and global tables), else None (one table)."""
        if "layer_type" not in inspect.signature(self.rotary_emb.forward).parameters:
            return [None] * len(self.hf_layers)
        return list(self.config.layer_types[: len(self.hf_layers)])

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def linear_shape(self) -> LinearShape | None:
        """The state dimensions of a hybrid model's linear-attention layers (None: it has none)."""
        return LinearShape.from_config(self.config) if any(self.linear_layers) else None

    def new_cache(self, capacity: int, pending_slots: int | None = None) -> KVCache:
        """A cache of `capacity` slots; a hybrid model's keeps `pending_slots` uncommitted tokens' rows of
        its linear layers (None: capacity)."""
        shape = self.linear_shape
        if shape is not None:
            return HybridCache(self.linear_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype,
                               self.device, shape, capacity if pending_slots is None else pending_slots)
        return KVCache(
            len(self.hf_layers), self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device
        )

    def new_caches(self, count: int, capacity: int, pending_slots: int | None = None) -> list[KVCache]:
        """`count` caches as new_cache makes them; a plain model's in one KVBlock (one allocation, every
        cache's slots addressable by one index: engine.model.draft_graphs)."""
        if self.linear_shape is not None:
            return [self.new_cache(capacity, pending_slots) for _ in range(count)]
        block = KVBlock(len(self.hf_layers), self.num_kv_heads, self.head_dim, capacity, count, self.dtype, self.device)
        return [KVCache(len(self.hf_layers), self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device,
                        block, index) for index in range(count)]

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
        logit_rows: which of the n rows need logits (None: all). Returns [rows, vocab] float32."""
        segment = Segment(input_ids, position_ids, cache, start_slot, allowed, logit_rows)
        return self.forward_groups([[segment]])[0][0]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: KVCache, chunk_len: int) -> None:
        """Write the KV of `input_ids` ([L]) to slots [cache.length, cache.length + L), each at the
        position equal to its slot, causally; computes no logits and leaves cache.length as it is.

        Layer-major, one pass over the layers: each layer runs every `chunk_len`-token chunk in order
        while it is on the device; chunk c reads the slots that chunks <= c wrote at that layer."""
        self.forward_groups(prefill_groups(input_ids, cache, cache.length, chunk_len))

    @torch.inference_mode()
    def forward_groups(self, groups: list[list[Segment]]) -> list[list[torch.Tensor | None]]:
        """One pass over the layers for every segment (each its own cache, slots, positions, mask).

        At each layer the groups run in order; a group's segments share the dense work (norms,
        projections, MLP) as one [1, rows, hidden] block, and each attends over its own cache. A
        segment sees what earlier groups wrote at that layer (prefill chunks, then trees after them).
        Returns, per group and segment, [rows, vocab] float32 logits (None where no rows are asked)."""
        if self.graphs is not None and len(groups) == 1:
            outputs = self.graphs.forward(groups[0])
            if outputs is not None:
                return [outputs]
        plans = [self._group_inputs(group) for group in groups]
        hidden = [self.embed(group[0].input_ids if len(group) == 1 else torch.cat([s.input_ids for s in group]))[None]
                  for group in groups]
        self.layers.begin_pass()
        with self.attention_kernels(), engine_attention(self.config):
            for idx in range(self.layers.num_layers):
                with self.layers.layer(idx) as layer:
                    for g, plan in enumerate(plans):
                        hidden[g] = self._run_layer(layer, idx, hidden[g], plan)
        return [self._logits(group, plan, h) for group, plan, h in zip(groups, plans, hidden, strict=True)]

    def _run_layer(self, layer: nn.Module, idx: int, hidden: torch.Tensor, plan: GroupInputs) -> torch.Tensor:
        """hidden [1, rows, hidden] through the family's own decoder layer (its attention module calls the
        engine's attention: hf_attention, with this group and layer passed through the layer's kwargs)."""
        return self.layer_forwards[idx](
            layer, hidden, position_ids=plan.position_ids, position_embeddings=plan.rotary[self.rotary_keys[idx]],
            specexec_group=plan, specexec_layer=idx,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[n] ids -> [n, hidden], scaled as the model scales them; with fallback_input_id, ids past the
        embedding are embedded as it (on the device: no host sync, no out-of-range lookup)."""
        if self.fallback_input_id is not None:
            fallback = torch.full_like(input_ids, self.fallback_input_id)
            input_ids = torch.where(input_ids < self.num_embeddings, input_ids, fallback)
        return families.scale_embeddings(self.family, self.config, self.embed_tokens(input_ids))

    def _group_inputs(self, group: list[Segment]) -> GroupInputs:
        """Positions written to each cache; rotary tables of the group's rows; masks for segments with
        an explicit `allowed`."""
        positions = group[0].position_ids if len(group) == 1 else torch.cat([s.position_ids for s in group])  # [rows]
        rotary = self._rotary_inputs(positions, max(s.start_slot + s.input_ids.shape[0] for s in group))
        inputs, row = [], 0
        for s in group:
            num_tokens = s.input_ids.shape[0]
            kv_len = s.start_slot + num_tokens
            s.cache.write_positions(s.start_slot, s.position_ids)
            masks = {}
            if s.allowed is not None:
                assert s.allowed.shape == (num_tokens, kv_len), f"mask {tuple(s.allowed.shape)} != {(num_tokens, kv_len)}"
                masks = window_masks(s.allowed, s.position_ids, s.cache.positions[:kv_len], self.window_set, self.dtype)
            inputs.append(SegmentInputs(s.cache, s.start_slot, row, row + num_tokens, s.allowed, s.position_ids, masks,
                                        alone=len(group) == 1))
            row += num_tokens
        return GroupInputs(positions[None], rotary, inputs, self.dtype)

    def _rotary_inputs(self, positions: torch.Tensor, bound: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary key, (cos, sin) of `positions` ([rows], each < bound): [1, rows, rotary dim] each, looked
        up in the rotary tables where the model has them, else from the model's rotary module."""
        weight = self.embed_tokens.weight  # the rotary module reads dtype and device off it
        if self.rotary_tables is not None:
            rotary = self.rotary_tables.lookup(weight, positions, bound)
            if rotary is not None:
                return rotary
        return {key: module_rotary(self.rotary_emb, weight[:1, None], positions[None], key) for key in self.rotary_key_set}

    def _logits(self, group: list[Segment], plan: GroupInputs, hidden: torch.Tensor) -> list[torch.Tensor | None]:
        """norm + head (+ the family's logit scaling) over the rows the segments ask for, in one call;
        split back per segment."""
        if len(group) == 1 and group[0].logit_rows is None:  # one segment, every row: no row selection
            return [families.scale_logits(self.family, self.config, self.lm_head(self.norm(hidden)))[0].float()]
        return self.head_rows(group, [inputs.row_begin for inputs in plan.segments], hidden)

    def head_rows(self, group: list[Segment], begins: list[int], hidden: torch.Tensor) -> list[torch.Tensor | None]:
        """norm + head (+ scaling) over the rows each segment asks for (its logit_rows of its rows from
        begins[i] in hidden [1, rows, hidden], else all of them), in one call: per segment [rows, vocab]
        float32, None where it asks for none."""
        rows, counts = [], []
        for s, begin in zip(group, begins, strict=True):
            wanted = torch.arange(begin, begin + s.input_ids.shape[0], device=hidden.device)
            if s.logit_rows is not None:
                wanted = wanted[s.logit_rows]
            rows.append(wanted)
            counts.append(wanted.shape[0])
        if sum(counts) == 0:
            return [None] * len(group)
        all_rows = torch.cat(rows)
        selected = hidden if all_rows.shape[0] == hidden.shape[1] else hidden[:, all_rows]
        logits = families.scale_logits(self.family, self.config, self.lm_head(self.norm(selected)))
        parts = logits[0].float().split(counts)  # [sum(counts), vocab]
        return [part if count else None for part, count in zip(parts, counts, strict=True)]

    def attention_kernels(self) -> AbstractContextManager[object]:
        """Enables the SDPA kernels of this model's passes: attention_backends, unless a check pinned its own
        (nothing to enter where the flags already say so: attention.sdpa_backends)."""
        return sdpa_backends(self.attention_backends or attention_backends(self.device), self.device)

    def attention_accepts(self, backend: SDPBackend, cache: KVCache, num_tokens: int) -> bool:
        """Whether `backend` alone runs this model's attention over `num_tokens` new tokens after the
        cache's committed slots, laid out as a pass lays it out (GPU checks ask for
        EFFICIENT_ATTENTION). Reads layer 0's cache slots, writes nothing."""
        kv_len = cache.length + num_tokens
        query = torch.zeros(num_tokens, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        keys, values = cache.view(self.attention_layers[0], kv_len)  # [kv_heads, kv_len, head_dim]
        allowed = torch.ones(num_tokens, kv_len, dtype=torch.bool, device=self.device)
        try:
            with sdpa_kernel([backend]):
                attend(query.transpose(0, 1), keys, values, additive_mask(allowed, self.dtype), 1.0)
        except RuntimeError:
            return False
        return True
