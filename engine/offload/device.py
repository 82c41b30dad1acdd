"""The few device-specific operations, behind one small interface (CPU and CUDA alike)."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (CUDA only; CPU work is already done)."""
    if device.type == "cuda":  # CUDA-only
        torch.cuda.synchronize(device)


def timed(device: torch.device, start: float) -> float:
    """Seconds since `start` once the device has finished its queued work."""
    synchronize(device)
    return time.perf_counter() - start


PAGE = 4096  # bytes; direct (O_DIRECT) reads need block-aligned buffers, offsets and lengths


def empty_buffer(nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """A flat uint8 buffer of `nbytes` whose first byte is PAGE-aligned."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, device=device, pin_memory=pin)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


def empty_host(nbytes: int) -> torch.Tensor:
    """A PAGE-aligned flat uint8 host buffer, page-locked when CUDA is available (async copies)."""
    return empty_buffer(nbytes, torch.device("cpu"), pin=torch.cuda.is_available())


class CopyStreams:
    """Copies into the slots of a device ring, ordered against compute with events, never device-wide syncs.

    CUDA: one copy stream per slot; `ready[s]` is recorded after a copy into slot s and `released[s]`
    after the compute that read slot s. CPU: copies run synchronously in the calling thread and the
    ordering calls are no-ops (the caller's host-side bookkeeping already orders them).
    """

    def __init__(self, device: torch.device, num_slots: int):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:  # CUDA-only
            self.streams = [torch.cuda.Stream(device) for _ in range(num_slots)]
            self.ready = [torch.cuda.Event() for _ in range(num_slots)]
            self.released = [torch.cuda.Event() for _ in range(num_slots)]

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src once compute has released `slot`; returns once queued (CUDA) or done (CPU)."""
        if not self.cuda:
            dst.copy_(src)
            return
        stream = self.streams[slot]  # CUDA-only
        stream.wait_event(self.released[slot])
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self.ready[slot].record(stream)

    def wait_ready(self, slot: int) -> None:
        """Make the compute stream wait for the last copy into `slot`."""
        if self.cuda:  # CUDA-only
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def release(self, slot: int) -> None:
        """Mark the compute queued so far as the last reader of `slot`."""
        if self.cuda:  # CUDA-only
            self.released[slot].record(torch.cuda.current_stream(self.device))

    def wait_copied(self, slot: int) -> None:
        """Block the host until the last copy into `slot` finished (its source may be reused)."""
        if self.cuda:  # CUDA-only
            self.ready[slot].synchronize()
