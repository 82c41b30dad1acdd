"""Per-layer costs of the full-shape target: the 4-bit kernels by rows per call, and a streamed pass
against max(plain copy of its layers, its compute alone).

tinygemm: torch's int4 matmul, after converting the layer's nibble pairs to its tiled layout (what
`Int4Linear` does for calls of up to TINYGEMM_MAX_ROWS rows). bf16 once: the nibble pairs dequantized
to a bf16 matrix, then one matmul (what it does for larger calls). gptqmodel-like: unpacking the
checkpoint's int32 words with int32 arithmetic on every call, as the dequantize kernel does. bf16
dense: the unquantized layer, for scale. engine: `Int4Linear` itself, which picks one of the first two.
compiled: bf16 once with the dequantization compiled by torch.compile into one kernel (the first call
of each matrix shape compiles, in the warm-up)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from bench.gpu_check.plan import FullShape
from bench.gpu_check.probes import seconds_of
from engine.model.gptq_int4 import (
    CUDA_INNER_K_TILES,
    Int4Linear,
    dequantize_function,
    dequantized,
    pack_for,
    unpack_cols,
    unpack_rows,
)
from engine.model.runner import DecoderRunner, ResidentLayers

REPEATS = 3  # best of


@dataclass(frozen=True)
class KernelRow:
    num_rows: int  # one layer's seven projections, seconds each:
    tinygemm_s: float
    bf16_once_s: float
    gptq_like_s: float
    dense_s: float
    engine_s: float
    compiled_s: float  # bf16 once with the dequantization compiled into one kernel (SPECEXEC_INT4_DEQUANT=compiled)


@dataclass(frozen=True)
class PassRow:
    num_tokens: int
    compute_s: float  # every layer computed from one resident copy: no copies
    copy_s: float  # every streamed layer copied, no compute
    streamed_s: float  # the engine's streamed pass


def best_of(device: torch.device, fn) -> float:
    fn()  # warm-up (kernel selection, allocator)
    return min(seconds_of(device, fn) for _ in range(REPEATS))


def projection_shapes(shape: FullShape) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's projections, PROJECTIONS' order."""
    attn, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return [(shape.hidden, attn), (shape.hidden, kv), (shape.hidden, kv), (attn, shape.hidden),
            (shape.hidden, shape.mlp), (shape.hidden, shape.mlp), (shape.mlp, shape.hidden)]


