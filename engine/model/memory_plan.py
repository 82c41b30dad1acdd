"""Device memory at startup: what must sit on the device, checked against what is free.

    plan = plan_memory(PlanInputs(...))  # pure arithmetic over byte counts and shapes
    check_fits(inputs, plan, free_bytes, "cuda:0")  # ConfigError: what does not fit, what to change

Items already on the device when the plan is checked (weights, the offload ring) are measured; the
KV caches are allocated right after the check; workspaces are the largest transient tensors of a
step and of prefill (and, for GPTQ layers on the dequantize kernel, the dense matrix and temporaries
it makes on every call). The attention estimate assumes the tree pass never materialises
[heads, n, context] scores (an arbitrary-mask kernel, not the math fallback). A hybrid model's caches
hold KV for its attention layers only, and for its linear-attention layers a committed state and the
rows of every pending token (tree nodes: "linear-attention states", engine.model.linear_state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import SMALL_EXTENSION_FACTOR
from engine.model import draft_graphs, layer_shapes
from engine.model.linear_state import STATE_BYTES, LinearShape
from engine.model.runner import DecoderRunner
from engine.types import ConfigError

GB = 10**9
MiB = 2**20
CUDA_RESERVE_BYTES = 512 * MiB  # cuBLAS workspaces, kernels, allocator rounding and fragmentation
MIN_SUGGESTED_CONTEXT = 512  # a smaller --max-context is not offered as the fix
KV_POSITION_BYTES = 8  # KVCache.positions: one int64 per slot


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int  # activations and KV
    num_windows: int  # distinct sliding windows: one additive mask each
    attention_scratch_bytes: int = 0  # score blocks of the eager attention path (attention sinks)
    num_linear_layers: int = 0  # Gated DeltaNet layers: no KV, a recurrent state and pending rows instead
    linear: LinearShape | None = None  # their state dimensions


@dataclass(frozen=True)
class PlanInputs:
    target: ModelShape
    draft: ModelShape | None
    loaded: dict[str, int]  # bytes already on the device, by item name (weights, the offload ring)
    max_context: int
    budget: int  # draft tokens per tree (root excluded); the largest --budget auto may pick
    max_depth: int
    max_expand: int
    prefill_chunk: int  # tokens per prefill forward
    streamed: bool  # the target streams layers: prefill keeps the whole prompt's hidden states
    logits_processing_bytes: int  # processing a tree's logits beyond the raw [n, vocab] fp32 logits
    reserve_bytes: int = 0  # kept free for kernels and the allocator
    max_running: int = 1  # trees per target pass (their roots add to the budget's nodes)
    kv_slots: int = 1  # target + draft KV cache pairs: running requests plus prefix cache
    dequant_scratch_bytes: int = 0  # GPTQ dequantize kernel: its largest matrix's temporaries per call
    draft_graphs: bool = False  # the draft's forwards on its static pass (engine.model.draft_graphs)
    extension_factor: int = SMALL_EXTENSION_FACTOR  # overlap: a tree's extension grows to this many times the budget


@dataclass(frozen=True)
class PlanItem:
    name: str
    nbytes: int
    loaded: bool  # already on the device when the plan is checked


@dataclass(frozen=True)
class MemoryPlan:
    items: tuple[PlanItem, ...]

    @property
    def total(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def to_allocate(self) -> int:
        """Bytes still to come: caches, workspaces, reserve."""
        return sum(item.nbytes for item in self.items if not item.loaded)

    def bytes_of(self, name: str) -> int:
        return sum(item.nbytes for item in self.items if item.name == name)

    def describe(self, loaded: bool | None = None) -> str:
        """`name size, ...` of the items (only loaded or not-loaded ones when given), largest first."""
        chosen = [item for item in self.items if loaded is None or item.loaded == loaded]
        chosen.sort(key=lambda item: -item.nbytes)
        return ", ".join(f"{item.name} {gb(item.nbytes)}" for item in chosen if item.nbytes)


def gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB // 100 else f"{nbytes / 10**6:.2f} MB"


def cache_capacities(max_context: int, budget: int, max_depth: int, max_expand: int) -> tuple[int, int]:
    """KV slots of the target and draft caches: the context plus the largest tree (target), plus one
    slot per node the draft may expand in a step (draft). With overlap, a seed and the growth during the
    pass share the draft's room: growth stops where the cache is full (Drafter.room)."""
    target = max_context + budget + 1
    draft = max_context + max_depth * min(max_expand, budget + 1) + 2
    return target, draft


