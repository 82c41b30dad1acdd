"""Tiny FP8 checkpoints in the hub's layouts, block-wise (Qwen3-*-FP8) and per tensor (Mistral's FP8 releases),
written with no engine code, and the dense model the test dequantizes itself from the files.

    write_fp8(fp32_folder, out, quantize_head=False)   # weight float8_e4m3fn + weight_scale_inv per block
    write_fp8(fp32_folder, out, per_tensor=(scale_shape, activation_name))   # one scale per tensor, static
    model = dequantized_model(out, fp32_folder)        # plain transformers model, weights from the files

Every decoder-layer projection is quantized per BLOCK x BLOCK block (blocks at the end of either
dimension partial): scale = amax(|w|) / 448 over the block (1 for an all-zero block), weight =
(w / scale).to(float8_e4m3fn), stored scale_inv = scale (float32, [ceil(N / BLOCK), ceil(K / BLOCK)]),
as transformers' Fp8Quantize stores it. The other tensors are saved in bf16, as the releases do;
config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128]}, with modules_to_not_convert ["lm_head"] unless the head is quantized too.

Per tensor (transformers' Fp8Linear with block_size None): scale = amax(|w|) / 448 over the whole
projection, stored as weight_scale_inv of shape `scale_shape` ([] as transformers holds it, or [1]),
plus a static activation scale under `activation_name` ("activation_scale", transformers' name, or
"input_scale") that a weights-only dequantization ignores (here an arbitrary positive number); config:
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": null}.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.int4_checkpoints import plain_model

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


def quantize_per_tensor(weight: torch.Tensor, shape: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, K], one float32 scale of `shape`)."""
    w = weight.float()
    amax = w.abs().max()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).to(torch.float8_e4m3fn), scale.reshape(shape).clone()


def write_fp8(fp32_folder: Path, out: Path, quantize_head: bool = False,
              per_tensor: tuple[tuple[int, ...], str] | None = None) -> Path:
    state = load_file(str(fp32_folder / "model.safetensors"))
    tensors = {}
    for name in list(state):
        leaf = name.split(".")[-2] if name.endswith(".weight") else ""
        if leaf in PROJECTIONS or (quantize_head and name == "lm_head.weight"):
            prefix = name.removesuffix("weight")
            if per_tensor is None:
                tensors[name], tensors[prefix + "weight_scale_inv"] = quantize(state.pop(name))
            else:
                tensors[name], tensors[prefix + "weight_scale_inv"] = quantize_per_tensor(state.pop(name), per_tensor[0])
                tensors[prefix + per_tensor[1]] = torch.tensor([0.0173], dtype=torch.float32).reshape(per_tensor[0])
    tensors.update({name: value.bfloat16() for name, value in state.items()})
    out.mkdir(parents=True)
    for path in fp32_folder.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((fp32_folder / "config.json").read_text())
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    if per_tensor is not None:
        quant.update(activation_scheme="static", weight_block_size=None)
    if not quantize_head:
        quant["modules_to_not_convert"] = ["lm_head"]
    config.update(quantization_config=quant, dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint written above in float32, each FP8 weight dequantized here:
    w = fp8 x its block's (or its tensor's) scale; activation scales left out."""
    state = load_file(str(folder / "model.safetensors"))
    dense = {}
    for name, value in state.items():
        if name.endswith((".weight_scale_inv", ".activation_scale", ".input_scale")):
            continue
        scale = state.get(name.removesuffix("weight") + "weight_scale_inv")
        if scale is None:
            dense[name] = value.float()
        elif scale.numel() == 1:
            dense[name] = value.float() * scale.reshape(())
        else:
            dense[name] = value.float() * expand(scale, *value.shape)
    return dense


def dequantized_model(folder: Path, fp32_folder: Path) -> torch.nn.Module:
    """A plain float32 transformers model of the fp32 original's config holding `folder`'s weights,
    dequantized by `dense_weights`."""
    return plain_model(fp32_folder, dense_weights(folder))


def as_mistral3_release(folder: Path, out: Path) -> Path:
    """The FP8 checkpoint in `folder` as Mistral's multimodal releases ship it: config under text_config of a
    Mistral3ForConditionalGeneration (quantization_config at the top, the vision tower, projector and head
    in modules_to_not_convert), tensors under language_model.model.* / language_model.lm_head.*, and an
    FP8-looking vision tower map beside them that must stay unread."""
    shutil.copytree(folder, out)
    text = json.loads((folder / "config.json").read_text())
    quant = text.pop("quantization_config")
    quant["modules_to_not_convert"] = ["model.vision_tower", "model.multi_modal_projector", "lm_head"]
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
              "vision_config": {"model_type": "pixtral"}, "quantization_config": quant, "dtype": text["dtype"]}
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(out / "model.safetensors"))
    renamed = {("language_model." + name if name.startswith(("model.", "lm_head.")) else name): value
               for name, value in state.items()}
    source = next(name for name in state if name.endswith(".weight_scale_inv")).removesuffix(".weight_scale_inv")
    vision = "vision_tower.transformer.layers.0.attention.q_proj."
    for leaf in ("weight", "weight_scale_inv", "activation_scale", "input_scale"):
        if f"{source}.{leaf}" in state:
            renamed[vision + leaf] = state[f"{source}.{leaf}"].clone()
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
