"""4-bit checkpoints in AWQ's and compressed-tensors' on-disk formats: detection, and their packed
tensors unpacked into one form that the int4 kernel and the dequantize kernel both start from.

    fmt = format_of(config)                       # Int4Format, or None for other checkpoints
    q, zeros, scales = fmt.values(file_tensors)   # [N, K] uint8, [N, K / group] uint8, [N, K / group]

Every format stores w[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)]) with 4-bit q, groups of
`group_size` along the input dimension k (g(k) = k // group_size, or g_idx[k] with act-order):
- AWQ, GEMM version (AutoAWQ's WQLinear_GEMM, `quant_method: awq`): qweight [K, N / 8] int32 and
  qzeros [K / group, N / 8] int32, eight 4-bit values per word along the output dimension in AWQ's
  interleaved order (nibble i of word c holds column 8c + AWQ_ORDER[i]); scales [K / group, N] fp16.
- compressed-tensors pack-quantized (llm-compressor's W4A16, `quant_method: compressed-tensors`,
  `format: pack-quantized`): weight_packed [N, K / 8] int32, eight values per word along the input
  dimension, nibble i of word c holding column 8c + i, stored as q + 8 for the signed q in [-8, 7];
  weight_scale [N, K / group]; asymmetric schemes add weight_zero_point, packed the same way along the
  output dimension ([ceil(N / 8), K / group] int32; older releases: [N, K / group] int8, signed), and
  act-order `group` adds weight_g_idx [K]. Symmetric: zero 8 in the unsigned form.
In the unsigned form both are w = scale * (q - zero), which is GPTQ's, so the int4 layout is built as
engine.model.gptq_int4 builds it from GPTQ (scales_and_zeros = (scale, scale * (8 - zero))).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.types import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column 8c + AWQ_ORDER[i] lies in nibble i of word c
AWQ_COLUMNS = tuple(AWQ_ORDER.index(j) for j in range(8))  # nibble holding column 8c + j
CT_FORMAT = "pack-quantized"
CT_FP8_FORMAT = "float-quantized"  # compressed-tensors FP8: refused (engine.model.fp8 reads quant_method fp8)


def unpack_last(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 words of eight 4-bit values, nibble i first at bits 4i -> [R, 8C] uint8."""
    out = torch.empty(packed.shape[0], packed.shape[1], 8, dtype=torch.uint8, device=packed.device)
    for i in range(8):
        out[:, :, i] = ((packed >> (4 * i)) & 15).to(torch.uint8)
    return out.view(packed.shape[0], -1)


