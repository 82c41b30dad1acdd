"""A model's decoder-layer tensors from its config.json fields alone, by transformers' own classes.

    layers = layer_bytes(config, dtype_bytes=2)  # bytes of each decoder layer, loaded at 2 bytes/element

The family's decoder layer class is built on the `meta` device (shapes and dtypes, no memory, ~1 ms a
layer) with the config transformers makes of the fields, so every tensor a family has is counted as the
loaded model holds it: q/k norms, sandwich norms, fused qkv and gate/up projections, biases, attention
sinks, routers, fused experts and shared experts, per-layer differences (dense and MoE layers). The
plan of engine.model.pair_plan sizes resident layers and the ring with these.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from engine.model import families
from engine.model.attention import EAGER_SCORES_BYTES
from engine.offload.layout import layer_tensors
from engine.types import CheckpointError

NOT_CONFIG_FIELDS = ("vocab_family", "draft", "architectures", "transformers_version", "quantization_config",
                     "torch_dtype", "dtype")  # models.toml's own fields, and what a plan reads itself
EAGER_ATTENTION_BLOCKS = 3  # attend_eager holds about 3 score blocks at once (scores, with the sink, softmax)


@lru_cache(maxsize=128)
def _hf_config(fields_json: str) -> PretrainedConfig:
    fields = json.loads(fields_json)
    model_type = fields.get("model_type")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k not in NOT_CONFIG_FIELDS
                                                   and k != "model_type"})
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"config model_type {model_type!r}: transformers cannot build it ({exc})") from exc


def hf_config(config: dict) -> PretrainedConfig:
    """transformers' config object for config.json fields (cached: plans build it many times)."""
    return _hf_config(json.dumps(config, sort_keys=True))


def causal_lm_class(cfg: PretrainedConfig) -> type:
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError as exc:
        raise CheckpointError(f"model_type {cfg.model_type!r} has no causal LM class in transformers") from exc


def family_of_config(cfg: PretrainedConfig) -> families.Family | None:
    return families.BY_ARCHITECTURE.get(causal_lm_class(cfg).__name__)


def decoder_layer_class(cfg: PretrainedConfig) -> type:
    """The family's decoder layer class (named in the model's _no_split_modules, in its modeling file)."""
    model_class = causal_lm_class(cfg)
    module = sys.modules[model_class.__module__]
    for name in model_class._no_split_modules or []:
        layer_class = getattr(module, name, None)
        if layer_class is not None and "DecoderLayer" in name:
            return layer_class
    raise CheckpointError(f"{model_class.__name__}: no decoder layer class found in {module.__name__}")


@lru_cache(maxsize=128)
def _meta_layers(fields_json: str) -> tuple[torch.nn.Module, ...]:
    """Each decoder layer of the config, built on the `meta` device (shapes and dtypes only)."""
    cfg = _hf_config(fields_json)
    layer_class = decoder_layer_class(cfg)
    with torch.device("meta"):
        return tuple(layer_class(cfg, idx) for idx in range(cfg.num_hidden_layers))


@lru_cache(maxsize=128)
def _layer_bytes(fields_json: str, dtype_bytes: int) -> tuple[int, ...]:
    sizes = []
    for layer in _meta_layers(fields_json):
        tensors = layer_tensors(layer).values()  # what a checkpoint holds and streaming moves
        sizes.append(sum(t.numel() * (dtype_bytes if t.is_floating_point() else t.element_size()) for t in tensors))
    return tuple(sizes)


def layer_bytes(config: dict, dtype_bytes: int) -> tuple[int, ...]:
    """Bytes of each decoder layer's parameters and persistent buffers, floating ones at dtype_bytes."""
    return _layer_bytes(json.dumps(config, sort_keys=True), dtype_bytes)


@lru_cache(maxsize=128)
def _layer_linears(fields_json: str) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    return tuple(tuple((name, m.in_features, m.out_features) for name, m in layer.named_modules()
                       if isinstance(m, torch.nn.Linear)) for layer in _meta_layers(fields_json))


def layer_linears(config: dict) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per decoder layer, (name inside the layer, in, out) of each nn.Linear (what an FP8 checkpoint quantizes)."""
    return _layer_linears(json.dumps(config, sort_keys=True))


def mlp_width(cfg: PretrainedConfig) -> int:
    """Intermediate activations per token of the widest MLP: the dense MLP's, or for MoE the experts a
    token is routed to (top-k x the expert's width), whichever is larger."""
    dense = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not top_k:
        return dense
    expert = getattr(cfg, "moe_intermediate_size", None) or dense
    return max(dense, top_k * expert)


def config_windows(cfg: PretrainedConfig) -> set[int | None]:
    """The distinct sliding windows of the layers (None: full attention), as engine.model.families.layer_windows
    finds them on a loaded model."""
    sliding = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return {sliding if kind == "sliding_attention" else None for kind in layer_types}
    return {sliding}


def num_linear_layers(cfg: PretrainedConfig) -> int:
    """Gated DeltaNet layers of a hybrid (layer type linear_attention): no KV, a recurrent state."""
    return sum(kind == "linear_attention" for kind in getattr(cfg, "layer_types", None) or [])


def attention_scratch_bytes(family: families.Family | None) -> int:
    """Device bytes of the score blocks of a family on the eager attention path (attend_eager), else 0."""
    return EAGER_ATTENTION_BLOCKS * EAGER_SCORES_BYTES if family is not None and family.eager_attention else 0
