"""Host memory a load will hold, from the checkpoints' safetensors headers, checked before any weights load.

    check_host_memory_before_loading(config, device, dtype)  # OffloadError: one line, what to change

Bytes per tensor come from the headers (dtype and offsets), converted to the load dtype where the
load converts (floating tensors; packed integer tensors load as stored, except GPT-OSS's MXFP4 experts,
which load dequantized: two values a byte of their blocks, their scales nothing; an FP8 checkpoint's layer
maps load as stored, its weight and float32 scales); Mixtral's per-expert
tensors count once, as the fused tensor they load into. What stays in host memory depends on the
path the target loads by:
- an offloaded plain checkpoint streams tensor by tensor (engine.offload.loader): the RAM store (RAM
  source), the host ring or staging, and on a CPU device the resident part;
- a GPTQ or resident target loads through transformers, whole, on the host first; an offloaded one
  then fills its store layer by layer, freeing each loaded layer as it goes;
- the draft loads through transformers on the host (and moves to the device after).
The check adds a margin (HOST_MARGIN_BYTES plus HOST_MARGIN_FRACTION of the need) and compares
with what the host and the process's cgroups still allow (engine.offload.host_memory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine import multimodal
from engine.config import EngineConfig, OffloadConfig
from engine.model import fp8, mxfp4
from engine.offload import host_memory
from engine.offload.build import plan_resident
from engine.offload.device import padded_bytes
from engine.offload.disk_store import READ_CHUNK
from engine.offload.layout import ALIGN
from engine.offload.safetensors_index import read_index
from engine.types import OffloadError

GB = 10**9
HOST_MARGIN_BYTES = 2**30  # the interpreter, libraries, tokenizer, allocator slack
HOST_MARGIN_FRACTION = 0.05
# a decoder layer's tensors, also under a multimodal checkpoint's language model (engine.multimodal)
LAYER_NAME = re.compile(r"^(?:model\.language_model\.|language_model\.model\.|model\.)?layers\.(\d+)\.")
TRANSFORMERS_PREFIXES = ("model.", "lm_head.", "language_model.")


@dataclass(frozen=True)
class CheckpointBytes:
    """A checkpoint's tensors at the load dtype, in host layouts (each tensor ALIGN-rounded)."""

    layers: tuple[int, ...]  # per decoder layer
    outer: int  # embeddings, final norm, head
    disk_streamable: bool = True  # False: MXFP4 experts, which the disk source cannot stream (engine.model.mxfp4)

    @property
    def total(self) -> int:
        return self.outer + sum(self.layers)


def loaded_nbytes(nbytes: int, stored: torch.dtype, dtype: torch.dtype) -> int:
    """Bytes of a stored tensor once loaded: floating tensors convert to `dtype`, others load as stored."""
    if not stored.is_floating_point:
        return nbytes
    return nbytes // stored.itemsize * dtype.itemsize