def pending_slots(max_context: int, budget: int, max_depth: int, max_expand: int,
                  extension_factor: int = SMALL_EXTENSION_FACTOR) -> tuple[int, int]:
    """Uncommitted tokens a hybrid model's caches keep linear-attention rows for (target, draft): the
    target's tree (budget + 1 nodes); the draft's catch-up chain (max_depth + 1) and expanded nodes, up to
    (extension_factor + 1) trees' worth and never past its KV room. A draft whose ring is full grows no
    further that step (Drafter.room), so the bound shapes trees, never exactness."""
    target, draft = cache_capacities(max_context, budget, max_depth, max_expand)
    draft_rows = (extension_factor + 1) * (budget + 1) + max_depth + 2
    return target - max_context, min(draft - max_context, draft_rows)


def kv_cache_bytes(shape: ModelShape, capacity: int) -> int:
    """Bytes of KVCache(shape, capacity): keys and values [attention layers, kv_heads, capacity, head_dim],
    positions."""
    attention_layers = shape.num_layers - shape.num_linear_layers
    per_slot = 2 * attention_layers * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    return capacity * (per_slot + KV_POSITION_BYTES)


def linear_state_bytes(shape: ModelShape, pending: int) -> int:
    """A hybrid model's linear-attention states in one cache (engine.model.linear_state): per linear layer
    the committed state and convolution window, and `pending` uncommitted tokens' rows (tree nodes)."""
    if shape.linear is None:
        return 0
    per_layer = shape.linear.committed_bytes(shape.dtype_bytes) + pending * shape.linear.pending_bytes(shape.dtype_bytes)
    return shape.num_linear_layers * per_layer


def linear_scratch_bytes(shape: ModelShape, rows: int, past: int) -> int:
    """The tree delta rule's largest transients in one layer (engine.model.delta_rule): about four
    [value heads, rows, rows + past] fp32 blocks, and the rows' convolution windows."""
    if shape.linear is None:
        return 0
    blocks = 4 * shape.linear.num_v_heads * rows * (rows + past) * STATE_BYTES
    return blocks + rows * shape.linear.conv_kernel * shape.linear.conv_dim * shape.dtype_bytes


def mask_bytes(shape: ModelShape, rows: int, kv_len: int) -> int:
    """The additive masks ([rows, kv_len], one per window) and the bool masks they are built from."""
    return rows * kv_len * (shape.num_windows * shape.dtype_bytes + 2)


def activation_bytes(shape: ModelShape, rows: int) -> int:
    """One decoder layer's live activations on `rows` tokens: residual, norm, q/k/v/attention out, MLP."""
    attn = 2 * shape.num_heads * shape.head_dim + 2 * shape.num_kv_heads * shape.head_dim
    return rows * (3 * shape.hidden_size + attn + 3 * shape.intermediate_size) * shape.dtype_bytes


def draft_rows(inputs: PlanInputs) -> int:
    """Nodes one draft pass expands: every running tree's forward together (lockstep growth), each at most
    max_expand and its tree's nodes; the trees share the budget (an extension's extension_factor times it)."""
    return min(inputs.max_running * inputs.max_expand, inputs.extension_factor * inputs.budget + inputs.max_running)


