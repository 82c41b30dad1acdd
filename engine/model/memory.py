"""The engine's device memory at startup: measure the loaded pair, plan it (memory_plan),
and tell the user what to change when the weights themselves do not fit."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, SpeculationConfig
from engine.model import fp8, gptq, gptq_int4, memory_plan
from engine.model.config_shapes import DEQUANT_BYTES_PER_WEIGHT
from engine.model.runner import DecoderRunner
from engine.offload.ram_store import host_memory_available
from engine.offload.ring import LayerStreamer
from engine.types import ConfigError


def streamed_layers(runner: DecoderRunner) -> tuple[list[int], list[torch.Tensor]]:
    """Indices of the layers the offload streamer streams, and its ring's device buffers (none, none
    for a resident target)."""
    if not isinstance(runner.layers, LayerStreamer):
        return [], []
    return list(runner.layers.streamed), list(runner.layers.ring)


def free_device_memory(device: torch.device) -> int:
    """Bytes `device` can still allocate: CUDA's free memory plus what PyTorch's caching allocator
    holds unused, and under a per-process memory fraction (torch.cuda.set_per_process_memory_fraction,
    which mem_get_info ignores) no more than the cap minus what is allocated; on CPU the host's
    available memory."""
    if device.type == "cuda":  # CUDA-only
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        return min(available, int(memory_fraction(device) * total) - allocated)
    return host_memory_available()


def memory_fraction(device: torch.device) -> float:
    """The caching allocator's per-process cap as a fraction of the device's memory (1.0: none set;
    torch releases without the getter: taken as none)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # CUDA-only
    return 1.0 if getter is None else float(getter(device))


def plan_inputs(
    target: DecoderRunner,
    draft: DecoderRunner | None,
    spec: SpeculationConfig,
    limits: tuple[int, int, int],
    logits_processing_bytes: int,
) -> memory_plan.PlanInputs:
    """The plan's inputs for a loaded pair; limits: (max_context, budget, prefill_chunk) tokens."""
    max_context, budget, prefill_chunk = limits
    streamed, ring = streamed_layers(target)
    return memory_plan.PlanInputs(
        target=memory_plan.shape_of(target),
        draft=memory_plan.shape_of(draft) if draft is not None else None,
        loaded=memory_plan.loaded_bytes(target, draft, streamed, ring),
        max_context=max_context,
        budget=budget,
        max_depth=spec.max_depth,
        max_expand=spec.max_expand,
        prefill_chunk=prefill_chunk,
        streamed=bool(ring),
        logits_processing_bytes=logits_processing_bytes,
        reserve_bytes=memory_plan.CUDA_RESERVE_BYTES if target.device.type == "cuda" else 0,
        dequant_scratch_bytes=max(dequant_scratch_bytes(target), dequant_scratch_bytes(draft)),
        draft_graphs=draft is not None and draft.graphs is not None,
        extension_factor=spec.extension_factor,
    )


def dequant_scratch_bytes(runner: DecoderRunner | None) -> int:
    """Device bytes a call of the runner's largest quantized matrix makes: gptqmodel's dequantize kernel
    an int8 unpack and three [in, out] fp16 temporaries (DEQUANT_BYTES_PER_WEIGHT per weight; gptqmodel
    7.6's torch path); the int4 kernel on CUDA its dequantized bf16 weight for calls of many rows
    (gptq_int4.DEQUANT_BYTES_PER_WEIGHT); AWQ and compressed-tensors maps on the dequantize kernel their
    weight at the model dtype and a float32 chunk (counted as gptqmodel's, an upper bound); FP8 maps their
    weight at the model dtype and below float32 a float32 chunk of rows (fp8.scratch_bytes); 0 for
    unquantized layers and the int4 kernel on CPU."""
    if runner is None:
        return 0
    largest = 0
    for layer in runner.hf_layers:
        for sub in gptq.quantized_modules(layer).values():
            largest = max(largest, sub.in_features * sub.out_features * DEQUANT_BYTES_PER_WEIGHT)
        for sub in layer.modules():
            if isinstance(sub, fp8.Fp8Linear):
                size = runner.dtype.itemsize
                largest = max(largest, fp8.scratch_bytes(sub.in_features, sub.out_features, sub.fmt, size))
            if getattr(sub, "file_packed", False):  # AWQ / compressed-tensors on the dequantize kernel: at most
                largest = max(largest, sub.in_features * sub.out_features * DEQUANT_BYTES_PER_WEIGHT)
            if isinstance(sub, gptq_int4.Int4Linear) and sub.kernel_device == "cuda":
                largest = max(largest, sub.in_features * sub.out_features * gptq_int4.DEQUANT_BYTES_PER_WEIGHT)
    return largest


def weights_do_not_fit(config: EngineConfig, message: str) -> ConfigError:
    """Loading the weights ran out of device memory: what to change."""
    if not config.offload.enabled:
        return ConfigError("offload.enabled", f"the weights do not fit on the device ({message}); stream the "
                           "target's layers (--offload) or use a smaller or quantized draft (--draft)")
    return ConfigError("model.draft", f"the weights do not fit on the device ({message}); use a smaller or "
                       "quantized draft (a 1B-3B or GPTQ draft), or keep fewer target layers resident (lower "
                       "--gpu-memory or --resident-layers)")
