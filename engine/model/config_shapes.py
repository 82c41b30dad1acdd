"""A model's memory-plan shape and weight bytes from its config.json alone: no weights, no GPU.

    config, source = read_model_config("meta-llama/Llama-3.1-70B-Instruct")  # folder, else known shapes
    weights = weight_bytes(config, dtype_bytes=2, gptq_kernel="dequantize")

`specexec plan` sizes a pair with these; a loaded pair's plan measures the same items from the
loaded tensors (tests compare both on tiny checkpoints of every family, GPTQ included).

A model path is read as a folder holding config.json when one exists. Otherwise, a hub id's config.json
in the local Hugging Face cache; else configs/shapes/models.toml, which lists the config.json fields the
plan needs for the models the shipped configs and the README name (copied from their config.json on the
Hugging Face Hub), so a plan needs no download; else the id's config.json downloaded alone
(engine.model.hub).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tomllib

from engine import multimodal
from engine.model import families, layer_shapes
from engine.model.linear_state import LinearShape
from engine.model.memory_plan import ModelShape
from engine.types import CheckpointError

KNOWN_SHAPES = Path(__file__).resolve().parents[2] / "configs" / "shapes" / "models.toml"
DEQUANT_BYTES_PER_WEIGHT = 7  # gptqmodel's torch kernel: int8 unpack + three [K, N] fp16 temporaries
GPTQ_SCALE_BYTES = 2  # fp16 scales


def known_models(path: Path = KNOWN_SHAPES) -> dict[str, dict]:
    """Hub id -> config.json fields, from configs/shapes/models.toml."""
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def read_model_config(model: str) -> tuple[dict, str]:
    """(config.json fields, where they came from) for a model folder or a hub id: the hub cache's
    config.json, the known shapes, else its config.json downloaded alone (engine.model.hub)."""
    from engine.model import hub

    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        config_file = hub.model_config_file(model, download=False) or Path(model) / "config.json"
    if config_file.is_file():
        config = multimodal.language_model_config(json.loads(config_file.read_text()))
        refused = families.refusal(config.get("architectures") or [])
        if refused is not None:  # what the load refuses, the plan refuses too
            raise CheckpointError(f"{model}: {refused}")
        return config, str(config_file)
    known = known_models()
    if model in known:
        return known[model], f"{KNOWN_SHAPES.name} [{model}]"
    downloaded = hub.model_config_file(model, download=True)
    if downloaded is not None:
        return multimodal.language_model_config(json.loads(downloaded.read_text())), str(downloaded)
    if not hub.looks_like_hub_id(model):
        raise CheckpointError(f"{model}: no config.json there; name a model folder, or a hub id (org/name)")
    raise CheckpointError(
        f"{model}: not in the Hugging Face cache, not among the known shapes ({KNOWN_SHAPES}), and its "
        f"config.json could not be downloaded now (offline, or no such model on the Hub); download its "
        f"config.json (`hf download {model} config.json`) or name a folder holding it"
    )


def checkpoint_dtype(config: dict) -> str:
    return str(config.get("dtype") or config.get("torch_dtype") or "float16").removeprefix("torch.")


def _dims(config: dict) -> tuple[int, int, int, int, int, int]:
    """hidden, heads, kv heads, head_dim, intermediate, experts."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return hidden, heads, kv_heads, head_dim, config["intermediate_size"], config.get("num_local_experts") or 1


def shape_from_config(config: dict, dtype_bytes: int) -> ModelShape:
    """The plan's shape of a model, from transformers' config of its fields (windows per layer type, the
    MoE experts a token runs through, the eager attention's score blocks)."""
    hidden, heads, kv_heads, head_dim, _, _ = _dims(config)
    cfg = layer_shapes.hf_config(config)
    return ModelShape(
        num_layers=config["num_hidden_layers"], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=hidden, intermediate_size=layer_shapes.mlp_width(cfg), vocab_size=config["vocab_size"],
        dtype_bytes=dtype_bytes, num_windows=len(layer_shapes.config_windows(cfg)),
        attention_scratch_bytes=layer_shapes.attention_scratch_bytes(layer_shapes.family_of_config(cfg)),
        num_linear_layers=layer_shapes.num_linear_layers(cfg),
        linear=LinearShape.from_config(cfg) if layer_shapes.num_linear_layers(cfg) else None,
    )


def linears(config: dict) -> list[tuple[int, int, bool]]:
    """(in, out, has bias) of every linear map of one decoder layer (MoE: every expert's)."""
    hidden, heads, kv_heads, head_dim, intermediate, experts = _dims(config)
    qwen = config.get("model_type") == "qwen2"
    attn_bias = qwen or bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))
    maps = [(hidden, heads * head_dim, attn_bias), (hidden, kv_heads * head_dim, attn_bias),
            (hidden, kv_heads * head_dim, attn_bias), (heads * head_dim, hidden, bool(config.get("attention_bias")))]
    maps += [(hidden, intermediate, mlp_bias), (hidden, intermediate, mlp_bias), (intermediate, hidden, mlp_bias)] * experts
    return maps


