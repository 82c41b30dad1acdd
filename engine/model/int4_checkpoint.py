"""Loading AWQ and compressed-tensors 4-bit checkpoints (engine.model.int4_formats) without their libraries.

    model = load_int4_checkpoint(folder, fmt, dtype, home, kernel, compute_device)

The model is built on the `meta` device from config.json (its quantization_config left out), every
quantized linear map is replaced, and the other tensors are read from the safetensors files
(engine.offload.loader.materialize). Per `kernel` (model.gptq_kernel):
- int4: each map is converted once at load into the int4 kernel's layout on `compute_device` (the GPU
  when there is one) and kept on `home` as gptq_int4.Int4Linear buffers, which stream packed like GPTQ's;
- dequantize: each map keeps the file's own tensors (FilePackedLinear: AWQ's qweight, qzeros and scales;
  compressed-tensors' weight_packed, weight_scale, ...) under their file names and dequantizes its
  weight on every call. A target streamed from disk uses it: the disk source reads those tensors as
  they lie in the file, with no fixup (the loaded form is the file form).
Both compute w = scale * (q - zero) from the same unpacked values; the dequantize kernel's weight is
that product in float32, rounded once to the model's dtype, so in float32 its output is a plain
linear layer over the dequantized weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from engine import multimodal
from engine.model import gptq_int4
from engine.model.int4_formats import Int4Format
from engine.types import CheckpointError

log = logging.getLogger("specexec.engine")

DEQUANT_CHUNK_ROWS = 4096  # output rows dequantized at a time (bounds the float32 scratch)


class FilePackedLinear(nn.Module):
    """y = x @ W.T + bias, W dequantized per call from the file's packed tensors (module doc)."""

    file_packed = True  # not a gptqmodel module (engine.model.gptq.quantized_modules)

    def __init__(self, fmt: Int4Format, in_features: int, out_features: int, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        for name in fmt.names:
            self.register_buffer(name, tensors[name])
        self.register_buffer("bias", bias)

    def weight_now(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] at `dtype`: scale * (q - zero) in float32, rounded once."""
        tensors = {name: getattr(self, name) for name in self.fmt.names}
        q, zeros, scales = self.fmt.values(tensors, self.out_features, self.in_features)
        g_idx = tensors.get(self.fmt.g_idx) if self.fmt.g_idx else None
        if g_idx is None:
            g_idx = torch.arange(self.in_features, device=q.device) // self.fmt.group_size
        g_idx = g_idx.long()
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=q.device)
        for begin in range(0, self.out_features, DEQUANT_CHUNK_ROWS):
            rows = slice(begin, begin + DEQUANT_CHUNK_ROWS)
            centered = q[rows].float() - zeros[rows][:, g_idx].float()
            weight[rows] = centered.mul_(scales[rows][:, g_idx].float())
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_now(x.dtype), bias)


def int4_refusal(fmt: Int4Format, k: int, n: int, compute_device: torch.device) -> str | None:
    """Why the int4 kernel cannot run a k x n map of this format on `compute_device`, or None."""
    if fmt.group_size not in gptq_int4.GROUP_SIZES or k % fmt.group_size:
        return f"{k} input features in groups of {fmt.group_size} (the kernel takes groups of 32-256)"
    if compute_device.type == "cpu" and n % gptq_int4.CPU_N_MULTIPLE:
        return f"{n} output features (the CPU kernel needs a multiple of {gptq_int4.CPU_N_MULTIPLE})"
    if compute_device.type == "cuda":  # CUDA-only
        if torch.cuda.get_device_capability(compute_device) < (8, 0):
            return "a GPU below compute capability 8.0"
        if k % (16 * gptq_int4.CUDA_INNER_K_TILES) or n % 8:
            return f"a {k} x {n} matrix (the CUDA kernel needs K % 128 == 0 and N % 8 == 0)"
    elif compute_device.type != "cpu":
        return f"device {compute_device.type}"
    return None


def quantized_names(marker: str, index: dict) -> dict[str, str]:
    """The checkpoint's quantized linear maps (those holding a `marker` tensor): the model's module name ->
    the checkpoint's (a multimodal checkpoint's language model prefix; its vision tower left out)."""
    suffix = "." + marker
    stored = [name.removesuffix(suffix) for name in index
              if name.endswith(suffix) and not name.startswith(multimodal.NOT_LOADED_PREFIXES)]
    return dict(sorted((multimodal.model_name(name), name) for name in stored))


def read_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the headers of the folder's safetensors files."""
    import json
    import struct
    from pathlib import Path

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes.setdefault(name, tuple(meta["shape"]))
    return shapes