def gptq_form(in_features: int, out_features: int, group: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random GPTQ tensors on `device`: qweight [K / 8, N] int32, qzeros [K / group, N / 8], scales [K / group, N]."""
    qweight = torch.randint(-2**31, 2**31 - 1, (in_features // 8, out_features), dtype=torch.int32, device=device)
    qzeros = torch.randint(-2**31, 2**31 - 1, (in_features // group, out_features // 8), dtype=torch.int32, device=device)
    scales = torch.rand(in_features // group, out_features, device=device, dtype=torch.float16) * 0.01
    return qweight, qzeros, scales


def dequantize_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group: int) -> torch.Tensor:
    """x [n, K] @ the dequantized [K, N] weight, dequantized on this call (the dequantize kernel's work)."""
    q = unpack_rows(qweight)  # [K, N]
    zeros = unpack_cols(qzeros)  # [K / group, N]
    weight = (q.view(-1, group, q.shape[1]) - zeros[:, None]).to(scales.dtype) * scales[:, None]
    return x @ weight.view(q.shape).to(x.dtype)


def tinygemm(module: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    tiled = torch.ops.aten._convert_weight_to_int4pack(module.packed, CUDA_INNER_K_TILES)  # CUDA-only
    return torch.ops.aten._weight_int4pack_mm(x, tiled, module.group_size, module.scales_and_zeros)


def bf16_once(module: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ dequantized(module.packed, module.scales_and_zeros, module.group_size).T


def bf16_once_compiled(module: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    fused = dequantize_function("compiled")
    return x @ fused(module.packed, module.scales_and_zeros, module.group_size).T


def kernel_rows(shape: FullShape, device: torch.device, dtype: torch.dtype) -> list[KernelRow]:
    rows = []
    shapes = projection_shapes(shape)
    int4, gptq, dense = [], [], []
    for k, n in shapes:
        values = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
        sz = (torch.rand(k // shape.group_size, n, 2, device=device) * 0.01).to(torch.bfloat16)
        int4.append(Int4Linear(k, n, shape.group_size, device.type, pack_for(values, device).to(device), sz, None, None))
        gptq.append(gptq_form(k, n, shape.group_size, device))
        dense.append(torch.randn(k, n, device=device, dtype=dtype) * 0.01)
    cuda = device.type == "cuda"
    for num_rows in shape.kernel_tokens:
        xs = [torch.randn(num_rows, k, device=device, dtype=torch.bfloat16) for k, _ in shapes]
        engine = best_of(device, lambda xs=xs: [m(x) for m, x in zip(int4, xs, strict=True)])
        rows.append(KernelRow(
            num_rows,
            best_of(device, lambda xs=xs: [tinygemm(m, x) for m, x in zip(int4, xs, strict=True)]) if cuda else engine,
            best_of(device, lambda xs=xs: [bf16_once(m, x) for m, x in zip(int4, xs, strict=True)]) if cuda else engine,
            best_of(device, lambda xs=xs: [dequantize_matmul(x, *g, shape.group_size) for g, x in zip(gptq, xs, strict=True)]),
            best_of(device, lambda xs=xs: [x.to(dtype) @ w for w, x in zip(dense, xs, strict=True)]),
            engine,
            best_of(device, lambda xs=xs: [bf16_once_compiled(m, x) for m, x in zip(int4, xs, strict=True)]) if cuda else engine,
        ))
    return rows


def resident_copy_runner(target: DecoderRunner, device: torch.device) -> DecoderRunner:
    """The target's model with its first streamed layer copied to the device and used for every layer:
    a pass of all the compute and no copies."""
    streamer = target.layers
    first = streamer.streamed[0]
    with streamer.layer(first) as module:  # bound to a ring slot while inside
        resident = copy.deepcopy(module).to(device)
    streamer.restart()  # the use above counted in the ring's order: start the next pass clean
    runner = copy.copy(target)
    runner.layers = ResidentLayers([resident] * streamer.num_layers)
    return runner


def pass_call(runner: DecoderRunner, num_tokens: int, prefix_len: int, device: torch.device):
    """A causal pass of `num_tokens` after `prefix_len` committed cache slots (a tree pass's cost)."""
    cache = runner.new_cache(prefix_len + num_tokens)
    cache.length = prefix_len
    ids = torch.randint(3, runner.vocab_size, (num_tokens,), device=device)
    positions = torch.arange(prefix_len, prefix_len + num_tokens, device=device)
    allowed = torch.ones(num_tokens, prefix_len + num_tokens, dtype=torch.bool, device=device).tril(prefix_len)
    return lambda: runner.forward(ids, positions, cache, prefix_len, allowed)


def plain_copy_seconds(target: DecoderRunner, device: torch.device) -> float:
    """Every streamed layer copied from its store buffer into two buffers of the ring's size in turn,
    no compute, once the streamer's own prefetch is done (best of)."""
    streamer = target.layers
    streamer.wait_prefetched()
    slots = [torch.empty(streamer.slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]

    def copy_all() -> None:
        for index, idx in enumerate(streamer.streamed):
            source = streamer.store.buffers[idx]
            slots[index % 2][: source.numel()].copy_(source, non_blocking=True)

    return best_of(device, copy_all)


def pass_rows(target: DecoderRunner, shape: FullShape, device: torch.device, tokens: list[int]) -> list[PassRow]:
    compute = resident_copy_runner(target, device)
    copy_s = plain_copy_seconds(target, device)
    rows = []
    for num_tokens in tokens:
        rows.append(PassRow(
            num_tokens,
            best_of(device, pass_call(compute, num_tokens, shape.prompt_len, device)),
            copy_s,
            best_of(device, pass_call(target, num_tokens, shape.prompt_len, device)),
        ))
    return rows
