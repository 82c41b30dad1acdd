"""GPT-OSS as OpenAI publishes it: MXFP4 experts, dequantized to the model dtype at load.

openai/gpt-oss-20b and -120b (`quantization_config: {"quant_method": "mxfp4"}`) store each decoder
layer's fused experts as `mlp.experts.{gate_up,down}_proj_blocks` [E, out, in / 32, 16] uint8 (FP4 e2m1
codes, two per byte, element 2j in the low nibble) and `..._scales` [E, out, in / 32] uint8 (one e8m0
exponent, 2^(s - 127), per block of 32); everything else is bf16. The loaded model is transformers'
plain GptOssForCausalLM, whose experts are [E, in, out] tensors of the model dtype:
- resident (engine.model.checkpoint.load_model): transformers' own loader with
  `Mxfp4Config(dequantize=True)`, which works on CPU with neither triton nor kernels;
- streamed (engine.offload.loader): the model is built on `meta` and every tensor read by name; an
  expert tensor that the files hold packed is read one expert at a time and dequantized by transformers'
  `convert_moe_packed_tensors` on the load's device into where it lives (a device tensor, the RAM store's
  layer buffer; docs/design.md, "Quantized targets", for its cost);
- the disk source reads layers on every pass as the files store them, which for the experts is
  packed: refused before any weights load (`disk_refusal`).
Dequantization is exact in float32, bfloat16 (an FP4 value times a power of two) and float16 within its
exponent range, so every path holds the same weights. Host RAM and streamed bytes are those of the
dequantized model (the plans count them so: `loaded_nbytes`); streaming the packed form and
dequantizing per pass on the GPU is not done.
"""

from __future__ import annotations

import os

import torch

from engine.offload.disk_store import read_span

METHOD = "mxfp4"
PACKED = ("_blocks", "_scales")  # suffixes of a packed tensor's two file tensors
BLOCK = 32  # values per scale
DISK_REFUSAL = ("its experts are dequantized at load, and the disk source streams layers as the files store "
                "them (packed); use --offload-source ram (or a bf16 copy of the checkpoint)")


def is_mxfp4(config: dict) -> bool:
    """Whether a config.json's quantization is MXFP4 (GPT-OSS's published checkpoints)."""
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method") or "").lower() == METHOD


def packed_names(index: dict, name: str) -> tuple[str, str] | None:
    """(blocks, scales) file names of the loaded tensor `name`, if the checkpoint holds it packed."""
    blocks, scales = (name + suffix for suffix in PACKED)
    return (blocks, scales) if blocks in index and scales in index else None


def loaded_nbytes(name: str, nbytes: int, index: dict, dtype: torch.dtype) -> int | None:
    """Bytes that file tensor `name` (`nbytes` in the file) holds once loaded at `dtype`: a packed tensor's
    blocks count as the dequantized tensor (two values a byte), its scales as nothing; None for a tensor
    that is not MXFP4-packed."""
    for suffix in PACKED:
        base = name.removesuffix(suffix)
        if base != name and packed_names(index, base) is not None:
            return nbytes * 2 * dtype.itemsize if suffix == "_blocks" else 0
    return None


def read_dequantized(fd_of, blocks, scales, dst: torch.Tensor, evict: bool, device: torch.device | None = None) -> None:
    """Fill `dst` [E, in, out] (any device, any floating dtype) from the packed file tensors at TensorLocations
    `blocks` and `scales`, one expert at a time (fd_of: path -> open descriptor), dequantizing on `device`
    (default: dst's; the load's CUDA device makes it fast where dst is host memory, the RAM store)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    num_experts, inp, out = dst.shape
    groups = inp // BLOCK
    block_bytes, scale_bytes = out * groups * BLOCK // 2, out * groups  # one expert's
    if inp % BLOCK or blocks.nbytes != num_experts * block_bytes or scales.nbytes != num_experts * scale_bytes:
        raise ValueError(f"MXFP4 tensors of {blocks.nbytes} and {scales.nbytes} bytes do not pack a "
                         f"[{num_experts}, {inp}, {out}] tensor in blocks of {BLOCK}")
    packed = torch.empty(block_bytes, dtype=torch.uint8)
    exponents = torch.empty(scale_bytes, dtype=torch.uint8)
    for expert in range(num_experts):
        read_span(fd_of(blocks.path), blocks.path, packed, blocks.file_offset + expert * block_bytes, block_bytes)
        read_span(fd_of(scales.path), scales.path, exponents, scales.file_offset + expert * scale_bytes, scale_bytes)
        codes, powers = (t.to(device or dst.device) for t in (packed, exponents))
        values = convert_moe_packed_tensors(codes.view(1, out, groups, BLOCK // 2), powers.view(1, out, groups),
                                            dtype=dst.dtype)  # [1, in, out]
        dst[expert].copy_(values[0])
    if evict:
        for loc in (blocks, scales):
            os.posix_fadvise(fd_of(loc.path), loc.file_offset, loc.nbytes, os.POSIX_FADV_DONTNEED)


def disk_refusal(config: dict, offload) -> str | None:
    """Why `offload` (OffloadConfig) cannot stream this target (its config.json), or None."""
    if is_mxfp4(config) and offload.enabled and offload.source == "disk":
        return f"--offload-source disk cannot stream an MXFP4 checkpoint: {DISK_REFUSAL}"
    return None
