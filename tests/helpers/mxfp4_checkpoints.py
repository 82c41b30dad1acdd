"""GPT-OSS checkpoints in the hub's MXFP4 layout (openai/gpt-oss-20b, -120b), written by the tests' own
quantizer, with no engine code.

On the hub, each decoder layer's fused experts are stored as
    model.layers.N.mlp.experts.gate_up_proj_blocks  [E, 2I, H / 32, 16] uint8
    model.layers.N.mlp.experts.gate_up_proj_scales  [E, 2I, H / 32]     uint8
    model.layers.N.mlp.experts.down_proj_blocks     [E, H, I / 32, 16]  uint8
    model.layers.N.mlp.experts.down_proj_scales     [E, H, I / 32]      uint8
i.e. the transposes of the loaded [E, in, out] tensors, one row per output feature, cut into blocks of 32
input features: 16 bytes of FP4 e2m1 codes (element 2j in the low nibble, 2j + 1 in the high one) and one
e8m0 scale (2^(s - 127)) per block. Everything else (biases, attention, router, norms, embeddings, head)
is stored in bf16 under its transformers name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# FP4 e2m1 codes 0..15: sign bit 3, then exponent and mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
EXPERTS = ("gate_up_proj", "down_proj")
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] float -> (blocks [E, out, in / 32, 16] uint8, scales [E, out, in / 32] uint8): each block of
    32 scaled by the power of two that brings its largest magnitude to at most 6, then rounded to the nearest
    e2m1 value."""
    rows = weight.transpose(1, 2).double()  # [E, out, in]
    num_experts, out, inp = rows.shape
    blocks = rows.reshape(num_experts, out, inp // BLOCK, BLOCK)
    peak = blocks.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1, dtype=torch.float64)
    codes = (scaled[..., None] - table).abs().argmin(dim=-1).to(torch.uint8)  # [E, out, G, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse: [E, out, G, 16] codes and [E, out, G] scales -> [E, in, out] float32."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], BLOCK).long()
    values = table[codes] * torch.exp2(scales.float() - 127)[..., None]  # [E, out, G, 32]
    return values.reshape(*values.shape[:2], -1).transpose(1, 2).contiguous()


def write_mxfp4(source: Path, out: Path) -> Path:
    """The GPT-OSS checkpoint in `source` rewritten in the hub's MXFP4 layout in `out` (one shard per decoder
    layer plus one for the rest, with an index); returns `out`."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        state.update(load_file(path))
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        parts = name.split(".")
        shard = f"layer{parts[2]}" if name.startswith("model.layers.") else "outer"
        leaf = name.rsplit(".", 1)[-1]
        if ".mlp.experts." in name and leaf in EXPERTS:
            blocks, scales = quantize(tensor.float())
            shards.setdefault(shard, {})[f"{name}_blocks"] = blocks
            shards[shard][f"{name}_scales"] = scales
        else:
            shards.setdefault(shard, {})[name] = tensor.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(shards)
    weight_map = {}
    for i, shard in enumerate(names):
        filename = f"model-{i:05d}-of-{len(names):05d}.safetensors"
        save_file(shards[shard], str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shards[shard], filename))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config |= {"quantization_config": QUANTIZATION_CONFIG, "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        if not path.name.endswith(".safetensors") and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    return out


def expert_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The loaded name -> [E, in, out] float32 of every expert tensor of an MXFP4 checkpoint, by `dequantize`."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    return {name.removesuffix("_blocks"): dequantize(blocks, state[name.replace("_blocks", "_scales")])
            for name, blocks in state.items() if name.endswith("_blocks")}
