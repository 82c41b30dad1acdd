"""Byte locations of a checkpoint's tensors in its safetensors files, and read plans for the disk tier.

A safetensors file is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end)}} and the raw little-endian data after it.
Reading ranges ourselves (pread) lets the disk tier fill preallocated buffers directly and drop
exactly the pages it read from the page cache.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints' weights (engine.model.fp8)
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# transformers fuses per-expert MoE weights on load: fused name -> the per-expert parts of each family's
# checkpoints (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down projections), in the order they are
# concatenated along dim 1 of the fused [num_experts, ...] tensor. GPT-OSS checkpoints hold the fused
# tensors themselves.
FUSED_EXPERTS = {
    "experts.gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
    "experts.down_proj": (("w2",), ("down_proj",)),
}
RENAMES = ((".mlp.", ".block_sparse_moe."),)  # (loaded name, checkpoint name): Mixtral


@dataclass(frozen=True)
class TensorLocation:
    path: str
    dtype: torch.dtype
    file_offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class ReadPiece:
    """Read src_nbytes at file_offset, convert src_dtype -> dst_dtype, land at dst_offset of the layer buffer."""

    path: str
    file_offset: int
    src_nbytes: int
    src_dtype: torch.dtype
    dst_offset: int
    dst_nbytes: int
    dst_dtype: torch.dtype


def read_header(path: Path) -> dict[str, TensorLocation]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    index: dict[str, TensorLocation] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            continue  # not a type the loaded model can hold; a plan that needs it fails by name
        begin, end = meta["data_offsets"]
        index[name] = TensorLocation(str(path), DTYPES[meta["dtype"]], base + begin, end - begin)
    return index


def read_index(folder: str) -> dict[str, TensorLocation]:
    """Every tensor of every *.safetensors file in `folder` (sharded or not)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (the disk offload source reads them)")
    index: dict[str, TensorLocation] = {}
    for path in files:
        for name, loc in read_header(path).items():
            index.setdefault(name, loc)
    return index


def _lookup(index: dict[str, TensorLocation], name: str) -> TensorLocation | None:
    if name in index:
        return index[name]
    for loaded, saved in RENAMES:
        if loaded in name and name.replace(loaded, saved) in index:
            return index[name.replace(loaded, saved)]
    return None


def _piece(loc: TensorLocation, numel: int, dst_dtype: torch.dtype, dst_offset: int, name: str) -> ReadPiece:
    src_numel = loc.nbytes // loc.dtype.itemsize
    if src_numel != numel:
        raise ValueError(f"checkpoint tensor for {name} has {src_numel} elements, the loaded model {numel}")
    dst_nbytes = numel * dst_dtype.itemsize
    return ReadPiece(loc.path, loc.file_offset, loc.nbytes, loc.dtype, dst_offset, dst_nbytes, dst_dtype)


def plan_pieces(
    index: dict[str, TensorLocation], name: str, shape: tuple[int, ...], dtype: torch.dtype, dst_offset: int
) -> list[ReadPiece]:
    """Pieces filling the loaded tensor `name` ([shape] of dtype, at dst_offset) from the checkpoint."""
    numel = math.prod(shape)
    loc = _lookup(index, name)
    if loc is not None:
        return [_piece(loc, numel, dtype, dst_offset, name)]
    if f"{name}_blocks" in index:  # GPT-OSS's MXFP4 experts: not a byte copy (engine.model.mxfp4 dequantizes them)
        raise ValueError(f"{name} is stored MXFP4-packed ({name}_blocks, {name}_scales), which loads only dequantized")
    prefix, _, fused = name.rpartition(".experts.")
    options = FUSED_EXPERTS.get(f"experts.{fused}")
    if options is None or len(shape) != 3:
        raise ValueError(f"no checkpoint tensor for {name}")
    for parts in options:
        if _lookup(index, f"{prefix}.experts.0.{parts[0]}.weight") is not None:
            return _expert_pieces(index, name, prefix, parts, shape, dtype, dst_offset)
    looked = " or ".join(f"{prefix}.experts.0.{parts[0]}.weight" for parts in options)
    raise ValueError(f"no checkpoint tensor for {name} (looked for {looked})")


def _expert_pieces(
    index: dict[str, TensorLocation], name: str, prefix: str, parts: tuple[str, ...],
    shape: tuple[int, ...], dtype: torch.dtype, dst_offset: int,
) -> list[ReadPiece]:
    """Pieces filling the fused [num_experts, ...] tensor `name` from each expert's `parts`."""
    num_experts = shape[0]
    part_numel = math.prod(shape) // num_experts // len(parts)  # each part: [shape[1] / len(parts), shape[2]]
    pieces = []
    for expert in range(num_experts):
        for j, part in enumerate(parts):
            part_name = f"{prefix}.experts.{expert}.{part}.weight"
            part_loc = _lookup(index, part_name)
            if part_loc is None:
                raise ValueError(f"no checkpoint tensor for {name} (looked for {part_name})")
            offset = dst_offset + (expert * len(parts) + j) * part_numel * dtype.itemsize
            pieces.append(_piece(part_loc, part_numel, dtype, offset, part_name))
    return pieces