def gptq_linear_bytes(k: int, n: int, bias: bool, quant: dict, gptq_kernel: str) -> int:
    """Device bytes of one GPTQ 4-bit linear map (k in, n out) in the kernel's form: dequantize keeps
    qweight, qzeros, scales and g_idx; int4 keeps packed weights, bf16 scale and zero pairs, and an
    input permutation with act-order."""
    bits = int(quant.get("bits", 4))
    group = int(quant.get("group_size", 128))
    group = k if group <= 0 else group
    groups = -(-k // group)
    bias_bytes = n * GPTQ_SCALE_BYTES if bias else 0
    weights = k * n * bits // 8
    if gptq_kernel == "int4":
        perm = k * 8 if quant.get("desc_act") else 0
        return weights + groups * n * 4 + perm + bias_bytes
    return weights + groups * n * bits // 8 + groups * n * GPTQ_SCALE_BYTES + k * 4 + bias_bytes


@dataclass(frozen=True)
class ConfigBytes:
    """Device bytes of a model's weights, from its config.json."""

    layers: tuple[int, ...]  # each decoder layer
    outer: int  # embeddings, final norm, head
    largest_matrix: int  # elements of the largest quantized matrix (0: not quantized)
    dequant_scratch: int | None = None  # FP8: device bytes of its largest per-call dequantization (engine.model.fp8)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer(self) -> int:
        """The largest decoder layer (a ring slot's size)."""
        return max(self.layers)

    @property
    def total(self) -> int:
        return self.outer + sum(self.layers)


def weight_bytes(config: dict, dtype_bytes: int, gptq_kernel: str = "dequantize") -> ConfigBytes:
    """Bytes of `config`'s weights loaded at `dtype_bytes` per element: each decoder layer as the family's
    own layer class holds it (layer_shapes; GPT-OSS's MXFP4 experts too, which load dequantized); a 4-bit
    checkpoint's quantized layers (dense Llama-shaped layers: `linears`) in `gptq_kernel`'s form (AWQ and
    compressed-tensors on the dequantize kernel: the file's own tensors), its other tensors at the load dtype."""
    from engine.model import fp8, int4_formats, mxfp4

    if fp8.format_of(config) is not None:
        return fp8_weight_bytes(config, dtype_bytes)
    hidden, _, _, _, _, experts = _dims(config)
    quant = {} if mxfp4.is_mxfp4(config) else int4_formats.plan_fields(config)  # MXFP4: loaded dequantized
    largest = 0
    if quant:
        maps = linears(config)
        if gptq_kernel == "dequantize" and int4_formats.format_of(config) is not None:  # the file's form
            layer = sum(int4_formats.file_linear_bytes(k, n, bias, config, dtype_bytes) for k, n, bias in maps)
        else:
            layer = sum(gptq_linear_bytes(k, n, bias, quant, gptq_kernel) for k, n, bias in maps)
        largest = max(k * n for k, n, _ in maps)
        layer += 2 * hidden * dtype_bytes  # the two norms
        if experts > 1:
            layer += hidden * experts * dtype_bytes  # the router
        layers = (layer,) * config["num_hidden_layers"]
    else:
        layers = layer_shapes.layer_bytes(config, dtype_bytes)
    return ConfigBytes(layers, outer_bytes(config, dtype_bytes), largest)


def outer_bytes(config: dict, dtype_bytes: int) -> int:
    """Embeddings, final norm and head (one matrix when tied) at the load dtype."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    return (vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2) + hidden) * dtype_bytes


def fp8_weight_bytes(config: dict, dtype_bytes: int) -> ConfigBytes:
    """An FP8 checkpoint's bytes: each decoder layer as the family's layer class holds it, its linear
    maps (less those modules_to_not_convert names) as stored, 1 byte a weight plus float32 scales (per block or per tensor); the
    rest, a quantized head included (dequantized at load), at the load dtype; and the largest map's per-call
    dequantization scratch (engine.model.fp8)."""
    from engine.model import fp8

    fmt = fp8.format_of(config)
    assert fmt is not None
    dense = layer_shapes.layer_bytes(config, dtype_bytes)
    layers, largest, scratch = [], 0, 0
    for nbytes, maps in zip(dense, layer_shapes.layer_linears(config), strict=True):
        quantized = [(k, n) for name, k, n in maps if not fp8.not_converted(name, fmt)]
        layers.append(nbytes + sum(fp8.linear_bytes(k, n, fmt) - k * n * dtype_bytes for k, n in quantized))
        largest = max([largest, *(k * n for k, n in quantized)])
        scratch = max([scratch, *(fp8.scratch_bytes(k, n, fmt, dtype_bytes) for k, n in quantized)])
    return ConfigBytes(tuple(layers), outer_bytes(config, dtype_bytes), largest, scratch)
