"""Quantized checkpoints (GPTQ): detection, the optional `gptq` extra, loading, streamable kernels.

A checkpoint is quantized when its config.json has a `quantization_config`. GPTQ checkpoints load
through transformers + optimum + gptqmodel (`pip install 'specexec-server[gptq]'`); auto-gptq is
never used (docs/design.md, "Quantized targets").

Loading selects gptqmodel's plain torch kernel (TorchLinear): its packed tensors (qweight, qzeros,
scales, g_idx, bias) are registered buffers, and it dequantises inside forward, one projection at
a time, on whatever device the buffers are on. The offload layout covers parameters and persistent
buffers, so a streamed quantized layer moves in packed form (4-bit, group 128: 3.8x fewer bytes
than fp16) and is never dequantised into a host copy; its non-persistent wf shift tables (a few
constant bytes) stay on the device. Kernels that repack their buffers on first use (gptqmodel's CPU
default, TorchAtenLinear, rewrites qweight into a new shape and keeps `scales_and_zeros` as a plain
attribute) cannot stream and are not selected; on CPU that choice costs speed (docs/bench/quant.md).

Kernels (`select_kernel`, model.gptq_kernel): the int4 kernel (engine.model.gptq_int4: torch's int4
matmul, after a one-time repack into registered buffers that stream) where it applies, else this
dequantize kernel, chosen explicitly and logged.

A v1 ("gptq" format) checkpoint stores every packed zero point minus one; gptqmodel adds the one
back on load (its v2 format). The disk source streams file bytes, so `disk_fixups` gives it the same
addition to redo on each read (qzeros are 1/group_size of qweight, ~3 MB per Llama-2-70B layer).

`make_streamable` removes the torch kernel's per-module state that would outlive a call:
decoded-zeros and g_idx caches (derived tensors that would stay on the device for every streamed
layer), the g_idx move to the host, and the per-module torch.compile of the dequantiser.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from engine.model import mxfp4
from engine.types import CheckpointError, ConfigError

log = logging.getLogger("specexec.engine")

SUPPORTED_METHODS = ("gptq",)  # through transformers and the gptq extra
OTHER_METHODS = ("awq (4-bit GEMM)", "compressed-tensors (pack-quantized W4A16)",  # engine.model.int4_checkpoint
                 "mxfp4 (GPT-OSS's experts, dequantized at load)",  # engine.model.mxfp4
                 "fp8 (block-wise e4m3)")  # engine.model.fp8
GPTQ_MODULES = ("optimum", "gptqmodel")  # transformers' GPTQ path needs both
GPTQ_PIP = "pip install 'specexec-server[gptq]'"
GPTQ_PIP_SOURCE = "pip install -e '.[gptq]'"
GPTQ_BACKEND = "torch"  # gptqmodel TorchLinear: buffers only, dequantises per call, any device


def quant_method(config: dict) -> str | None:
    """The checkpoint's quantization method (lower case), or None for a plain checkpoint."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    return str(quant.get("quant_method") or "unknown").lower()


def streams_as_plain(config: dict) -> bool:
    """Whether an offloaded target of this config.json streams tensor by tensor from its files
    (engine.offload.loader): a plain checkpoint, or MXFP4 experts dequantized as they are read."""
    return quant_method(config) in (None, mxfp4.METHOD)


def missing_modules() -> list[str]:
    """The gptq extra's modules this install lacks."""
    return [name for name in GPTQ_MODULES if importlib.util.find_spec(name) is None]


def check_loadable(path: str, config: dict) -> None:
    """Raise CheckpointError unless this install can load `config`'s quantization (AWQ and
    compressed-tensors 4-bit and FP8 (block-wise or per-tensor) need no extra: engine.model.int4_checkpoint, fp8_checkpoint)."""
    from engine.model import fp8, int4_formats

    method = quant_method(config)
    if method is None or method == mxfp4.METHOD:  # GPT-OSS's experts, dequantized at load (engine.model.mxfp4)
        return
    try:
        if int4_formats.format_of(config) is not None or fp8.format_of(config) is not None:
            return
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if method not in SUPPORTED_METHODS:
        raise CheckpointError(
            f"{path}: quantization method {method!r} is not supported; supported: "
            f"{', '.join((*SUPPORTED_METHODS, *OTHER_METHODS))}"
        )
    missing = missing_modules()
    if missing:
        bits = config["quantization_config"].get("bits", "?")
        raise CheckpointError(
            f"{path} is a GPTQ {bits}-bit checkpoint; loading it needs the optional 'gptq' extra "
            f"({', '.join(missing)} not installed). Install it with:\n"
            f"    {GPTQ_PIP}\n"
            f"or, from a source checkout:\n"
            f"    {GPTQ_PIP_SOURCE}"
        )


def load_kwargs(config: dict) -> dict:
    """Extra from_pretrained arguments for a quantized checkpoint (only the kernel choice overrides
    the checkpoint's own quantization_config)."""
    from transformers import GPTQConfig

    bits = int(config["quantization_config"].get("bits", 4))
    return {"quantization_config": GPTQConfig(bits=bits, backend=GPTQ_BACKEND)}


def quantized_modules(module: nn.Module) -> dict[str, nn.Module]:
    """Submodules (by name relative to `module`) that hold packed quantized weights."""
    return {name: sub for name, sub in module.named_modules()
            if getattr(sub, "qweight", None) is not None and not getattr(sub, "file_packed", False)}


def unregistered_tensors(module: nn.Module) -> list[str]:
    """Tensors kept as plain attributes (not parameters or buffers) anywhere under `module`.

    The layer streamer only moves parameters and buffers: such a tensor would stay where it was
    made (the host, or the device for every streamed layer at once)."""
    found = []
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr in ("_parameters", "_buffers"):
                continue
            values = value.values() if isinstance(value, dict) else [value]
            if any(isinstance(v, torch.Tensor) for v in values):
                found.append(f"{name}.{attr}" if name else attr)
    return found


