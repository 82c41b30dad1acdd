"""GPTQ 4-bit layers through torch's int4 matmul, which never materialises the dense weight.

    replace_with_int4(model, compute_device)  # after gptq.make_streamable: every qualifying module

gptqmodel's torch kernel (the fallback, `--gptq-kernel dequantize`) dequantises each whole matrix on
every call: about 7 bytes of scratch per weight (docs/design.md, "Quantized targets"), and on this
project's CPU a 4-bit pass 14x slower than fp32. torch's `aten._weight_int4pack_mm` (CUDA, sm80+)
and `aten._weight_int4pack_mm_for_cpu` multiply bf16 activations by 4-bit weights in their own
packed layout, grouped along the input dimension, dequantised as (q - 8) * scale + zero.

GPTQ stores w[k, n] = scale[g(k), n] * (q[k, n] - z[g(k), n]) with q packed eight per int32 along k
(qweight [K / 8, N]) and g(k) = g_idx[k]. The repack, once at load, per module (on the compute device):
- act-order (g_idx not k // group_size): sort the input rows by group (`perm`); the activations are
  gathered the same way on every call, x[:, perm] @ W[perm] = x @ W;
- q transposed to [N, K]: on CPU packed by torch's converter for the CPU kernel; on CUDA kept as
  nibble pairs [N, K / 2] uint8 (even k in the high nibble, torchao's byte order);
- scales_and_zeros [K / group_size, N, 2] bf16: (scale, scale * (8 - z)).
The results are registered buffers (packed, scales_and_zeros, perm, bias), so the module streams
like any layer: 4-bit weights, 0.5 byte each, plus 4 bytes of scale and zero per group and column.
The disk source reads the checkpoint's own packing, which this kernel cannot use, so a target
streamed from disk keeps the dequantize kernel.

On CUDA the kernel is chosen per call by its rows (measured on an H100 with 70B-shaped layers,
docs/bench/gpu.md, 2026-11-27): tinygemm's cost grows with the rows (one layer's seven matrices, the
layout conversion included: 0.9 ms at 1 row, 4.4 at 64, 15.6 at 257, 59 at 1025), so a call of up to
TINYGEMM_MAX_ROWS rows converts the nibbles to tinygemm's tiled layout on the device (about 0.5 ms a
layer) and runs tinygemm; a larger call dequantizes the matrix to bf16 once ((q - 8) x scale + zero,
as tinygemm computes it) and runs one dense matmul, whose cost hardly grows with the rows (8.8 ms a
layer at 1 to 257 rows, 10.3 at 1025, 12.9 at 2049, most of it the dequantization).

Activations are cast to bf16 and the products come back in bf16 (the kernels' only fast path on CPU:
0.44 ms against 31 ms with fp32 activations for a 1024 x 8192 matrix at one token here), then cast to
the model's dtype. That is the quantized model's function: greedy output with speculation equals
the same model's alone, as with any kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch
from torch import nn

GROUP_SIZES = (32, 64, 128, 256)  # what the kernels accept
CPU_N_MULTIPLE = 16  # the CPU converter's rows per block
CUDA_INNER_K_TILES = 8  # tinygemm: K must be a multiple of 16 x this
CPU_INNER_K_TILES = 2  # ignored by the CPU layout, required by the signature
TINYGEMM_MAX_ROWS = 128  # CUDA, eager dequantization: calls of up to this many rows run tinygemm, larger dequantize
# the same with the compiled dequantization: two H200 runs, one 70B layer's projections, tinygemm against the
# compiled kernel: 1.6 / 1.6 ms at 16 rows, 4.4 / 1.7 ms at 64 (docs/bench/gpu.md, 2026-11-27)
TINYGEMM_MAX_ROWS_COMPILED = 16
DEQUANT_BYTES_PER_WEIGHT = 5  # CUDA dequantize path's scratch: uint8 values, bf16 (q - 8), bf16 weight


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, C] int32 words holding 32 / bits values each along R -> [R * 32 / bits, C] int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, 32 / bits, C]
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, C] int32 words holding 32 / bits values each along C -> [R, C * 32 / bits] int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def applies(module: nn.Module, compute_device: torch.device) -> str | None:
    """Why `module` (a gptqmodel quantized linear) cannot run on the int4 kernel, or None if it can."""
    bits, group = module.bits, module.group_size
    k, n = module.in_features, module.out_features
    if bits != 4:
        return f"{bits}-bit weights (the kernel is 4-bit)"
    if group not in GROUP_SIZES:
        return f"group size {group} (the kernel takes {', '.join(map(str, GROUP_SIZES))})"
    if k % group or module.qweight.shape[0] * 8 != k:
        return f"{k} input features in groups of {group}"
    if compute_device.type == "cpu" and n % CPU_N_MULTIPLE:
        return f"{n} output features (the CPU kernel needs a multiple of {CPU_N_MULTIPLE})"
    if compute_device.type == "cuda":  # CUDA-only
        if torch.cuda.get_device_capability(compute_device) < (8, 0):
            return "a GPU below compute capability 8.0"
        if k % (16 * CUDA_INNER_K_TILES) or n % 8:
            return f"a {k} x {n} matrix (the CUDA kernel needs K % 128 == 0 and N % 8 == 0)"
    elif compute_device.type != "cpu":
        return f"device {compute_device.type}"
    g_idx = module.g_idx.long().cpu()
    counts = torch.bincount(g_idx, minlength=k // group)
    if counts.numel() != k // group or not bool((counts == group).all()):
        return "groups of unequal size in g_idx"
    return None


def nibble_pairs(values: torch.Tensor) -> torch.Tensor:
    """[N, K] int32 4-bit values -> [N, K / 2] uint8, even k in the high nibble (torchao's byte order)."""
    values = values.contiguous()  # a transposed view's elementwise results would keep its strides
    return (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8).contiguous()


def pack_for(values: torch.Tensor, compute_device: torch.device) -> torch.Tensor:
    """[N, K] int32 4-bit values (on `compute_device`) -> what Int4Linear keeps for that device's kernels,
    on the host: the CPU kernel's packed layout (its converter needs contiguous input), or CUDA's
    nibble pairs (converted to tinygemm's layout per call, on the device)."""
    if compute_device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.contiguous(), CPU_INNER_K_TILES)
    return nibble_pairs(values).cpu()  # CUDA-only


