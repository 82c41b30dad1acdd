"""Layer layouts: where each tensor of a streamed decoder layer sits in one flat byte buffer.

Every streamed layer has a `LayerLayout`: its tensors (parameters, then buffers, in named order)
at fixed offsets of one flat uint8 buffer, packed at ALIGN-byte offsets (or, on the disk tier,
mirroring the file). A store and every ring slot share the layer's layout, so moving a layer is one
contiguous copy, and binding a module to a buffer is pointing each tensor at a view of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256  # bytes; every tensor view starts at a multiple (vectorised kernels, CUDA alignment)


@dataclass(frozen=True)
class TensorEntry:
    name: str  # relative to the layer, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the layer buffer: a multiple of ALIGN (packed) or of the dtype size (file)
    nbytes: int


@dataclass(frozen=True)
class LayerLayout:
    entries: tuple[TensorEntry, ...]
    nbytes: int  # buffer size: a multiple of ALIGN (packed) or of PAGE (mirroring the file)


def layer_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters then persistent buffers of one layer, by name relative to it: what its checkpoint
    holds, and what streaming moves. Non-persistent buffers are constants a module builds for itself
    (gptqmodel's bit-shift tables, a few bytes each); they are in no checkpoint file, so they stay on
    the compute device with the resident weights (see `constant_buffers`)."""
    tensors = {name: param for name, param in module.named_parameters()}
    constants = {f"{owner}.{leaf}" if owner else leaf for owner, leaf in constant_buffers(module)}
    tensors.update({name: buf for name, buf in module.named_buffers() if name not in constants})
    return tensors


def constant_buffers(module: nn.Module) -> list[tuple[str, str]]:
    """(submodule name, buffer name) of every non-persistent buffer under `module`."""
    return [
        (name, leaf)
        for name, sub in module.named_modules()
        for leaf in sub._non_persistent_buffers_set
        if sub._buffers.get(leaf) is not None
    ]


def layout_of(module: nn.Module) -> LayerLayout:
    entries: list[TensorEntry] = []
    offset = 0
    for name, tensor in layer_tensors(module).items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name, tuple(tensor.shape), tensor.dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return LayerLayout(tuple(entries), max(offset, ALIGN))


def view_of(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The typed view of one tensor in `buffer` (flat uint8 layer buffer)."""
    return buffer[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)


def views(buffer: torch.Tensor, layout: LayerLayout) -> list[torch.Tensor]:
    """Typed views into `buffer` (flat uint8, >= layout.nbytes), in layout order."""
    return [view_of(buffer, e) for e in layout.entries]


def placeholders(layout: LayerLayout) -> list[torch.Tensor]:
    """Right shape and dtype, one element of storage (stride 0): a layer whose bytes are elsewhere."""
    return [torch.zeros((), dtype=e.dtype).expand(e.shape) for e in layout.entries]


class LayerBinding:
    """Points one layer module's tensors at given tensors (ring slot views, host views, placeholders)."""

    def __init__(self, module: nn.Module, layout: LayerLayout):
        self.module = module
        self.targets: list[tuple[nn.Module, str, bool]] = []  # (owner, attribute, is_parameter)
        for entry in layout.entries:
            owner_name, _, leaf = entry.name.rpartition(".")
            owner = module.get_submodule(owner_name)
            self.targets.append((owner, leaf, leaf in owner._parameters))

    def bind(self, tensors: list[torch.Tensor]) -> None:
        for (owner, leaf, is_param), tensor in zip(self.targets, tensors, strict=True):
            if is_param:
                owner._parameters[leaf].data = tensor
            else:
                owner._buffers[leaf] = tensor

    def data_ptrs(self) -> list[int]:
        return [getattr(owner, leaf).data_ptr() for owner, leaf, _ in self.targets]
