"""The int4 repack (engine.model.gptq_int4.from_gptq) on hand-built GPTQ tensors, without gptqmodel:
the packed module applied to the identity gives the GPTQ-dequantized weight (rounded to bf16), and a
product matches x @ w. On CPU here; the `cuda` case repacks on the GPU (torch's CUDA converter checks
that its input is contiguous, which the CPU one makes it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.model import gptq_int4

K, N, GROUP = 256, 64, 128  # CUDA: K % 128 == 0, N % 8 == 0; CPU: N % 16 == 0


class FakeGPTQLinear(nn.Module):
    """The fields of a gptqmodel quantized linear that from_gptq reads, in the checkpoint's packing:
    qweight [K / 8, N] (eight 4-bit values per int32 along K), qzeros [K / group, N / 8] (along N),
    scales [K / group, N], g_idx [K]."""

    def __init__(self, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, v1: bool):
        super().__init__()
        self.bits, self.group_size, self.in_features, self.out_features = 4, GROUP, K, N
        self.bias = None
        self.v1 = v1
        stored = zeros - 1 if v1 else zeros  # the v1 file form stores zero points minus one
        self.register_buffer("qweight", pack_along(q, axis=0))
        self.register_buffer("qzeros", pack_along(stored, axis=1))
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", g_idx.to(torch.int32))

    def qzero_format(self) -> int:
        return 1 if self.v1 else 2


def pack_along(values: torch.Tensor, axis: int) -> torch.Tensor:
    """Eight 4-bit values per int32 word along `axis`, lowest bits first (GPTQ's order), in numpy."""
    array = values.numpy().astype(np.uint32)
    array = np.moveaxis(array, axis, 0)
    words = np.zeros((array.shape[0] // 8, *array.shape[1:]), dtype=np.uint32)
    for j in range(8):
        words |= array[j::8] << np.uint32(4 * j)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, 0, axis)).view(np.int32))


