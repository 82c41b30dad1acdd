"""FP8 checkpoints (`quant_method: fp8`): block-wise (Qwen3-*-FP8) and per-tensor (Mistral's FP8 releases:
Devstral Small 2, Ministral 3): detection, the per-call dequantizing linear map, and their bytes.

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

Per tensor (`weight_block_size: null`, Mistral's "FP8 W8A8 static" releases): transformers' Fp8Linear
with block_size None holds one float32 `weight_scale_inv` of shape [] (a [1] one loads alike) and
dequantizes w = weight x weight_scale_inv (`_dequantize_fp8_weight`: weight.mul_(scale); Fp8Dequantize
reads a scalar scale as a 1 x 1 grid). With `activation_scheme: "static"` each map also stores one
float32 `activation_scale` (transformers' name; `input_scale` is AutoFP8's and vLLM's) by which an FP8
GPU kernel quantizes the map's input. The dequantization here is weights only: those scales are read
by nothing and loaded as nothing, activations stay in the compute dtype, so the output is the model
with unquantized activations (what transformers' dequantize=True, a GPU without FP8 matmuls and vLLM's
weight-only FP8 path compute), not a bit-exact emulation of the FP8 W8A8 matmul.

Fp8Linear keeps the file's two tensors under their file names (1 byte a weight plus 4 bytes a block:
about half of bf16), so a streamed layer moves them as stored and the disk source reads them with no
fixup. Each call dequantizes in float32 row chunks, rounded once to the activations' dtype (what
transformers' `FineGrainedFP8Config(dequantize=True)` computes at load), and runs one F.linear: dtype
conversions, a multiply and a matmul, on any device. Refused in one line: other FP8 variants
(ue8m0 scales, e5m2, FP8 embeddings, per-output-channel scales) and MoE models, whose experts
transformers fuses into tensors that are not linear maps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.types import CheckpointError

METHOD = "fp8"
SCALE = "weight_scale_inv"  # the leaf name that marks a quantized linear map in the checkpoint
SCALE_BYTES = 4  # float32 block scales, kept as stored
# static activation scales (module doc): read by nothing, loaded as nothing
ACTIVATION_SCALES = ("activation_scale", "input_scale")
DEQUANT_CHUNK_ROWS = 4096  # output rows dequantized in float32 at a time (bounds that scratch)


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] | None  # (output rows, input columns) per scale; None: one scale per tensor
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert, as the config lists them
    names: tuple[str, ...] = ("weight", SCALE)  # one map's file tensors (leaf names)
    marker: str = SCALE

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        if self.block is None:
            return ()
        return -(-out_features // self.block[0]), -(-in_features // self.block[1])

    def scale_fits(self, shape: tuple[int, ...], out_features: int, in_features: int) -> bool:
        """Whether stored scales of `shape` are this format's for an [out, in] map (per tensor: [] or [1])."""
        if self.block is None:
            return tuple(shape) in ((), (1,))
        return tuple(shape) == self.scale_shape(out_features, in_features)

    def chunk_rows(self, out_features: int) -> int:
        """Rows dequantized at a time: a multiple of the block's rows, at most all of them."""
        rows = 1 if self.block is None else self.block[0]
        return min(out_features, max(rows, DEQUANT_CHUNK_ROWS // rows * rows))


def num_experts(config: dict) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 1)


def format_of(config: dict) -> Fp8Format | None:
    """The FP8 format of a config.json, block-wise or per tensor (module doc); None for any other checkpoint;
    CheckpointError for an FP8 variant that is not supported."""
    quant = config.get("quantization_config") or {}
    if str(quant.get("quant_method") or "").lower() != METHOD:
        return None
    block = quant.get("weight_block_size")
    variant = {key: quant.get(key) for key in ("fmt", "activation_scheme", "scale_fmt", "expert_dtype")}
    if block is not None and not (isinstance(block, list | tuple) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"FP8 with weight_block_size {block!r}: only block-wise FP8 (weight_block_size "
                              "[128, 128], a float32 scale per block, as Qwen3-*-FP8) or per-tensor FP8 "
                              "(weight_block_size null, as Mistral's FP8 releases) is supported")
    if (variant["fmt"] or "e4m3") != "e4m3" or (variant["activation_scheme"] or "dynamic") not in ("dynamic", "static") \
            or (variant["scale_fmt"] or "float") != "float" or (variant["expert_dtype"] or "fp8") != "fp8":
        raise CheckpointError(f"FP8 {variant}: only e4m3 weights with float32 scales (per block or per tensor) "
                              "are supported")
    if quant.get("modules_to_convert"):
        raise CheckpointError(f"FP8 modules_to_convert {quant['modules_to_convert']!r} (FP8 embeddings) are not supported")
    if num_experts(config) > 1:
        raise CheckpointError(f"FP8 MoE checkpoints ({num_experts(config)} experts) are not supported: transformers "
                              "fuses their experts into tensors, not linear maps, which the FP8 loader cannot replace")
    return Fp8Format(None if block is None else (int(block[0]), int(block[1])),
                     tuple(quant.get("modules_to_not_convert") or ()))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] at `dtype`: weight x its block's (or the tensor's) scale in float32, rounded once, `fmt.chunk_rows`
    rows at a time (a float32 chunk is the only scratch besides the result; none at float32)."""
    n, k = weight.shape
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=weight.device)
    step = fmt.chunk_rows(n)
    if fmt.block is None:
        scale = scale_inv.float().reshape(())
    else:
        bn, bk = fmt.block
        columns = scale_inv.float().repeat_interleave(bk, dim=1)[:, :k]  # [ceil(N / bn), K]
    for begin in range(0, n, step):
        end = min(n, begin + step)
        chunk = out[begin:end] if out.dtype == torch.float32 else torch.empty(end - begin, k, device=weight.device)
        chunk.copy_(weight[begin:end])  # float8 -> float32: exact
        if fmt.block is None:
            chunk.mul_(scale)
            if chunk.data_ptr() != out[begin:end].data_ptr():
                out[begin:end].copy_(chunk)
            continue
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
        if tuple(weight.shape) != (out_features, in_features) or not fmt.scale_fits(
                tuple(scale_inv.shape), out_features, in_features):
            form = "with one scale per tensor" if fmt.block is None else f"in blocks of {fmt.block}"
            raise CheckpointError(f"FP8 weight {tuple(weight.shape)} with scales {tuple(scale_inv.shape)}: not a "
                                  f"[{out_features}, {in_features}] map {form}")
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
    return k * n + math.prod(fmt.scale_shape(n, k)) * SCALE_BYTES


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
    and its scales nothing; a map's static activation scale nothing anywhere. None for any other tensor."""
    owner, _, leaf = name.rpartition(".")
    if leaf in ACTIVATION_SCALES and f"{owner}.{SCALE}" in index:
        return 0
    if name.endswith("." + SCALE):
        return nbytes if in_layer else 0
    if name.endswith(".weight") and name.removesuffix("weight") + SCALE in index:
        return nbytes if in_layer else nbytes * dtype.itemsize
    return None
