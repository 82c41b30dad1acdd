"""The self-draft's device bytes from the target's config.json alone (engine.model.pair_plan's draft item).

    draft = draft_bytes(target_config, dtype_bytes=2, copied=copied(num_layers, resident))

A copied layer is the target's layer with every linear map replaced by its 4-bit copy
(self_draft_quant.int4_bytes: 4-bit values, a bf16 scale and zero per group of 128 input features and
output feature); its norms and biases stay at the load dtype. Resident layers, embeddings, final norm
and head are the target's own and are counted once, under the target. The draft's KV caches,
activations and logits have the target's shape (memory_plan's draft items with the target's shape).
"""

from __future__ import annotations

from engine.model import config_shapes, gptq, int4_formats, layer_shapes
from engine.model.config_shapes import ConfigBytes
from engine.model.self_draft_quant import int4_bytes

SOURCE = "the target's own layers: 4-bit copies of the streamed ones, the rest shared"


def target_refusal(target_config: dict) -> str | None:
    """Why the target (its config.json) cannot have a self-draft, from its config alone, or None."""
    if not gptq.streams_as_plain(target_config) or int4_formats.format_of(target_config) is not None:
        return ("the target is already quantized (a 4-bit target streams packed; its 4-bit copy would be "
                "the target itself: keep more of it resident instead)")
    experts = target_config.get("num_local_experts") or target_config.get("num_experts") or 1
    if experts > 1:
        return (f"the target's MoE layers keep their {experts} experts in fused tensors, which the self-draft "
                "does not quantize yet (it copies linear maps only)")
    return None


def copied(num_layers: int, resident: list[int]) -> list[int]:
    """The layers the self-draft copies: the streamed ones, or every layer of a target that streams none."""
    streamed = [idx for idx in range(num_layers) if idx not in set(resident)]
    return streamed or list(range(num_layers))


def layer_copy_bytes(config: dict, dtype_bytes: int) -> tuple[int, ...]:
    """Device bytes of each decoder layer's 4-bit copy."""
    maps = config_shapes.linears(config)
    full = sum(k * n for k, n, _ in maps) * dtype_bytes
    quantized = sum(int4_bytes(k, n) for k, n, _ in maps)
    return tuple(nbytes - full + quantized for nbytes in layer_shapes.layer_bytes(config, dtype_bytes))


def draft_bytes(config: dict, dtype_bytes: int, copied_layers: list[int]) -> ConfigBytes:
    """The self-draft's own bytes: the copies of `copied_layers` (nothing outside the layers: shared)."""
    per_layer = layer_copy_bytes(config, dtype_bytes)
    largest = max(k * n for k, n, _ in config_shapes.linears(config))  # CUDA: calls of many rows dequantize it
    return ConfigBytes(tuple(per_layer[idx] for idx in copied_layers), 0, largest)
