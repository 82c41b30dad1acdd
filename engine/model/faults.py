"""Device errors raised while generating, told apart: a broken device, or memory that ran out.

A CUDA runtime error (an illegal access, a failed kernel or cuBLAS call, a failed copy in the
offload ring) leaves the CUDA context unusable: the engine is down (EngineFault). Running out of
device memory fails the request that asked for it; the engine frees what it can and goes on.
"""

from __future__ import annotations

import torch

CUDA_MESSAGE_PREFIXES = ("CUDA error", "CUDA driver error")
CUDA_MESSAGE_PARTS = ("CUBLAS_STATUS", "cuDNN error", "CUDNN_STATUS")
ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)  # torch >= 2.8


def causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def is_out_of_memory(exc: BaseException) -> bool:
    return any(isinstance(each, torch.OutOfMemoryError) for each in causes(exc))


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA runtime error anywhere in the chain (an OffloadError from a failed device copy too);
    out-of-memory is not one."""
    if is_out_of_memory(exc):
        return False
    for each in causes(exc):
        if ACCELERATOR_ERROR is not None and isinstance(each, ACCELERATOR_ERROR):
            return True
        if isinstance(each, RuntimeError):
            message = str(each)
            if message.startswith(CUDA_MESSAGE_PREFIXES) or any(part in message for part in CUDA_MESSAGE_PARTS):
                return True
    return False


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def release_device_memory(device: torch.device) -> None:
    """Return cached blocks to the device after a failed request dropped its tensors."""
    if device.type == "cuda":  # CUDA-only
        torch.cuda.empty_cache()


def request_error(exc: Exception) -> Exception:
    """`exc`, raised by one request's own part of a step (its tree, its verification): that request
    fails alone. A device fault is the engine's, not the request's: it is raised again."""
    if is_device_fault(exc):
        raise exc
    return exc
