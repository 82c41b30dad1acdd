"""A heavy benchmark target that computes exactly what the original computes.

A small trained target streams too few bytes to show what offloading a 70B model costs. The padded
copy widens every MLP with zero units (zero gate/up rows, zero down columns: silu(0) * 0 = 0) and
appends decoder layers whose output projections (attention o_proj, MLP down_proj) are zero, so
each extra layer adds exactly 0 to the residual stream yet costs real bytes to stream and real
FLOPs to run. Logits equal the original's up to float summation order; acceptance stays that of
the trained pair. Few, wide layers (~128 MB each, like real offloaded layers) measure bandwidth,
not per-op overhead.

    folder = pad_checkpoint("models/default/target", cache_root(), target_gb=1.5)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LAYER_BYTES = 128 * 2**20  # aim for layers about this large
ALIGN_UNITS = 256  # padded intermediate size is a multiple of this
ZERO_SUFFIXES = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DONE_FILE = "padding.json"
COPY_FORMAT = 2  # part of the cache key: 2 copies every non-weight file (1 left tokenizer_config.json out)


@dataclass(frozen=True)
class PadPlan:
    num_layers: int  # original + extra decoder layers
    intermediate_size: int  # every layer's MLP width after zero-padding
    layer_bytes: int  # fp32 bytes per padded decoder layer
    total_bytes: int  # fp32 bytes of all decoder layers


def layer_param_count(
    hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> int:
    """Parameters of one dense decoder layer (no biases): attention, MLP, two norms."""
    attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    return attention + 3 * hidden * intermediate + 2 * hidden


def plan_padding(config: dict, target_bytes: int, layer_bytes: int = LAYER_BYTES) -> PadPlan:
    """How many layers and how wide an MLP make the decoder layers about `target_bytes` of fp32."""
    hidden = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    base_layers, base_mlp = config["num_hidden_layers"], config["intermediate_size"]
    num_layers = max(base_layers, round(target_bytes / layer_bytes))
    fixed = layer_param_count(hidden, 0, num_heads, num_kv_heads, head_dim) * 4
    per_unit = 3 * hidden * 4
    units = max(base_mlp, math.ceil((target_bytes / num_layers - fixed) / per_unit))
    units = math.ceil(units / ALIGN_UNITS) * ALIGN_UNITS
    per_layer = layer_param_count(hidden, units, num_heads, num_kv_heads, head_dim) * 4
    return PadPlan(num_layers, units, per_layer, per_layer * num_layers)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local checkpoint, as float32 (memory-mapped reads)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    return tensors


def widen(name: str, tensor: torch.Tensor, units: int) -> torch.Tensor:
    """Zero-pad an MLP tensor to `units` intermediate units (other tensors unchanged)."""
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        out = tensor.new_zeros(units, tensor.shape[1])  # [units, hidden]
        out[: tensor.shape[0]] = tensor
        return out
    if name.endswith("down_proj.weight"):
        out = tensor.new_zeros(tensor.shape[0], units)  # [hidden, units]
        out[:, : tensor.shape[1]] = tensor
        return out
    return tensor


def extra_layer(template: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A no-op layer shaped like `template` (one padded layer, names relative to it): norms one,
    output projections zero, every other weight random (real compute on real numbers)."""
    layer: dict[str, torch.Tensor] = {}
    for name, tensor in template.items():
        if name.endswith(ZERO_SUFFIXES):
            layer[name] = torch.zeros_like(tensor)
        elif "norm" in name:
            layer[name] = torch.ones_like(tensor)
        else:
            layer[name] = torch.randn(tensor.shape, generator=generator) * 0.02
    return layer


def padded_tensors(
    tensors: dict[str, torch.Tensor], num_layers: int, plan: PadPlan, seed: int
) -> dict[str, torch.Tensor]:
    """The original tensors with widened MLPs, plus layers num_layers..plan.num_layers - 1."""
    out = {name: widen(name, tensor, plan.intermediate_size).contiguous() for name, tensor in tensors.items()}
    prefix = f"model.layers.{num_layers - 1}."
    template = {name[len(prefix) :]: t for name, t in out.items() if name.startswith(prefix)}
    generator = torch.Generator().manual_seed(seed)
    for idx in range(num_layers, plan.num_layers):
        for name, tensor in extra_layer(template, generator).items():
            out[f"model.layers.{idx}.{name}"] = tensor
    return out


def padded_config(config: dict, plan: PadPlan) -> dict:
    config = dict(config)
    extra = plan.num_layers - config["num_hidden_layers"]
    if isinstance(config.get("layer_types"), list) and config["layer_types"]:
        config["layer_types"] = config["layer_types"] + [config["layer_types"][-1]] * extra
    config.update(num_hidden_layers=plan.num_layers, intermediate_size=plan.intermediate_size)
    config["torch_dtype"] = config["dtype"] = "float32"
    return config


def fingerprint(folder: Path, plan: PadPlan, seed: int) -> str:
    digest = hashlib.sha256(f"{folder.resolve()}|{plan}|{seed}|{COPY_FORMAT}".encode())
    for path in sorted(folder.iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def cache_base() -> Path:
    """~/.cache/specexec (or under $XDG_CACHE_HOME): built benchmark checkpoints."""
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "specexec"


def cache_root() -> Path:
    return cache_base() / "padded"


def pad_checkpoint(
    source: str | Path, root: Path, target_gb: float, seed: int = 0, layer_bytes: int = LAYER_BYTES
) -> tuple[Path, PadPlan]:
    """Write (or reuse) the padded copy of checkpoint `source` under `root`; returns its folder."""
    source = Path(source)
    config = json.loads((source / "config.json").read_text())
    archs = config.get("architectures") or []
    if not any(arch in SUPPORTED for arch in archs):
        raise ValueError(f"{source}: padding supports dense {', '.join(SUPPORTED)}, not {archs}")
    if config.get("quantization_config"):
        raise ValueError(f"{source}: padding supports unquantized checkpoints only (this one is quantized)")
    target_bytes = int(target_gb * 1e9)
    plan = plan_padding(config, target_bytes, layer_bytes)
    folder = root / f"{source.name}-{target_gb:g}gb-{fingerprint(source, plan, seed)}"
    if (folder / DONE_FILE).is_file():
        return folder, plan
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in source.iterdir():  # tokenizer, chat template, generation config: as they are
        weights = path.name.endswith((".safetensors", ".safetensors.index.json"))
        if path.is_file() and not weights and path.name != "config.json":
            shutil.copy2(path, folder / path.name)
    tensors = padded_tensors(read_tensors(source), config["num_hidden_layers"], plan, seed)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(padded_config(config, plan), indent=2))
    info = {"source": str(source.resolve()), "target_gb": target_gb, "seed": seed, **asdict(plan)}
    (folder / DONE_FILE).write_text(json.dumps(info, indent=2))
    return folder, plan