@dataclass(frozen=True)
class Int4Format:
    method: str  # "awq" or "compressed-tensors"
    group_size: int
    symmetric: bool  # compressed-tensors: no stored zero points
    names: tuple[str, ...]  # the file tensors of one quantized linear map (leaf names)
    marker: str  # the leaf name that marks a quantized linear map in the checkpoint
    g_idx: str | None = None  # the leaf name of act-order's group index, if stored

    def values(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int):
        """(q [N, K] uint8, zeros [N, K / group] uint8, scales [N, K / group]) from one map's file tensors."""
        n, k, groups = out_features, in_features, in_features // self.group_size
        if self.method == "awq":
            order = torch.tensor(AWQ_COLUMNS, device=tensors["qweight"].device)
            columns = (torch.arange(n // 8, device=order.device)[:, None] * 8 + order).reshape(-1)  # [N]
            q = unpack_last(tensors["qweight"])[:, columns].T  # [N, K]
            zeros = unpack_last(tensors["qzeros"])[:, columns].T  # [N, K / group]
            return q.contiguous(), zeros.contiguous(), tensors["scales"].T.contiguous()
        q = unpack_last(tensors["weight_packed"])[:, :k]  # [N, K]
        scales = tensors["weight_scale"]
        if self.symmetric:
            zeros = torch.full((n, groups), 8, dtype=torch.uint8, device=q.device)
        else:
            stored = tensors["weight_zero_point"]
            if stored.dtype == torch.int32:  # packed along the output dimension
                zeros = unpack_last(stored.T.contiguous())[:, :n].T.contiguous()
            else:  # unpacked, signed
                zeros = (stored.to(torch.int16) + 8).to(torch.uint8)
        return q, zeros, scales


def ct_scheme(quant: dict) -> dict:
    """The one weights scheme of a compressed-tensors config (every config group's, which must agree)."""
    groups = list((quant.get("config_groups") or {}).values())
    schemes = [g.get("weights") or {} for g in groups]
    if not schemes or any(s != schemes[0] for s in schemes):
        raise CheckpointError("compressed-tensors: one weights scheme for every config group is supported")
    if any(g.get("input_activations") for g in groups):
        raise CheckpointError("compressed-tensors: quantized activations are not supported (weight-only W4A16 is)")
    return schemes[0]


def format_of(config: dict) -> Int4Format | None:
    """The AWQ or compressed-tensors 4-bit format of a config.json (module doc); None for any other
    checkpoint; CheckpointError for a variant of these formats that is not supported."""
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method") or "").lower()
    if method == "awq":
        bits = int(quant.get("bits") or quant.get("w_bit") or 4)
        version = str(quant.get("version") or "gemm").lower()
        if bits != 4 or version != "gemm" or quant.get("zero_point") is False:
            raise CheckpointError(f"AWQ {bits}-bit, version {version!r}, zero_point {quant.get('zero_point')}: only "
                                  "4-bit GEMM checkpoints with zero points are supported")
        group = int(quant.get("group_size") or quant.get("q_group_size") or 128)
        return Int4Format("awq", group, False, ("qweight", "qzeros", "scales"), "qweight")
    if method == "compressed-tensors":
        fmt = str(quant.get("format") or "")
        if fmt == CT_FP8_FORMAT:  # its weight_scale / input scales are another layout than quant_method fp8's
            raise CheckpointError(
                "compressed-tensors format 'float-quantized' (FP8 W8A8) is not supported: only pack-quantized 4-bit "
                "integer weights in groups (W4A16), and FP8 checkpoints in transformers' block-wise format "
                "(quant_method 'fp8', weight_scale_inv per 128 x 128 block)")
        scheme = ct_scheme(quant)
        ok = (fmt == CT_FORMAT and scheme.get("num_bits") == 4 and scheme.get("type", "int") == "int"
              and scheme.get("strategy") == "group" and not scheme.get("dynamic"))
        if not ok:
            raise CheckpointError(
                f"compressed-tensors format {fmt!r} with weights {scheme}: only pack-quantized 4-bit integer "
                "weights in groups (W4A16) are supported")
        actorder = scheme.get("actorder")
        if actorder not in (None, False, "weight", "group", "static"):
            raise CheckpointError(f"compressed-tensors actorder {actorder!r} is not supported")
        symmetric = bool(scheme.get("symmetric", True))
        g_idx = "weight_g_idx" if actorder == "group" else None
        names = ("weight_packed", "weight_scale") + (() if symmetric else ("weight_zero_point",))
        names += (g_idx,) if g_idx else ()
        return Int4Format("compressed-tensors", int(scheme["group_size"]), symmetric, names, "weight_packed", g_idx)
    return None


def plan_fields(config: dict) -> dict:
    """bits, group_size and act-order of a config's quantization, as the plans read GPTQ's fields."""
    fmt = format_of(config)
    if fmt is None:
        return config.get("quantization_config") or {}
    return {"bits": 4, "group_size": fmt.group_size, "desc_act": fmt.g_idx is not None}


def file_linear_bytes(k: int, n: int, bias: bool, config: dict, dtype_bytes: int) -> int:
    """Bytes of one quantized linear map as the file holds it (the dequantize kernel keeps this form)."""
    fmt = format_of(config)
    assert fmt is not None
    groups = k // fmt.group_size
    scale_bytes = 2  # fp16 (AWQ) or the checkpoint's half dtype (compressed-tensors)
    size = k * n // 2 + groups * n * scale_bytes + (n * scale_bytes if bias else 0)  # bias as stored
    if fmt.method == "awq":
        return size + groups * n // 2
    if not fmt.symmetric:
        size += -(-n // 8) * groups * 4
    if plan_fields(config)["desc_act"]:
        size += k * 4
    return size
