"""A pair's startup device plan from config.json shapes alone: the server's plan without its GPU.

    result = plan_pair(config, total_bytes=24 * 10**9)  # PairPlan: items, KV slots, the refusal or None
    for flags, fitting in alternatives(config, total_bytes): ...

The plan is Engine.reserve_memory's on a CUDA device of `total_bytes` less the CUDA context: the same
items (engine.model.memory_plan), the same KV slot sizing (--max-running and --prefix-cache-slots
lowered to what fits, down to one slot) and the same one-line refusal; the loaded items come from
engine.model.config_shapes instead of a loaded pair. `alternatives` tries the changes the refusal
names (fewer resident layers, a smaller draft of the target's vocabulary, a shorter context) and
keeps those that fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import SELF_DRAFT, EngineConfig
from engine.model import config_shapes, gptq_int4, layer_shapes, memory, memory_plan, self_draft_plan
from engine.model.pair import check_offload_source, max_context_for
from engine.offload.build import plan_resident
from engine.speculation.budget import largest_budget
from engine.speculation.sampling import logits_workspace_bytes
from engine.speculation.step import PREFILL_CHUNK
from engine.types import ConfigError

GB = 10**9
CUDA_CONTEXT_BYTES = 500 * 10**6  # the CUDA context and driver (estimate; not in the free figure the server sees)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PairPlan:
    config: EngineConfig
    inputs: memory_plan.PlanInputs  # with the KV slots the server would allocate
    plan: memory_plan.MemoryPlan
    free: int  # device bytes left after the loaded items
    resident_layers: int
    num_layers: int
    running: int  # requests per pass after sizing
    cache_slots: int  # prefix cache slots after sizing
    sources: tuple[str, ...]  # where each model's shape came from
    refusal: str | None  # the server's one-line refusal, None when it fits
    weights: tuple[config_shapes.ConfigBytes, config_shapes.ConfigBytes | None]  # target's and draft's bytes

    @property
    def fits(self) -> bool:
        return self.refusal is None


def load_dtype(config: EngineConfig, target: dict) -> str:
    """model.dtype, or what `auto` picks on a CUDA GPU of compute capability 8.0+."""
    if config.model.dtype != "auto":
        return config.model.dtype
    return "bfloat16" if config_shapes.checkpoint_dtype(target) == "bfloat16" else "float16"


def gptq_kernels(config: EngineConfig) -> tuple[str, str]:
    """The GPTQ kernel of target and draft on CUDA (gptq.select_kernel: auto is int4 where it applies;
    a target streamed from disk is always dequantize)."""
    asked = config.model.gptq_kernel
    int4 = asked in ("int4", "auto")
    target = "int4" if int4 and not (config.offload.enabled and config.offload.source == "disk") else "dequantize"
    return target, "int4" if int4 else "dequantize"


def scratch_bytes_per_weight(kernel: str) -> int:
    """Device scratch per weight of a quantized matrix's call: gptqmodel's dequantize kernel, or the int4
    kernel's dequantized bf16 weight for calls of many rows (engine.model.gptq_int4)."""
    return config_shapes.DEQUANT_BYTES_PER_WEIGHT if kernel == "dequantize" else gptq_int4.DEQUANT_BYTES_PER_WEIGHT


def dequant_scratch(weights: config_shapes.ConfigBytes, kernel: str) -> int:
    """Device scratch of one call of a model's largest quantized matrix (FP8: counted from its shapes)."""
    if weights.dequant_scratch is not None:
        return weights.dequant_scratch
    return weights.largest_matrix * scratch_bytes_per_weight(kernel)


def draft_graphed(config: EngineConfig, draft_cfg: dict | None, self_draft: bool) -> bool:
    """Whether the engine would run the draft's forwards on its static pass (engine.model.draft_graphs.graphable,
    read from the config): draft graphs on or auto (a CUDA plan), full attention in every layer, no
    linear-attention layers, no experts, plain weights (a self-draft's layers are 4-bit copies)."""
    if config.speculation.draft_graphs is False or draft_cfg is None or self_draft:
        return False
    cfg = layer_shapes.hf_config(draft_cfg)
    return (layer_shapes.config_windows(cfg) == {None} and not layer_shapes.num_linear_layers(cfg)
            and not getattr(cfg, "num_experts_per_tok", None) and "quantization_config" not in draft_cfg)