def read_tensors(reader, shapes: dict, prefix: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named file tensors of one map, as stored (dtype and shape from the safetensors headers)."""
    out = {}
    for name in names:
        full = f"{prefix}.{name}"
        if full not in reader.index:
            raise CheckpointError(f"{reader.folder}: no tensor {full}")
        out[name] = torch.empty(shapes[full], dtype=reader.index[full].dtype)
        reader.read([full], out[name])
    return out


def meta_model(folder: str, dtype: torch.dtype) -> nn.Module:
    """The checkpoint's model on the `meta` device, built as a plain (unquantized) model of its config."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, GenerationConfig

    config = multimodal.hf_config(folder)  # a multimodal checkpoint: its text model's
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the maps are replaced here, not by a transformers quantizer
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval().requires_grad_(False)


def replace_map(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    linear = getattr(owner, leaf)
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"{name}: quantized in the checkpoint but a {type(linear).__name__} in the model")
    setattr(owner, leaf, module)
    return linear


def load_int4_checkpoint(folder: str, fmt: Int4Format, dtype: torch.dtype, home: torch.device, kernel: str,
                         compute_device: torch.device) -> tuple[nn.Module, str]:
    """The model with its quantized maps in `kernel`'s form (module doc; int4 falls back to dequantize
    where it cannot run, auto is int4 where it can); returns it and the kernel used."""
    used = kernel

    def replace(model: nn.Module, names: dict[str, str], files: tuple) -> list[nn.Module]:
        nonlocal used
        metas = {name: model.get_submodule(name) for name in names}
        refusals = [f"{name}: {why}" for name, m in metas.items()
                    if (why := int4_refusal(fmt, m.in_features, m.out_features, compute_device))]
        if kernel == "int4" and refusals:
            from engine.types import ConfigError

            raise ConfigError("model.gptq_kernel", f"the int4 kernel cannot run this checkpoint: {refusals[0]}; use "
                              "--gptq-kernel dequantize (or auto)")
        used = "dequantize" if kernel == "dequantize" or refusals else "int4"
        if refusals:
            log.info("%s layers use the dequantize kernel: %s", fmt.method, refusals[0])
        return [build_map(model, name, stored, fmt, files, used, dtype, home, compute_device)
                for name, stored in names.items()]

    model = load_replacing(folder, dtype, home, f"a {fmt.method} config", fmt.marker, replace)
    return model, used


def load_replacing(folder: str, dtype: torch.dtype, home: torch.device, config_kind: str, marker: str,
                   replace: Callable[[nn.Module, dict[str, str], tuple], list[nn.Module]]) -> nn.Module:
    """The checkpoint's model built on `meta` with the maps holding `marker` tensors replaced by
    `replace(model, quantized names, (reader, shapes))`, the rest read from the files onto `home`."""
    from engine.offload.loader import CheckpointReader, check_no_meta, materialize, rebuild_rotary

    model = meta_model(folder, dtype)
    reader = CheckpointReader(folder, evict=False)
    try:
        names = quantized_names(marker, reader.index)
        if not names:
            raise CheckpointError(f"{folder}: {config_kind} but no {marker} tensors in its files")
        replaced = replace(model, names, (reader, read_shapes(folder)))
        materialize(model, replaced, reader, home)
        rebuild_rotary(model, home)
        check_no_meta(model, replaced)
    finally:
        reader.close()
    return model


def build_map(model: nn.Module, name: str, stored: str, fmt: Int4Format, files: tuple, kernel: str,
              dtype: torch.dtype, home: torch.device, compute_device: torch.device) -> nn.Module:
    """The map `name` in `kernel`'s form from its file tensors under `stored` (files: the reader and the shapes)."""
    meta = model.get_submodule(name)
    k, n = meta.in_features, meta.out_features
    tensors = read_tensors(*files, stored, fmt.names)
    bias = None
    if meta.bias is not None:
        bias = read_tensors(*files, stored, ("bias",))["bias"]  # as stored; cast to the activations per call
    if kernel == "dequantize":
        module = FilePackedLinear(fmt, k, n, {key: t.to(home) for key, t in tensors.items()},
                                  None if bias is None else bias.to(home))
    else:
        on_device = {key: t.to(compute_device) for key, t in tensors.items()}
        q, zeros, scales = fmt.values(on_device, n, k)
        g_idx = on_device.get(fmt.g_idx) if fmt.g_idx else None
        module = gptq_int4.from_values(q, zeros, scales, g_idx, fmt.group_size, bias, compute_device, home)
    replace_map(model, name, module)
    return module
