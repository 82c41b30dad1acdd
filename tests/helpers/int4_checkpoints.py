"""Tiny 4-bit checkpoints in AWQ's and compressed-tensors' real on-disk layouts, written with no engine
code, and the dense model the test dequantizes itself from the packed tensors.

    write_awq(fp32_folder, out)                            # AutoAWQ GEMM: qweight, qzeros, scales
    write_compressed(fp32_folder, out, symmetric=True)     # llm-compressor W4A16 pack-quantized
    model = dequantized_model(out)                         # plain transformers model, weights from the files

Both quantize every decoder-layer projection round-to-nearest in groups of GROUP_SIZE input features
(min-max, asymmetric: scale = (max - min) / 15, zero = round(-min / scale); symmetric: scale =
max |w| / 7.5, zero 8) and save the other tensors as the releases do (half precision).
- AWQ (AutoAWQ's WQLinear_GEMM.from_linear and pack): w is [K, N] after a transpose, eight 4-bit
  values per int32 along N, nibble i holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; qzeros packed
  the same way; scales [K / group, N] fp16; config {"quant_method": "awq", "version": "gemm", ...}.
- compressed-tensors (pack_to_int32): signed values q - 8 shifted back to unsigned by + 8 and packed
  eight per int32 along the input dimension, nibble i holding column 8c + i: weight_packed [N, K / 8];
  weight_scale [N, K / group] bf16; asymmetric zero points packed along the output dimension
  ([N / 8, K / group] int32); weight_shape [2] int64; config with config_groups and "ignore".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

GROUP_SIZE = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize(weight: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] in 0..15, zeros [N, K / GROUP_SIZE] in 0..15, scales [N, K / GROUP_SIZE])."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if symmetric:
        scales = groups.abs().amax(-1) / 7.5
        zeros = torch.full_like(scales, 8)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        scales = (high - low) / 15
        zeros = torch.round(-low / scales).clamp(0, 15)
    q = torch.round(groups / scales[..., None]) + zeros[..., None]
    return q.clamp(0, 15).reshape(n, k).to(torch.int32), zeros.to(torch.int32), scales


def pack_along_last(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] ints in 0..15 -> [R, C / 8] int32, nibble i of word c holding column 8c + order[i]."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        words |= values[:, column::8].to(torch.int64) << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def unpack_along_last(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    rows, cols = words.shape
    values = torch.empty(rows, cols * 8, dtype=torch.int32)
    for i, column in enumerate(order):
        values[:, column::8] = (words >> (4 * i)) & 15
    return values


def layer_linears(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name.removesuffix(".weight") for name in state
                  if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS)


def write(fp32_folder: Path, out: Path, tensors: dict[str, torch.Tensor], quant: dict, dtype: str) -> Path:
    out.mkdir(parents=True)
    for path in fp32_folder.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((fp32_folder / "config.json").read_text())
    config.update(quantization_config=quant, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_awq(fp32_folder: Path, out: Path) -> Path:
    state = load_file(str(fp32_folder / "model.safetensors"))
    tensors = {}
    for prefix in layer_linears(state):
        q, zeros, scales = quantize(state.pop(f"{prefix}.weight"), symmetric=False)
        tensors[f"{prefix}.qweight"] = pack_along_last(q.T.contiguous(), AWQ_PACK_ORDER)  # [K, N / 8]
        tensors[f"{prefix}.qzeros"] = pack_along_last(zeros.T.contiguous(), AWQ_PACK_ORDER)  # [K / group, N / 8]
        tensors[f"{prefix}.scales"] = scales.T.contiguous().half()  # [K / group, N]
    tensors.update({name: value.half() for name, value in state.items()})
    quant = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "version": "gemm", "zero_point": True,
             "modules_to_not_convert": None}
    return write(fp32_folder, out, tensors, quant, "float16")


def write_compressed(fp32_folder: Path, out: Path, symmetric: bool) -> Path:
    state = load_file(str(fp32_folder / "model.safetensors"))
    tensors = {}
    for prefix in layer_linears(state):
        weight = state.pop(f"{prefix}.weight")
        q, zeros, scales = quantize(weight, symmetric)
        signed = q - 8  # the int8 values compressed-tensors quantizes to, in [-8, 7]
        tensors[f"{prefix}.weight_packed"] = pack_along_last(signed + 8)  # [N, K / 8]
        tensors[f"{prefix}.weight_scale"] = scales.bfloat16()  # [N, K / group]
        tensors[f"{prefix}.weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
        if not symmetric:  # zero points: signed (zeros - 8), packed + 8 along the output dimension
            signed_zeros = zeros - 8
            tensors[f"{prefix}.weight_zero_point"] = pack_along_last((signed_zeros + 8).T.contiguous()).T.contiguous()
    tensors.update({name: value.bfloat16() for name, value in state.items()})
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP_SIZE,
               "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                           "output_activations": None, "format": "pack-quantized"}},
             "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.12.2"}
    return write(fp32_folder, out, tensors, quant, "bfloat16")


def unpacked(folder: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict]:
    """The projections of a 4-bit checkpoint written above as (q [N, K], zeros [N, groups], scales
    [N, groups]) in the unsigned form, unpacked here from the file tensors; and the other tensors."""
    state = load_file(str(folder / "model.safetensors"))
    maps = {}
    for name in list(state):
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            q = unpack_along_last(state.pop(name), AWQ_PACK_ORDER).T  # [N, K]
            zeros = unpack_along_last(state.pop(f"{prefix}.qzeros"), AWQ_PACK_ORDER).T  # [N, groups]
            scales = state.pop(f"{prefix}.scales").float().T
        elif name.endswith(".weight_packed"):
            prefix = name.removesuffix(".weight_packed")
            q = unpack_along_last(state.pop(name))  # [N, K], stored + 8
            scales = state.pop(f"{prefix}.weight_scale").float()
            state.pop(f"{prefix}.weight_shape")
            packed_zeros = state.pop(f"{prefix}.weight_zero_point", None)
            zeros = torch.full(scales.shape, 8) if packed_zeros is None else \
                unpack_along_last(packed_zeros.T.contiguous()).T
        else:
            continue
        maps[prefix] = (q, zeros, scales)
    return maps, state


def dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a 4-bit checkpoint written above, its projections dequantized here in float32:
    w = scale * (q - zero) from the packed file tensors."""
    maps, rest = unpacked(folder)
    dense = {name: value.float() for name, value in rest.items()}
    for prefix, (q, zeros, scales) in maps.items():
        group = q.shape[1] // scales.shape[1]
        dense[f"{prefix}.weight"] = (q - zeros.repeat_interleave(group, 1)).float() * scales.repeat_interleave(group, 1)
    return dense


def dequantized_model(folder: Path, fp32_folder: Path) -> torch.nn.Module:
    """A plain float32 transformers model of the fp32 original's config holding `folder`'s weights,
    dequantized by `dense_weights`."""
    return plain_model(fp32_folder, dense_weights(folder))


def plain_model(fp32_folder: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The fp32 original's transformers model in float32 holding `weights` (every tensor but rotary buffers)."""
    model = AutoModelForCausalLM.from_pretrained(fp32_folder, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model.eval()