def dequantized(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K / 2] uint8 nibble pairs and [K / group, N, 2] (scale, zero) -> the [N, K] bf16 weight,
    (q - 8) x scale + zero rounded once, as tinygemm dequantizes."""
    n = nibbles.shape[0]
    q = torch.stack((nibbles >> 4, nibbles & 15), dim=-1).view(n, -1, group_size)  # [N, K / group, group]
    centered = q.to(torch.bfloat16).sub_(8)
    scale, zero = scales_and_zeros.permute(1, 0, 2).unbind(-1)  # [N, K / group] each
    weight = torch.empty_like(centered)  # contiguous, whatever the broadcast operands' strides
    return torch.addcmul(zero[..., None], centered, scale[..., None], out=weight).view(n, -1)


def dequantized_fused(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """`dequantized` written as one expression for torch.compile (one kernel: 0.5 byte read and 2 written
    per weight); in float32, rounded once, so its result is `dequantized`'s bit for bit."""
    n = nibbles.shape[0]
    q = torch.stack((nibbles >> 4, nibbles & 15), dim=-1).view(n, -1, group_size)
    scale, zero = scales_and_zeros.permute(1, 0, 2).unbind(-1)
    weight = (q.to(torch.float32) - 8) * scale[..., None].float() + zero[..., None].float()
    return weight.to(torch.bfloat16).view(n, -1)


DEQUANT_MODES = ("eager", "compiled")  # SPECEXEC_INT4_DEQUANT: how CUDA calls of many rows dequantize
COMPILED_SHAPES = 64  # compiled dequantization: kernels (matrix shapes x tensor kinds) dynamo may keep


def dequant_mode() -> str:
    """SPECEXEC_INT4_DEQUANT, else default_dequant_mode()."""
    return os.environ.get("SPECEXEC_INT4_DEQUANT") or default_dequant_mode()


def tinygemm_max_rows() -> int:
    """Rows up to which a CUDA call runs tinygemm: fewer where the dequantization is compiled (it is faster)."""
    return TINYGEMM_MAX_ROWS_COMPILED if dequant_mode() == "compiled" else TINYGEMM_MAX_ROWS


def dequantize_function(mode: str | None = None) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """`dequantized` (eager: several kernels, 8.2 ms a 70B layer on an H200) or `dequantized_fused` compiled
    by torch.compile (one kernel per matrix shape, compiled on its first call: 1.9 ms, bit for bit the
    eager result; docs/bench/gpu.md, 2026-11-27 H200), by `mode` or SPECEXEC_INT4_DEQUANT; default
    compiled where triton (torch.compile's GPU code generator) is installed, else eager."""
    mode = mode or dequant_mode()
    if mode not in DEQUANT_MODES:
        raise ValueError(f"SPECEXEC_INT4_DEQUANT must be one of {', '.join(DEQUANT_MODES)}, got {mode!r}")
    return _dequantize_by_mode(mode)