def draft_graph_bytes(draft: ModelShape, segments: int, rows_per_tree: int, capacity: int) -> tuple[int, int]:
    """(rows, bytes) of the draft's static passes (engine.model.draft_graphs), block layout: rows, each
    tree's forward padded to its bucket; bytes, every shape's additive mask buffer that could be made
    (segments^2 x bucket x span each, MASK_BYTES in all at most) and, inside a pass, one layer's gathered keys
    and values of every segment's span (the graphs' pool holds the largest pass's transients)."""
    bucket = draft_graphs.row_bucket(rows_per_tree)
    if bucket is None:  # every tree forward runs eagerly
        return 0, 0
    # kv_span's values for every end <= capacity: powers of two from KV_MIN, capped at the capacity
    spans = {min(capacity, max(draft_graphs.KV_MIN, 1 << power)) for power in range(capacity.bit_length() + 1)}
    spans = {span for span in spans if span <= draft_graphs.MAX_SPAN}
    if not spans:
        return 0, 0
    buckets = sum(b for b in draft_graphs.ROW_BUCKETS if b <= bucket)
    masks = sum(s * s for s in range(1, segments + 1)) * buckets * sum(spans) * draft.dtype_bytes
    gathered = 2 * segments * max(spans) * draft.num_kv_heads * draft.head_dim * draft.dtype_bytes
    return segments * bucket, min(draft_graphs.MASK_BYTES, masks) + gathered


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """Every device allocation of a served pair at `max_context` and `budget`, by name."""
    target, draft = inputs.target, inputs.draft
    target_capacity, draft_capacity = cache_capacities(
        inputs.max_context, inputs.budget, inputs.max_depth, inputs.max_expand
    )
    nodes = inputs.budget + inputs.max_running  # tree nodes scored by one target pass, every root included
    chunk = min(inputs.prefill_chunk, inputs.max_context)
    items = [PlanItem(name, nbytes, True) for name, nbytes in inputs.loaded.items()]
    target_pending, draft_pending = pending_slots(inputs.max_context, inputs.budget, inputs.max_depth, inputs.max_expand,
                                                  inputs.extension_factor)
    items += [
        PlanItem("target KV caches", inputs.kv_slots * kv_cache_bytes(target, target_capacity), False),
        PlanItem("target linear-attention states", inputs.kv_slots * linear_state_bytes(target, target_pending), False),
        PlanItem("target linear-attention scratch", linear_scratch_bytes(target, inputs.budget + 1, 0), False),
        PlanItem("target logits", nodes * target.vocab_size * (target.dtype_bytes + 4), False),
        PlanItem("logits processing", inputs.logits_processing_bytes, False),
        PlanItem("target masks", mask_bytes(target, max(nodes, chunk), target_capacity), False),
        PlanItem("target activations", activation_bytes(target, max(nodes, chunk)), False),
        PlanItem("target attention scores", target.attention_scratch_bytes, False),
    ]
    if inputs.streamed:  # layer-major prefill: the prompt's hidden states in and out of a layer
        items.append(PlanItem("prefill hidden states", 2 * inputs.max_context * target.hidden_size
                              * target.dtype_bytes, False))
    if draft is not None:
        rows = draft_rows(inputs)
        per_tree = min(inputs.max_expand, inputs.extension_factor * inputs.budget + 1)  # one tree's forward
        graph_rows, graph_bytes = (draft_graph_bytes(draft, inputs.max_running, per_tree, draft_capacity)
                                   if inputs.draft_graphs else (0, 0))
        items += [
            PlanItem("draft KV caches", inputs.kv_slots * kv_cache_bytes(draft, draft_capacity), False),
            PlanItem("draft linear-attention states", inputs.kv_slots * linear_state_bytes(draft, draft_pending), False),
            PlanItem("draft linear-attention scratch", linear_scratch_bytes(draft, rows, draft_pending), False),
            PlanItem("draft logits", rows * draft.vocab_size * 4 * 3, False),  # logits, log-probs, top-k
            PlanItem("draft masks", mask_bytes(draft, max(rows, chunk), draft_capacity), False),
            PlanItem("draft activations", activation_bytes(draft, max(rows, graph_rows, chunk)), False),
            PlanItem("draft attention scores", draft.attention_scratch_bytes, False),
            PlanItem("draft graphs (masks, gathered KV)", graph_bytes, False),
        ]
    if inputs.dequant_scratch_bytes:
        items.append(PlanItem("dequantization scratch (4-bit, FP8)", inputs.dequant_scratch_bytes, False))
    if inputs.reserve_bytes:
        items.append(PlanItem("kernel and allocator reserve", inputs.reserve_bytes, False))
    return MemoryPlan(tuple(items))


