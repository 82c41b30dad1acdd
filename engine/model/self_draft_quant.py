"""Round-to-nearest 4-bit copies of linear maps, made at load on the compute device (the self-draft).

    int4 = quantize_linear(linear.weight, linear.bias, compute_device)  # gptq_int4.Int4Linear, or None

Each output row's input features are cut into groups of GROUP_SIZES[0] (128; 64 or 32 where the
input width needs it); a group's 4-bit values q in 0..15 give w = (q - 8) x scale + zero, with
scale = (max - min) / 15 and zero = min + 8 x scale, both rounded to bf16 first and q rounded
against the rounded pair (min-max asymmetric RTN, as SubSpec's HQQ and GPTQ's act-order-free
baseline, without calibration data). That is tinygemm's own form, so the result is an Int4Linear with
no repack: on CPU torch's CPU int4 layout, on CUDA nibble pairs (tinygemm for calls of up to 128
rows, a bf16 matrix once for larger ones; only the latter where tinygemm cannot take the shape).
The copy is made ROW_CHUNK output rows at a time, so the float32 scratch stays a chunk's, not a
matrix's, on the device that makes it.
"""

from __future__ import annotations

import torch

from engine.model import gptq_int4

GROUP_SIZES = (128, 64, 32)  # preferred first; all are sizes the int4 kernels take
ROW_CHUNK = 4096  # output rows quantized at a time
MIN_SCALE = 1e-10  # a constant group's scale (its values all round to zero + (0 - 8) x scale = min)


def group_for(in_features: int) -> int | None:
    """The largest of GROUP_SIZES dividing `in_features`, or None."""
    return next((group for group in GROUP_SIZES if in_features % group == 0), None)


def refusal(in_features: int, out_features: int, compute_device: torch.device) -> str | None:
    """Why a [out, in] matrix gets no 4-bit copy on `compute_device`'s kernel (None: it does)."""
    if group_for(in_features) is None:
        return f"{in_features} input features (groups of {', '.join(map(str, GROUP_SIZES))})"
    if compute_device.type == "cpu" and out_features % gptq_int4.CPU_N_MULTIPLE:
        return f"{out_features} output features (the CPU kernel needs a multiple of {gptq_int4.CPU_N_MULTIPLE})"
    if compute_device.type not in ("cpu", "cuda"):
        return f"device {compute_device.type}"
    return None


def tinygemm_takes(in_features: int, out_features: int, compute_device: torch.device) -> bool:
    """Whether CUDA's tinygemm takes the matrix (else every call dequantizes it to bf16 once)."""
    if in_features % (16 * gptq_int4.CUDA_INNER_K_TILES) or out_features % 8:
        return False
    return torch.cuda.get_device_capability(compute_device) >= (8, 0)  # CUDA-only


def quantize_rows(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, K] float -> q [n, K] int32 in 0..15, scale and zero [n, K / group] bf16, where
    (q - 8) x scale + zero is the RTN approximation of `weight` (module doc)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(MIN_SCALE).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    q = ((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).round_().clamp_(0, 15)
    return q.reshape(n, k).to(torch.int32), scale, zero


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weight that (q, scale, zero) of quantize_rows stand for: [n, K]."""
    n, k = q.shape
    group = k // scale.shape[1]
    centered = q.float().reshape(n, -1, group) - 8
    return (centered * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, compute_device: torch.device) -> gptq_int4.Int4Linear:
    """The 4-bit copy of y = x @ weight.T + bias (weight [out, in], any device; refusal() is None): an
    Int4Linear whose buffers live on `compute_device`, made there. The bias is copied as it is."""
    n, k = weight.shape
    group = group_for(k)
    assert group is not None and refusal(k, n, compute_device) is None, refusal(k, n, compute_device)
    packed_parts, scales, zeros = [], [], []
    for begin in range(0, n, ROW_CHUNK):
        rows = weight[begin : begin + ROW_CHUNK].to(compute_device)
        q, scale, zero = quantize_rows(rows, group)
        if compute_device.type == "cuda":  # CUDA-only: [rows, K / 2] nibble pairs, row by row
            packed_parts.append(gptq_int4.nibble_pairs(q))
        else:
            packed_parts.append(q)
        scales.append(scale)
        zeros.append(zero)
        del q
    packed = torch.cat(packed_parts)
    if compute_device.type == "cpu":  # the CPU layout packs blocks of rows: converted whole
        packed = gptq_int4.pack_for(packed, compute_device)
    scales_and_zeros = torch.stack([torch.cat(scales).T, torch.cat(zeros).T], dim=-1).contiguous()  # [K / group, N, 2]
    kept_bias = None if bias is None else bias.detach().to(compute_device, copy=True)
    linear = gptq_int4.Int4Linear(k, n, group, compute_device.type, packed, scales_and_zeros, None, kept_bias)
    if compute_device.type == "cuda" and not tinygemm_takes(k, n, compute_device):
        linear.tinygemm_max_rows = 0
    return linear


def int4_bytes(in_features: int, out_features: int) -> int:
    """Device bytes of quantize_linear's copy of an [out, in] matrix (no bias): 4-bit values, a bf16
    scale and zero per group and output feature."""
    group = group_for(in_features) or GROUP_SIZES[-1]
    return in_features * out_features // 2 + -(-in_features // group) * out_features * 4