def plan_pair(config: EngineConfig, total_bytes: int) -> PairPlan:
    """The startup plan of `config` on a CUDA device of `total_bytes` (module doc)."""
    target_cfg, target_source = config_shapes.read_model_config(config.model.target)
    check_offload_source(config, target_cfg)  # what the load refuses (MXFP4 from disk), the plan refuses too
    needs_draft = config.speculation.method != "autoregressive"
    self_draft = needs_draft and config.model.draft == SELF_DRAFT
    if self_draft:
        why = self_draft_plan.target_refusal(target_cfg)
        if why is not None:
            raise ConfigError("model.draft", f"--draft self: {why}")
        draft_cfg, draft_source = target_cfg, self_draft_plan.SOURCE
    else:
        draft_cfg, draft_source = config_shapes.read_model_config(config.model.draft) if needs_draft else (None, "")
    dtype_bytes = DTYPE_BYTES[load_dtype(config, target_cfg)]
    target_kernel, draft_kernel = gptq_kernels(config)
    target = config_shapes.weight_bytes(target_cfg, dtype_bytes, target_kernel)
    resident = list(range(target.num_layers))
    if config.offload.enabled:
        resident = plan_resident(list(target.layers), config.offload)
    if self_draft:  # 4-bit copies of the streamed layers (all, resident), sharing the rest: counted once
        draft_kernel = "int4"
        draft = self_draft_plan.draft_bytes(target_cfg, dtype_bytes, self_draft_plan.copied(target.num_layers, resident))
    else:
        draft = config_shapes.weight_bytes(draft_cfg, dtype_bytes, draft_kernel) if draft_cfg else None
    num_resident = len(resident)
    streams = num_resident < target.num_layers
    streamed = [nbytes for idx, nbytes in enumerate(target.layers) if idx not in set(resident)]
    loaded = {
        "target embeddings, norm and head": target.outer,
        "target resident layers": sum(target.layers[idx] for idx in resident),
        "offload ring": config.offload.ring_size * max(streamed) if streams else 0,  # slots fit the largest
    }
    if draft is not None:
        loaded["draft weights"] = draft.total
    scratch = [(m, kernel) for m, kernel in ((target, target_kernel), (draft, draft_kernel)) if m and m.largest_matrix]
    budget = largest_budget(config.speculation.budget)
    draft_shape = config_shapes.shape_from_config(draft_cfg, dtype_bytes) if draft_cfg else None
    inputs = memory_plan.PlanInputs(
        target=config_shapes.shape_from_config(target_cfg, dtype_bytes),
        draft=draft_shape,
        loaded=loaded,
        max_context=max_context_for(config.limits, target_cfg, config.model.target),
        budget=budget if needs_draft else 0,
        max_depth=config.speculation.max_depth,
        max_expand=config.speculation.max_expand,
        prefill_chunk=PREFILL_CHUNK,
        streamed=streams,
        logits_processing_bytes=logits_workspace_bytes(target_cfg["vocab_size"]),
        reserve_bytes=memory_plan.CUDA_RESERVE_BYTES,
        max_running=config.limits.max_running,
        kv_slots=config.limits.max_running,
        dequant_scratch_bytes=max((dequant_scratch(m, kernel) for m, kernel in scratch), default=0),
        draft_graphs=needs_draft and draft_graphed(config, draft_cfg, self_draft),
        extension_factor=config.speculation.extension_factor_for(bool(draft_shape and draft_shape.num_linear_layers),
                                                                 budget, config.limits.max_running),
    )
    return size_slots(config, inputs, total_bytes - CUDA_CONTEXT_BYTES, num_resident, (target, draft),
                      (target_source, draft_source))


def size_slots(config: EngineConfig, inputs: memory_plan.PlanInputs, device_bytes: int, resident: int,
               weights: tuple[config_shapes.ConfigBytes, config_shapes.ConfigBytes | None],
               sources: tuple[str, ...]) -> PairPlan:
    """Engine.reserve_memory's sizing and check, on `device_bytes` (after the CUDA context)."""
    limits = config.limits
    num_layers = weights[0].num_layers
    free = device_bytes - sum(inputs.loaded.values())
    if free < 0:  # the load itself runs out of memory: no KV slot is sized
        inputs = dataclasses.replace(inputs, max_running=1, kv_slots=1)
        loaded = memory_plan.MemoryPlan(tuple(memory_plan.PlanItem(n, b, True) for n, b in inputs.loaded.items()))
        error = memory.weights_do_not_fit(config, f"{loaded.describe()}: {memory_plan.gb(loaded.total)} for "
                                                  f"{memory_plan.gb(device_bytes)}")
        return PairPlan(config, inputs, memory_plan.plan_memory(inputs), free, resident, num_layers, 1, 0, sources,
                        str(error), weights)
    fit = memory_plan.kv_slots_that_fit(inputs, free)
    running = max(1, min(limits.max_running, fit))
    cache_slots = max(0, min(limits.prefix_cache_slots, fit - running))
    sized = dataclasses.replace(inputs, max_running=running, kv_slots=running + cache_slots)
    plan = memory_plan.plan_memory(sized)
    try:
        memory_plan.check_fits(sized, plan, free, "cuda")
        refusal = None
    except ConfigError as exc:
        refusal = str(exc)
    return PairPlan(config, sized, plan, free, resident, num_layers, running, cache_slots, sources, refusal, weights)


