"""Tiny block-wise FP8 checkpoints in the hub's layout (Qwen3-*-FP8), written with no engine code, and the
dense model the test dequantizes itself from the files.

    write_fp8(fp32_folder, out, quantize_head=False)   # weight float8_e4m3fn + weight_scale_inv per block
    model = dequantized_model(out, fp32_folder)        # plain transformers model, weights from the files

Every decoder-layer projection is quantized per BLOCK x BLOCK block (blocks at the end of either
dimension partial): scale = amax(|w|) / 448 over the block (1 for an all-zero block), weight =
(w / scale).to(float8_e4m3fn), stored scale_inv = scale (float32, [ceil(N / BLOCK), ceil(K / BLOCK)]),
as transformers' Fp8Quantize stores it. The other tensors are saved in bf16, as the releases do;
config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128]}, with modules_to_not_convert ["lm_head"] unless the head is quantized too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[ceil(N / BLOCK), ceil(K / BLOCK)] -> [N, K]: each block's scale over its elements."""
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, K], scale [ceil(N / BLOCK), ceil(K / BLOCK)] float32)."""
    n, k = weight.shape
    w = weight.float()
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    amax = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            amax[i, j] = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / expand(scale, n, k)).to(torch.float8_e4m3fn), scale


def write_fp8(fp32_folder: Path, out: Path, quantize_head: bool = False) -> Path:
    state = load_file(str(fp32_folder / "model.safetensors"))
    tensors = {}
    for name in list(state):
        leaf = name.split(".")[-2] if name.endswith(".weight") else ""
        if leaf in PROJECTIONS or (quantize_head and name == "lm_head.weight"):
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize(state.pop(name))
    tensors.update({name: value.bfloat16() for name, value in state.items()})
    out.mkdir(parents=True)
    for path in fp32_folder.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((fp32_folder / "config.json").read_text())
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    if not quantize_head:
        quant["modules_to_not_convert"] = ["lm_head"]
    config.update(quantization_config=quant, dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint written above in float32, each FP8 weight dequantized here:
    w = fp8 x its block's scale."""
    state = load_file(str(folder / "model.safetensors"))
    dense = {}
    for name, value in state.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = state.get(name.removesuffix("weight") + "weight_scale_inv")
        dense[name] = value.float() if scale is None else value.float() * expand(scale, *value.shape)
    return dense


def dequantized_model(folder: Path, fp32_folder: Path) -> torch.nn.Module:
    """A plain float32 transformers model of the fp32 original's config holding `folder`'s weights,
    dequantized by `dense_weights`."""
    model = AutoModelForCausalLM.from_pretrained(fp32_folder, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dense_weights(folder), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model.eval()