def random_layer(act_order: bool, v1: bool, seed: int = 0) -> tuple[FakeGPTQLinear, torch.Tensor]:
    """A fake quantized linear and its dequantized weight w [K, N]: w[k, n] = s[g(k), n] (q[k, n] - z[g(k), n])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(1, 16, (K // GROUP, N), generator=gen)  # >= 1: the v1 form stores z - 1
    scales = (torch.rand(K // GROUP, N, generator=gen) * 0.02 + 0.005).half()
    g_idx = torch.arange(K) // GROUP
    if act_order:  # rows of every group scattered over K
        g_idx = g_idx[torch.randperm(K, generator=gen)]
    w = scales.float()[g_idx] * (q - zeros[g_idx]).float()
    return FakeGPTQLinear(q, zeros, scales, g_idx, v1), w


def devices() -> list:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("act_order", "v1"), [(False, False), (True, True)])
def test_int4_repack_gives_the_dequantized_weight(device, act_order, v1):
    device = torch.device(device)
    module, w = random_layer(act_order, v1)
    assert gptq_int4.applies(module, device) is None
    int4 = gptq_int4.from_gptq(module, device)
    assert int4.packed.device.type == "cpu"  # only the packed result is kept on the host (to stream)
    int4 = int4.to(device)
    eye = torch.eye(K, dtype=torch.bfloat16, device=device)
    got = int4(eye).float().cpu()  # [K, N]: row k is w[k]
    scale = w.abs().max()
    assert (got - w).abs().max() <= 0.02 * scale  # bf16 scales and zero terms
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    product = int4(x.to(device)).float().cpu()
    reference = x @ w
    assert (product - reference).norm() <= 0.02 * reference.norm()


def test_a_transposed_view_is_packed_as_its_contiguous_copy():
    values = torch.randint(0, 16, (K, N), dtype=torch.int32)
    cpu = torch.device("cpu")
    assert torch.equal(gptq_int4.pack_for(values.T, cpu), gptq_int4.pack_for(values.T.contiguous(), cpu))


def test_nibble_pairs_dequantize_to_the_gptq_weight():
    """CUDA's form (nibble pairs, dequantized for calls of many rows), checked on the CPU: the GPTQ
    weight, each value (q - 8) x scale + zero rounded once to bf16."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (K // GROUP, N), generator=gen)
    scales = torch.rand(K // GROUP, N, generator=gen) * 0.02 + 0.005
    w = scales.repeat_interleave(GROUP, 0) * (q - zeros.repeat_interleave(GROUP, 0))  # [K, N]
    scales_and_zeros = torch.stack([scales, scales * (8 - zeros)], dim=-1).to(torch.bfloat16)
    got = gptq_int4.dequantized(gptq_int4.nibble_pairs(q.T.int()), scales_and_zeros, GROUP)  # [N, K]
    assert got.dtype == torch.bfloat16 and got.shape == (N, K)
    assert (got.float() - w.T).abs().max() <= 0.01 * w.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_small_and_large_calls_agree():
    """Up to tinygemm_max_rows rows run tinygemm, more dequantize once: the same rows agree closely."""
    device = torch.device("cuda")
    module, w = random_layer(act_order=True, v1=False)
    int4 = gptq_int4.from_gptq(module, device).to(device)
    rows = int4.tinygemm_max_rows
    x = torch.randn(rows + 1, K, device=device)
    small = int4(x[:rows]).float()
    large = int4(x).float()[:rows]
    reference = x[:rows].cpu() @ w
    for out in (small, large):
        assert (out.cpu() - reference).norm() <= 0.02 * reference.norm()
    assert (small - large).norm() <= 0.01 * small.norm()


def fused_case(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    nibbles = gptq_int4.nibble_pairs(torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)).to(device)
    scales_and_zeros = (torch.rand(K // GROUP, N, 2, generator=gen) * 0.02 - 0.01).to(torch.bfloat16).to(device)
    return nibbles, scales_and_zeros


def test_the_fused_dequantization_is_the_eager_one_bit_for_bit():
    nibbles, scales_and_zeros = fused_case(torch.device("cpu"))
    assert torch.equal(gptq_int4.dequantized_fused(nibbles, scales_and_zeros, GROUP),
                       gptq_int4.dequantized(nibbles, scales_and_zeros, GROUP))
    with pytest.raises(ValueError, match="SPECEXEC_INT4_DEQUANT"):
        gptq_int4.dequantize_function("fast")


@pytest.mark.slow
def test_the_compiled_dequantization_takes_every_matrix_shape_of_a_model():
    """SPECEXEC_INT4_DEQUANT=compiled compiles once for all shapes: ten shapes, inference and plain tensors
    (a kernel per shape hit dynamo's recompile limit, a hard failure under fullgraph, on an H200's first
    full-shape run); each result is the eager dequantization's bit for bit. On the CPU (inductor's C++)."""
    compiled = gptq_int4.dequantize_function("compiled")
    gen = torch.Generator().manual_seed(9)
    shapes = [(64, 256), (128, 256), (32, 512), (256, 128), (64, 1024), (96, 256), (160, 384), (48, 640), (512, 256),
              (24, 768)]
    for i, (n, k) in enumerate(shapes):
        nibbles = gptq_int4.nibble_pairs(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen))
        scales_and_zeros = (torch.rand(k // GROUP, n, 2, generator=gen) * 0.02 - 0.01).to(torch.bfloat16)
        with torch.inference_mode() if i % 2 else torch.no_grad():
            want = gptq_int4.dequantized(nibbles, scales_and_zeros, GROUP)
            assert torch.equal(compiled(nibbles, scales_and_zeros, GROUP), want), (n, k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_dequantization_is_the_eager_one_bit_for_bit():
    nibbles, scales_and_zeros = fused_case(torch.device("cuda"))
    compiled = gptq_int4.dequantize_function("compiled")
    assert torch.equal(compiled(nibbles, scales_and_zeros, GROUP), gptq_int4.dequantized(nibbles, scales_and_zeros, GROUP))


def test_tinygemm_takes_fewer_rows_beside_the_compiled_dequantization(monkeypatch):
    """The compiled kernel beats tinygemm from ~16 rows on (H200: 1.7 against 4.4 ms at 64 rows), the eager one
    only past 128."""
    monkeypatch.setenv("SPECEXEC_INT4_DEQUANT", "compiled")
    assert gptq_int4.tinygemm_max_rows() == gptq_int4.TINYGEMM_MAX_ROWS_COMPILED == 16
    monkeypatch.setenv("SPECEXEC_INT4_DEQUANT", "eager")
    assert gptq_int4.tinygemm_max_rows() == gptq_int4.TINYGEMM_MAX_ROWS == 128
