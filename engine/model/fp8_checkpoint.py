"""Loading FP8 checkpoints, block-wise or per tensor (engine.model.fp8), with no quantization library.

    model = load_fp8_checkpoint(folder, fmt, dtype, home)

As engine.model.int4_checkpoint does for AWQ and compressed-tensors: the model is built on the `meta`
device from config.json (its quantization_config left out), every quantized linear map (one whose
`weight_scale_inv` is in the files) is replaced, and the other tensors are read from the safetensors
files (engine.offload.loader.materialize), converted to `dtype` as for a plain checkpoint.
- A decoder layer's map becomes an fp8.Fp8Linear holding the file's FP8 weight and float32 scales as
  stored, dequantized per call: resident, streamed from RAM and streamed from disk alike, a layer is
  those bytes (the disk source reads them as the files store them);
- a map outside the decoder layers (a quantized lm_head) is dequantized once here into a plain weight of
  `dtype`, so the embeddings, head and norms load as usual.
A per-tensor checkpoint's static activation scales (`activation_scale` / `input_scale`) are in no module,
so nothing reads them: the dequantization is weights only (engine.model.fp8).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model import fp8
from engine.model.int4_checkpoint import load_replacing, read_tensors
from engine.types import CheckpointError


def layer_map(name: str) -> bool:
    """Whether module `name` lies inside a decoder layer (it streams with it)."""
    return name.startswith("model.layers.")


def load_fp8_checkpoint(folder: str, fmt: fp8.Fp8Format, dtype: torch.dtype, home: torch.device) -> nn.Module:
    """The model with its quantized layer maps as Fp8Linear on `home` (module doc)."""
    def replace(model: nn.Module, names: dict[str, str], files: tuple) -> list[nn.Module]:
        return [build_map(model, name, stored, fmt, files, dtype, home) for name, stored in names.items()]

    return load_replacing(folder, dtype, home, "an FP8 config", fmt.marker, replace)


def build_map(model: nn.Module, name: str, stored: str, fmt: fp8.Fp8Format, files: tuple, dtype: torch.dtype,
              home: torch.device) -> nn.Module:
    """The map `name` from its file tensors under `stored` (files: the reader and the shapes): an Fp8Linear in
    a decoder layer, else the meta nn.Linear with its weight dequantized (and its bias read) here."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"{name}: FP8 in the checkpoint but a {type(linear).__name__} in the model (only linear "
                              "maps can be FP8 here)")
    k, n = linear.in_features, linear.out_features
    tensors = read_tensors(*files, stored, fmt.names)
    bias = None
    if linear.bias is not None:
        bias = read_tensors(*files, stored, ("bias",))["bias"].to(dtype)
    if not layer_map(name):
        module = fp8.Fp8Linear(fmt, k, n, tensors["weight"], tensors[fp8.SCALE], None)  # checks the shapes
        linear.weight = nn.Parameter(module.weight_now(dtype).to(home), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.to(home), requires_grad=False)
        return linear
    module = fp8.Fp8Linear(fmt, k, n, tensors["weight"].to(home), tensors[fp8.SCALE].to(home),
                           None if bias is None else bias.to(home))
    owner_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner_name), leaf, module)
    return module
