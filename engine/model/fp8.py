"""Block-wise FP8 checkpoints (`quant_method: fp8`, as Qwen3-*-FP8 ship): detection, the per-call
dequantizing linear map, and their bytes.

    fmt = format_of(config)                     # Fp8Format, or None for other checkpoints
    module = Fp8Linear(fmt, k, n, weight, scale_inv, bias)
    y = module(x)                               # x @ W.T + bias, W dequantized per call

The format (transformers' integrations/finegrained_fp8.py, 5.24): every quantized linear map stores
`weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] float32 for
`weight_block_size` [bn, bk] (128 x 128 in every release seen): w[n, k] = weight[n, k] x
weight_scale_inv[n // bn, k // bk] (despite its name the stored scale multiplies; the quantizer divides
by it). Blocks at the end of either dimension may be partial. The other tensors are bf16;
`modules_to_not_convert` names unquantized maps (lm_head). A map is quantized iff its
`weight_scale_inv` is in the files.

Fp8Linear keeps the file's two tensors under their file names (1 byte a weight plus 4 bytes a block:
about half of bf16), so a streamed layer moves them as stored and the disk source reads them with no
fixup. Each call dequantizes in float32 row chunks, rounded once to the activations' dtype (what
transformers' `FineGrainedFP8Config(dequantize=True)` computes at load), and runs one F.linear: dtype
conversions, a multiply and a matmul, on any device. Refused in one line: other FP8 variants
(per-tensor scales, static activation scales, ue8m0 scales, e5m2, FP8 embeddings) and MoE models,
whose experts transformers fuses into tensors that are not linear maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.types import CheckpointError

METHOD = "fp8"
SCALE = "weight_scale_inv"  # the leaf name that marks a quantized linear map in the checkpoint
SCALE_BYTES = 4  # float32 block scales, kept as stored
DEQUANT_CHUNK_ROWS = 4096  # output rows dequantized in float32 at a time (bounds that scratch)


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int]  # (output rows, input columns) per scale
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert, as the config lists them
    names: tuple[str, ...] = ("weight", SCALE)  # one map's file tensors (leaf names)
    marker: str = SCALE

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return -(-out_features // self.block[0]), -(-in_features // self.block[1])

    def chunk_rows(self, out_features: int) -> int:
        """Rows dequantized at a time: a multiple of the block's rows, at most all of them."""
        return min(out_features, max(self.block[0], DEQUANT_CHUNK_ROWS // self.block[0] * self.block[0]))


def num_experts(config: dict) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 1)


def format_of(config: dict) -> Fp8Format | None:
    """The block-wise FP8 format of a config.json (module doc); None for any other checkpoint;
    CheckpointError for an FP8 variant that is not supported."""
    quant = config.get("quantization_config") or {}
    if str(quant.get("quant_method") or "").lower() != METHOD:
        return None
    block = quant.get("weight_block_size")
    variant = {key: quant.get(key) for key in ("fmt", "activation_scheme", "scale_fmt", "expert_dtype")}
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"FP8 with weight_block_size {block!r}: only block-wise FP8 (weight_block_size "
                              "[128, 128], a float32 scale per block, as Qwen3-*-FP8) is supported")
    if (variant["fmt"] or "e4m3") != "e4m3" or (variant["activation_scheme"] or "dynamic") != "dynamic" or \
            (variant["scale_fmt"] or "float") != "float" or (variant["expert_dtype"] or "fp8") != "fp8":
        raise CheckpointError(f"FP8 {variant}: only e4m3 weights with float32 block scales and dynamic activations "
                              "are supported")
    if quant.get("modules_to_convert"):
        raise CheckpointError(f"FP8 modules_to_convert {quant['modules_to_convert']!r} (FP8 embeddings) are not supported")
    if num_experts(config) > 1:
        raise CheckpointError(f"FP8 MoE checkpoints ({num_experts(config)} experts) are not supported: transformers "
                              "fuses their experts into tensors, not linear maps, which the FP8 loader cannot replace")
    return Fp8Format((int(block[0]), int(block[1])), tuple(quant.get("modules_to_not_convert") or ()))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] at `dtype`: weight x its block's scale in float32, rounded once, `fmt.chunk_rows` rows at a time
    (a float32 chunk is the only scratch besides the result; none at float32)."""
    n, k = weight.shape
    bn, bk = fmt.block
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=weight.device)
    columns = scale_inv.float().repeat_interleave(bk, dim=1)[:, :k]  # [ceil(N / bn), K]
    step = fmt.chunk_rows(n)
    for begin in range(0, n, step):
        end = min(n, begin + step)
        chunk = out[begin:end] if out.dtype == torch.float32 else torch.empty(end - begin, k, device=weight.device)
        chunk.copy_(weight[begin:end])  # float8 -> float32: exact
        full = (end - begin) // bn * bn
        scales = columns[begin // bn : -(-end // bn)]
        if full:
            chunk[:full].view(full // bn, bn, k).mul_(scales[: full // bn, None, :])
        if full < end - begin:  # the last, partial block of rows
            chunk[full:].mul_(scales[-1])
        if chunk.data_ptr() != out[begin:end].data_ptr():
            out[begin:end].copy_(chunk)
    return out


class Fp8Linear(nn.Module):
    """y = x @ W.T + bias, W dequantized per call from the file's FP8 weight and block scales (module doc)."""

    def __init__(self, fmt: Fp8Format, in_features: int, out_features: int, weight: torch.Tensor,
                 scale_inv: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if tuple(weight.shape) != (out_features, in_features) or tuple(scale_inv.shape) != fmt.scale_shape(
                out_features, in_features):
            raise CheckpointError(f"FP8 weight {tuple(weight.shape)} with scales {tuple(scale_inv.shape)}: not a "
                                  f"[{out_features}, {in_features}] map in blocks of {fmt.block}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("weight", weight)
        self.register_buffer(SCALE, scale_inv)
        self.register_buffer("bias", bias)

    def weight_now(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.fmt, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_now(x.dtype), bias)


def linear_bytes(k: int, n: int, fmt: Fp8Format) -> int:
    """Bytes of one FP8 map's weight and scales as loaded (the file's form; its bias is counted as a plain one)."""
    rows, cols = fmt.scale_shape(n, k)
    return k * n + rows * cols * SCALE_BYTES


def scratch_bytes(k: int, n: int, fmt: Fp8Format, dtype_bytes: int) -> int:
    """Device bytes one call of a k x n map makes: the weight at the activations' dtype, and below float32 a
    float32 chunk of rows."""
    return n * k * dtype_bytes + (0 if dtype_bytes == 4 else fmt.chunk_rows(n) * k * 4)


def not_converted(name: str, fmt: Fp8Format) -> bool:
    """Whether a layer's map (its name inside the layer, e.g. self_attn.q_proj) is listed unquantized."""
    return any(name == skip or name.endswith("." + skip) or skip.endswith("." + name) for skip in fmt.not_converted)


def loaded_nbytes(name: str, nbytes: int, index: dict, dtype: torch.dtype, in_layer: bool) -> int | None:
    """Bytes that file tensor `name` (`nbytes` in the file) holds once loaded at `dtype`, for an FP8 map's two
    tensors: as stored in a decoder layer; outside one (a quantized head) the weight dequantized to `dtype`
    and its scales nothing. None for any other tensor."""
    if name.endswith("." + SCALE):
        return nbytes if in_layer else 0
    if name.endswith(".weight") and name.removesuffix("weight") + SCALE in index:
        return nbytes if in_layer else nbytes * dtype.itemsize
    return None