def most_resident_that_fit(config: EngineConfig, total_bytes: int) -> PairPlan | None:
    """`config` with as many resident target layers as fit (at least one KV slot), or None."""
    if not config.offload.enabled:
        config = config.replace("offload", enabled=True, resident_layers=None, gpu_memory=None)
    best = None
    low, high = 0, plan_pair(config.replace("offload", resident_layers=0, gpu_memory=None), total_bytes).num_layers
    while low <= high:  # more resident layers leave less room: bisect
        mid = (low + high) // 2
        result = plan_pair(config.replace("offload", resident_layers=mid, gpu_memory=None), total_bytes)
        if result.fits:
            best, low = result, mid + 1
        else:
            high = mid - 1
    return best


def largest_fitting_context(config: EngineConfig, total_bytes: int) -> PairPlan | None:
    """`config` at the longest --max-context (from 512 up) that fits with one KV slot, or None."""
    best, low = None, memory_plan.MIN_SUGGESTED_CONTEXT
    high = (config.limits.max_context or 8192) - 1
    while low <= high:
        mid = (low + high) // 2
        result = plan_pair(config.replace("limits", max_context=mid), total_bytes)
        if result.fits:
            best, low = result, mid + 1
        else:
            high = mid - 1
    return best


def gpu_memory_flag(result: PairPlan) -> str:
    """--gpu-memory giving result's resident layers (the smallest half GB that does), else --resident-layers."""
    offload = result.config.offload
    if result.resident_layers == result.num_layers or not offload.enabled:
        return f"--resident-layers {result.resident_layers}"
    layer = result.inputs.loaded["offload ring"] // offload.ring_size
    needed = result.resident_layers * layer + offload.ring_size * layer
    gpu_memory = -(-needed // (GB // 2)) / 2
    plain = dataclasses.replace(offload, resident_layers=None, gpu_memory=gpu_memory)
    if len(plan_resident([layer] * result.num_layers, plain)) == result.resident_layers:
        return f"--gpu-memory {gpu_memory:g}"
    return f"--resident-layers {result.resident_layers}"


def same_vocabulary_drafts(config: EngineConfig) -> list[str]:
    """Known models of the target's vocabulary family, other than the target and the configured draft."""
    target, _ = config_shapes.read_model_config(config.model.target)
    family = target.get("vocab_family")
    known = config_shapes.known_models()
    return [name for name, fields in known.items() if family and fields.get("vocab_family") == family
            and name not in (config.model.target, config.model.draft)
            and fields["num_hidden_layers"] * fields["hidden_size"] < target["num_hidden_layers"] * target["hidden_size"]]


def alternatives(config: EngineConfig, total_bytes: int) -> list[tuple[str, PairPlan]]:
    """Changes of the kind the refusal names that make `config` fit: (flags, plan), fewest changes first."""
    found: list[tuple[str, PairPlan]] = []
    offload = "" if config.offload.enabled else "--offload "  # a resident target that does not fit streams
    fewer = most_resident_that_fit(config, total_bytes)
    if fewer is not None:
        found.append((offload + gpu_memory_flag(fewer), fewer))
    for draft in same_vocabulary_drafts(config):
        result = most_resident_that_fit(config.replace("model", draft=draft), total_bytes)
        if result is not None:
            found.append((f"{offload}--draft {draft} {gpu_memory_flag(result)}", result))
    if fewer is None:  # not even streaming every layer fits: a shorter context?
        streamed = config.replace("offload", enabled=True, resident_layers=0, gpu_memory=None)
        shorter = largest_fitting_context(streamed, total_bytes)
        if shorter is not None:
            found.append((f"{offload}--max-context {shorter.inputs.max_context} --resident-layers 0", shorter))
    return found