def checkpoint_bytes(folder: str, dtype: torch.dtype) -> CheckpointBytes:
    """Bytes of the checkpoint in `folder` loaded at `dtype`, from its safetensors headers only."""
    layers: dict[int, int] = {}
    outer = 0
    index = read_index(folder)
    if any(name.startswith(TRANSFORMERS_PREFIXES) for name in index):  # transformers' names; a second copy of the
        # weights in the folder under other names (Mistral's consolidated.safetensors) is never loaded
        index = {name: loc for name, loc in index.items()
                 if name.startswith(TRANSFORMERS_PREFIXES) and not name.startswith(multimodal.NOT_LOADED_PREFIXES)}
    packed = False
    for name, location in index.items():
        match = LAYER_NAME.match(name)
        dequantized = mxfp4.loaded_nbytes(name, location.nbytes, index, dtype)  # GPT-OSS's MXFP4 experts
        packed = packed or dequantized is not None
        if dequantized is None:  # FP8 maps: as stored in a layer (engine.model.fp8)
            dequantized = fp8.loaded_nbytes(name, location.nbytes, index, dtype, match is not None)
        loaded = loaded_nbytes(location.nbytes, location.dtype, dtype) if dequantized is None else dequantized
        nbytes = -(-loaded // ALIGN) * ALIGN
        if match is None:
            outer += nbytes
        else:
            layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + nbytes
    return CheckpointBytes(tuple(layers.get(i, 0) for i in range(max(layers, default=-1) + 1)), outer, not packed)


def host_items(
    offload: OffloadConfig, on_cpu: bool, target: CheckpointBytes, draft: int, streaming: bool
) -> list[tuple[str, int]]:
    """(item, bytes) the load holds in host memory at its peak. on_cpu: the device is the host;
    streaming: the target streams tensor by tensor into its store (an offloaded plain checkpoint)."""
    items: list[tuple[str, int]] = []
    if not offload.enabled:
        items.append(("target (loaded whole on the host)", target.total))
        streamed: list[int] = []
    else:
        resident = set(plan_resident(list(target.layers), offload))
        streamed = [nbytes for idx, nbytes in enumerate(target.layers) if idx not in resident]
        largest = padded_bytes(max(streamed, default=0))
        if not streaming:  # each loaded layer is freed as the store copies it
            items.append(("target (loaded whole on the host)", target.total))
            if offload.source == "ram":
                items.append(("one layer being copied into the store", largest))
        else:
            if offload.source == "ram":
                items.append(("target layer store", sum(padded_bytes(nbytes) for nbytes in streamed)))
            if on_cpu:
                items.append(("target embeddings, head and resident layers",
                              target.outer + sum(target.layers[idx] for idx in resident)))
            items.append(("load staging", READ_CHUNK))
    if streamed and (on_cpu or offload.source == "disk"):
        items.append(("ring or staging buffers", offload.ring_size * largest))
        if offload.source == "disk":
            items.append(("disk read staging", READ_CHUNK))
    if draft:
        items.append(("draft (loaded on the host)", draft))
    return items


def margin_for(need: int) -> int:
    return HOST_MARGIN_BYTES + int(HOST_MARGIN_FRACTION * need)


def describe(items: list[tuple[str, int]]) -> str:
    return ", ".join(f"{name} {nbytes / GB:.2f} GB" for name, nbytes in items if nbytes)


def check_host_memory_before_loading(
    config: EngineConfig, on_cpu: bool, target: CheckpointBytes, draft: int, streaming: bool
) -> int:
    """Raise OffloadError (one line: what the load holds, what is available, what to change) unless
    the load's host memory plus a margin fits what the host and its cgroups allow. Returns the need."""
    offload = config.offload
    items = host_items(offload, on_cpu, target, draft, streaming)
    need = sum(nbytes for _, nbytes in items)
    available = host_memory.host_memory_available()
    if need + margin_for(need) <= available:
        return need
    remedies = []
    if not (offload.enabled and offload.source == "disk") and target.disk_streamable:
        disk = OffloadConfig(**{**vars(offload), "enabled": True, "source": "disk"})
        disk_need = sum(nbytes for _, nbytes in host_items(disk, on_cpu, target, draft, True))
        remedies.append(f"stream the target's layers from its files (--offload --offload-source disk: "
                        f"{disk_need / GB:.2f} GB + margin)")
    if draft:
        remedies.append("use a smaller or quantized draft (--draft)")
    if on_cpu:
        remedies.append("run on a GPU, where the resident part lives in device memory")
    raise OffloadError(
        f"not enough host memory to load {config.model.target!r}: the load holds {need / GB:.2f} GB "
        f"({describe(items)}) plus a {margin_for(need) / GB:.2f} GB margin, and {available / GB:.2f} GB is "
        f"available (MemAvailable or the cgroup limit, whichever is lower); " + "; ".join(remedies or ["free memory"])
    )