def largest_fitting_context(inputs: PlanInputs, free_bytes: int) -> int | None:
    """The largest max_context below inputs.max_context whose plan fits `free_bytes`, or None."""
    low, high = 1, inputs.max_context - 1  # to_allocate grows with max_context: bisect
    best = None
    while low <= high:
        mid = (low + high) // 2
        if plan_memory(dataclasses.replace(inputs, max_context=mid)).to_allocate <= free_bytes:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def check_fits(inputs: PlanInputs, plan: MemoryPlan, free_bytes: int, device_name: str) -> None:
    """Raise one ConfigError line if what is still to allocate does not fit in `free_bytes`: what does
    not fit, and what to change (the field named is the first remedy that would do)."""
    if plan.to_allocate <= free_bytes:
        return
    context = largest_fitting_context(inputs, free_bytes)
    draft_bytes = plan.bytes_of("draft weights")
    remedies = []
    if context is not None and context >= min(MIN_SUGGESTED_CONTEXT, inputs.max_context):
        remedies.append(f"lower --max-context (limits.max_context) from {inputs.max_context} to {context} or less")
        field = "limits.max_context"
    elif draft_bytes:
        field = "model.draft"
    else:
        field = "offload.gpu_memory"
    if draft_bytes:
        remedies.append(f"use a smaller or quantized draft (model.draft: {gb(draft_bytes)} now; a 1B-3B or GPTQ draft)")
    remedies.append("keep fewer target layers on the device (--offload, lower --gpu-memory or --resident-layers)")
    remedies.append(f"or a smaller --budget (now {inputs.budget})")
    raise ConfigError(
        field,
        f"not enough device memory on {device_name}: after loading ({plan.describe(loaded=True)}) "
        f"{gb(free_bytes)} is free, but the KV caches and workspaces need {gb(plan.to_allocate)} "
        f"({plan.describe(loaded=False)}); " + ", ".join(remedies),
    )


def device_bytes(tensors: Iterable[torch.Tensor], device: torch.device, counted: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` that live on `device` (tied weights count once),
    leaving out storages whose data_ptr is in `counted` (already counted elsewhere) and adding theirs to it."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device == device:
            storage = tensor.untyped_storage()
            if counted is None or storage.data_ptr() not in counted:
                seen[storage.data_ptr()] = storage.nbytes()
    if counted is not None:
        counted.update(seen)
    return sum(seen.values())


def module_tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of `modules` and their submodules."""
    out: list[torch.Tensor] = []
    for module in modules:
        out += [p for p in module.parameters() if p is not None]
        out += [b for b in module.buffers() if b is not None]
    return out


def shape_of(runner: DecoderRunner) -> ModelShape:
    cfg = runner.config
    return ModelShape(
        num_layers=len(runner.hf_layers),
        num_heads=runner.num_heads,
        num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim,
        hidden_size=cfg.hidden_size,
        intermediate_size=layer_shapes.mlp_width(cfg),
        vocab_size=runner.vocab_size,
        dtype_bytes=runner.dtype.itemsize,
        num_windows=len(set(runner.windows)),
        attention_scratch_bytes=layer_shapes.attention_scratch_bytes(runner.family),
        num_linear_layers=sum(runner.linear_layers),
        linear=runner.linear_shape,
    )


def loaded_bytes(
    target: DecoderRunner, draft: DecoderRunner | None, streamed: list[int], ring: list[torch.Tensor]
) -> dict[str, int]:
    """What the loaded pair holds on the target's device, by plan item name; `streamed`: indices of
    the target layers that stream through `ring` (their weights live on the host)."""
    device = target.device
    outer = [target.embed_tokens, target.norm, target.lm_head, target.rotary_emb]
    skip = set(streamed)
    resident = [layer for idx, layer in enumerate(target.hf_layers) if idx not in skip]
    counted: set[int] = set()  # a self-draft shares the target's outer weights and resident layers: once
    loaded = {
        "target embeddings, norm and head": device_bytes(module_tensors(outer), device, counted),
        "target resident layers": device_bytes(module_tensors(resident), device, counted),
        "offload ring": device_bytes(ring, device, counted),
    }
    if draft is not None:
        modules = [draft.embed_tokens, draft.norm, draft.lm_head, draft.rotary_emb, *draft.hf_layers]
        loaded["draft weights"] = device_bytes(module_tensors(modules), device, counted)
    return loaded


def kv_slots_that_fit(inputs: PlanInputs, free_bytes: int) -> int:
    """How many KV slots (a target and a draft cache each) fit in `free_bytes` beside the rest of the
    plan (inputs.kv_slots ignored); 0 when not even one does."""
    one = plan_memory(dataclasses.replace(inputs, kv_slots=1))
    per_slot = sum(one.bytes_of(f"{model} {item}") for model in ("target", "draft")
                   for item in ("KV caches", "linear-attention states"))
    spare = free_bytes - one.to_allocate
    return 0 if spare < 0 else 1 + spare // max(per_slot, 1)
