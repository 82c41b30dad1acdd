"""The RAM tier: each streamed layer in one contiguous host buffer, and host memory accounting."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.offload.device import empty_host, unpin_host
from engine.offload.host_memory import host_memory_available
from engine.offload.layout import LayerBinding, LayerLayout, layer_tensors, views
from engine.types import OffloadError


def file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from files (Linux; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return ranges


def anonymous_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of host tensors that are not memory-mapped from a file (freeing them frees RAM)."""
    mapped = file_mapped_ranges()
    total = 0
    for tensor in tensors:
        ptr = tensor.data_ptr()
        if tensor.device.type == "cpu" and not any(lo <= ptr < hi for lo, hi in mapped):
            total += tensor.numel() * tensor.element_size()
    return total


class RamStore:
    """Each streamed layer in one contiguous host buffer (page-locked with CUDA until `close`); at rest
    the module's tensors are views into it (the separate host copies they had before are freed)."""

    source = "ram"

    def __init__(
        self,
        modules: dict[int, nn.Module],
        layouts: dict[int, LayerLayout],
        fill: Callable[[int, torch.Tensor], None] | None = None,
    ):
        """`fill(idx, buffer)` writes layer idx into its buffer (a streaming load from the checkpoint,
        the modules' tensors then only give shapes); without it the modules' tensors are copied."""
        self.layouts = layouts
        self.buffers: dict[int, torch.Tensor] = {}  # layer idx -> [layout.nbytes] uint8
        self.rest: dict[int, list[torch.Tensor]] = {}
        for idx, module in modules.items():
            layout = layouts[idx]
            try:
                buffer = empty_host(layout.nbytes)
            except RuntimeError as exc:  # out of memory, or page-locking failed (OffloadError)
                raise OffloadError(
                    f"cannot allocate {layout.nbytes:,} bytes of host memory for target layer {idx} "
                    f"({host_memory_available():,} available): {exc}"
                ) from exc
            host_views = views(buffer, layout)
            if fill is not None:
                fill(idx, buffer)
            else:
                for view, tensor in zip(host_views, layer_tensors(module).values(), strict=True):
                    view.copy_(tensor)
            LayerBinding(module, layout).bind(host_views)
            self.buffers[idx] = buffer
            self.rest[idx] = host_views

    def close(self) -> None:
        """Unpin the buffers (copies from them must have finished); they stay valid as plain memory."""
        for buffer in self.buffers.values():
            unpin_host(buffer)