@functools.cache
def default_dequant_mode() -> str:
    return "compiled" if importlib.util.find_spec("triton") is not None else "eager"


@functools.cache
def _dequantize_by_mode(mode: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    if mode == "eager":
        return dequantized
    # a kernel per matrix shape (static shapes: 2.1 ms a 70B layer on an H200; dynamic ones took 12.4 ms, slower
    # than eager), so room for every shape of a target and its self-draft, inference and plain tensors apart
    # (dynamo's default of 8 was hit on the H200's first full-shape run: a hard failure under fullgraph)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_SHAPES)
    return torch.compile(dequantized_fused, dynamic=False, fullgraph=True)


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W in torch's int4 layout (module doc); x: [..., in_features]."""

    def __init__(self, in_features: int, out_features: int, group_size: int, kernel_device: str,
                 packed: torch.Tensor, scales_and_zeros: torch.Tensor, perm: torch.Tensor | None,
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.kernel_device = kernel_device  # "cpu": the CPU kernel's layout; "cuda": [N, K / 2] nibble pairs
        # CUDA: calls of up to this many rows run tinygemm, larger ones dequantize; 0 where tinygemm cannot
        # take the matrix (K % 128, N % 8: engine.model.self_draft_quant), which then always dequantizes
        self.tinygemm_max_rows = tinygemm_max_rows()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K / group, N, 2] bf16
        self.register_buffer("perm", perm)  # [K] int64 input order by group (act-order), or None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        rows = rows.to(torch.bfloat16)
        if self.kernel_device == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        elif rows.shape[0] <= self.tinygemm_max_rows:  # CUDA-only
            tiled = torch.ops.aten._convert_weight_to_int4pack(self.packed, CUDA_INNER_K_TILES)
            out = torch.ops.aten._weight_int4pack_mm(rows, tiled, self.group_size, self.scales_and_zeros)
        else:  # CUDA-only
            out = rows @ dequantize_function()(self.packed, self.scales_and_zeros, self.group_size).T
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def from_gptq(module: nn.Module, compute_device: torch.device) -> Int4Linear:
    """The int4 form of a loaded gptqmodel quantized linear (its checks passed: `applies`). The repack
    runs on `compute_device` (milliseconds per matrix on a GPU; ~90 ns per weight on one CPU thread);
    the module's tensors come back on the device the quantized module was on (the host, to stream)."""
    k, n = module.in_features, module.out_features
    q = unpack_rows(module.qweight.to(compute_device))[:k]  # [K, N]
    zeros = unpack_cols(module.qzeros.to(compute_device))[:, :n]  # [K / group, N]
    if module.qzero_format() == 1:  # zero points stored minus one (the v1 file form)
        zeros = zeros + 1
    bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
    return from_values(q.T, zeros.T, module.scales.to(compute_device).T, module.g_idx.to(compute_device),
                       module.group_size, bias, compute_device, module.qweight.device)


def from_values(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, bias: torch.Tensor | None, compute_device: torch.device, home: torch.device) -> Int4Linear:
    """The int4 form of w[n, k] = scales[n, g(k)] * (q[n, k] - zeros[n, g(k)]), g(k) = g_idx[k] or
    k // group: q [N, K] and zeros [N, K / group] unsigned 4-bit values, scales [N, K / group], all on
    `compute_device`, where the repack runs; the buffers come back on `home`."""
    n, k = q.shape
    q = q.to(torch.int32)
    g_idx = torch.arange(k, device=compute_device) // group if g_idx is None else g_idx.to(compute_device, torch.long)
    perm = None
    if not torch.equal(g_idx, torch.arange(k, device=compute_device) // group):
        perm = torch.argsort(g_idx, stable=True)
        q = q[:, perm]
    scales = scales.to(compute_device, torch.float32).T  # [K / group, N]
    zeros = zeros.to(compute_device, torch.float32).T
    scales_and_zeros = torch.stack([scales, scales * (8 - zeros)], dim=-1).to(torch.bfloat16)
    packed = pack_for(q, compute_device)  # on the host
    return Int4Linear(k, n, group, compute_device.type, packed.to(home), scales_and_zeros.to(home),
                      None if perm is None else perm.to(home), None if bias is None else bias.to(home))


def replace_with_int4(layers: list[nn.Module], quantized: list[dict[str, nn.Module]], compute_device: torch.device) -> int:
    """Swap every quantized module (quantized[i]: name -> module of layers[i]) for its Int4Linear;
    returns how many. The caller has checked `applies` for all of them."""
    count = 0
    for layer, modules in zip(layers, quantized, strict=True):
        for name, module in modules.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            setattr(owner, leaf, from_gptq(module, compute_device))
            count += 1
    return count
