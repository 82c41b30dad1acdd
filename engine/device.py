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