def _reset_derived_state(module: nn.Module, _args: tuple, _output: torch.Tensor) -> None:
    module._stream_reset_cache()


def make_streamable(model: nn.Module) -> None:
    """Make every quantized decoder-layer module stateless between calls (see the module doc)."""
    for idx, layer in enumerate(model.model.layers):
        for name, sub in quantized_modules(layer).items():
            if not all(
                hasattr(sub, a)
                for a in ("_stream_reset_cache", "enable_weight_cache", "enable_lookahead", "enable_streaming")
            ):
                raise CheckpointError(
                    f"decoder layer {idx} {name}: quantized kernel {type(sub).__name__} is not supported "
                    f"(expected gptqmodel's torch kernel, backend={GPTQ_BACKEND!r})"
                )
            sub.__dict__.pop("dequantize_weight", None)  # the class's eager dequantiser, not a compiled copy
            sub.enable_weight_cache(False)  # GPTQ_TORCH_CACHE_WEIGHTS=1 would keep dequantised weights
            sub.enable_lookahead(False)  # GPTQ_TORCH_LOOKAHEAD=1 would prefetch into the next module
            # CUDA only: GPTQ_TORCH_STREAMING=1 dequantises tiles on a side stream that never waits for
            # the current one, so it could read a ring slot before the layer's copy into it has landed.
            sub.enable_streaming(False)
            sub._maybe_offload_g_idx_to_cpu = _keep_g_idx
            sub.register_forward_hook(_reset_derived_state)
        stray = unregistered_tensors(layer)
        if stray:
            raise CheckpointError(
                f"decoder layer {idx} keeps tensors outside its parameters and buffers "
                f"({', '.join(stray)}): the layer streamer cannot move them"
            )


def int4_refusals(model: nn.Module, compute_device: torch.device) -> list[str]:
    """Why the int4 kernel cannot run `model`'s quantized layers on `compute_device` (empty: it can)."""
    from engine.model import gptq_int4

    reasons = []
    for idx, layer in enumerate(model.model.layers):
        for name, sub in quantized_modules(layer).items():
            why = gptq_int4.applies(sub, compute_device)
            if why is not None:
                reasons.append(f"decoder layer {idx} {name}: {why}")
    return reasons


def select_kernel(model: nn.Module, requested: str, compute_device: torch.device) -> str:
    """Run `model`'s quantized layers (made streamable) on the int4 kernel or keep the dequantize one;
    returns the kernel chosen. requested: int4 (ConfigError where it cannot run), dequantize, or auto
    (int4 where it can run)."""
    from engine.model import gptq_int4

    if requested == "dequantize":
        return "dequantize"
    reasons = int4_refusals(model, compute_device)
    if reasons and requested == "int4":
        raise ConfigError("model.gptq_kernel", f"the int4 kernel cannot run this checkpoint: {'; '.join(reasons[:3])}; "
                          "use --gptq-kernel dequantize (or auto)")
    if reasons:
        log.info("GPTQ layers use the dequantize kernel: %s", reasons[0])
        return "dequantize"
    layers = list(model.model.layers)
    gptq_int4.replace_with_int4(layers, [quantized_modules(layer) for layer in layers], compute_device)
    return "int4"


def _keep_g_idx() -> None:
    """g_idx stays a buffer on its layer's device (gptqmodel would move it to the host)."""


V1_FORMATS = ("gptq",)  # checkpoint formats whose zero points are stored minus one
CONSTANT_OFFSET_BITS = (2, 4, 8)  # widths whose +1 per field is one constant added to each packed word


def checkpoint_format(model_config) -> str | None:
    """The quantized checkpoint's on-disk format ("gptq": v1 zero points), from a loaded model's config."""
    quant = getattr(model_config, "quantization_config", None)
    if quant is None:
        return None
    fields = quant if isinstance(quant, dict) else vars(quant)
    return str(fields.get("checkpoint_format") or fields.get("format") or "gptq").lower()


def packed_ones(bits: int, word_bits: int) -> int:
    """The packed word holding 1 in every `bits`-wide field (e.g. 0x11111111 for 4 bits in int32)."""
    return sum(1 << (bits * k) for k in range(word_bits // bits))


def _add_inplace(tensor: torch.Tensor, value: int) -> None:
    tensor.add_(value)  # integer add wraps like the packed arithmetic it mirrors


def disk_fixups(model_config, layers: dict[int, nn.Module]) -> dict[int, dict[str, Callable]]:
    """Per streamed layer, the in-place changes that turn its file tensors into the loaded ones.

    Raises CheckpointError for a layer whose loaded form cannot be rebuilt from the file this way."""
    fmt = checkpoint_format(model_config)
    if fmt not in V1_FORMATS:  # None (not quantized) or a format stored as loaded
        return {}
    fixups: dict[int, dict[str, Callable]] = {}
    for idx, layer in layers.items():
        for name, sub in quantized_modules(layer).items():
            if sub.qzero_format() != 2:  # the kernel keeps the file's v1 zero points
                continue
            if sub.bits not in CONSTANT_OFFSET_BITS:
                raise CheckpointError(
                    f"decoder layer {idx} {name}: {sub.bits}-bit zero points of a {fmt!r} checkpoint are "
                    "converted on load in a way the disk source does not redo; use --offload-source ram"
                )
            word_bits = torch.iinfo(sub.pack_dtype).bits
            ones = packed_ones(sub.bits, word_bits)
            fixups.setdefault(idx, {})[f"{name}.qzeros"] = partial(_add_inplace, value=ones)
    return fixups
