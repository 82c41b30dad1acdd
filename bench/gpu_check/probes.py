"""Device probes: peak memory, host syncs, attention kernels, slowed compute.

CUDA-only calls are marked; on CPU each probe degrades to what a CPU can show (profiled op names,
wall-clock stalls in the compute thread, no sync debug mode, no memory statistics)."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model.runner import DecoderRunner
from engine.offload.device import stream_role, synchronize

GB = 1e9
CALIBRATION_CYCLES = 50_000_000  # torch.cuda._sleep cycles timed to convert seconds into cycles
# op names (profiler, CPU side) of each scaled_dot_product_attention backend; first match wins
SDPA_BACKENDS = (
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_flash_attention_forward", "flash"),
    ("_scaled_dot_product_efficient_attention", "memory-efficient"),
    ("_efficient_attention_forward", "memory-efficient"),
    ("flex_attention", "flex"),
    ("_scaled_dot_product_attention_math", "math"),
)
KERNEL_WORDS = ("fmha", "flash", "attention", "attn", "cudnn", "flex", "softmax")


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def release_memory(device: torch.device) -> None:
    gc.collect()
    if is_cuda(device):  # CUDA-only
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if is_cuda(device):  # CUDA-only
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if is_cuda(device) else None  # CUDA-only


def peak_reserved_bytes(device: torch.device) -> int | None:
    """What the caching allocator held at most (allocated, plus cached blocks it could not hand out)."""
    return torch.cuda.max_memory_reserved(device) if is_cuda(device) else None  # CUDA-only


def allocator_state(device: torch.device) -> str:
    """The caching allocator now: allocated and reserved (peaks), and the free parts of segments in use
    (fragmentation: reserved memory a new block of another size or stream may not fit in)."""
    if not is_cuda(device):
        return "n/a (CPU)"
    stats = torch.cuda.memory_stats(device)  # CUDA-only
    return (f"allocated {gigabytes(stats['allocated_bytes.all.current'])} (peak "
            f"{gigabytes(stats['allocated_bytes.all.peak'])}), reserved {gigabytes(stats['reserved_bytes.all.current'])} "
            f"(peak {gigabytes(stats['reserved_bytes.all.peak'])}), inactive split "
            f"{gigabytes(stats['inactive_split_bytes.all.current'])}, segments {stats['segment.all.current']}")


def allocator_by_stream(device: torch.device) -> str:
    """The caching allocator's segments by the stream they were made for (each stream caches its own blocks)
    and by pool (CUDA graphs' private pools apart): reserved / allocated."""
    if not is_cuda(device):
        return "n/a (CPU)"
    totals: dict[str, list[int]] = {}
    for segment in torch.cuda.memory_snapshot():  # CUDA-only
        if segment["device"] != (device.index or 0):
            continue
        private = segment.get("segment_pool_id", (0, 0)) != (0, 0)
        role = "graph private pools" if private else stream_role(segment["stream"])
        entry = totals.setdefault(role, [0, 0])
        entry[0] += segment["total_size"]
        entry[1] += segment["allocated_size"]
    return ", ".join(f"{role} {gigabytes(r)} / {gigabytes(a)}" for role, (r, a) in sorted(totals.items()))


def allocated_bytes(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if is_cuda(device) else None  # CUDA-only


def gigabytes(nbytes: int | None) -> str:
    return "n/a (CPU)" if nbytes is None else f"{nbytes / GB:.2f} GB"


def seconds_of(device: torch.device, fn: Callable[[], object]) -> float:
    """Wall seconds of `fn` once the device has finished its work (queued work waited for first)."""
    synchronize(device)
    begin = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - begin


@contextmanager
def wrapped_forward(
    runner: DecoderRunner, wrap: Callable[[], AbstractContextManager[Any]]
) -> Iterator[list[Any]]:
    """While open, every pass of `runner` (`forward_groups`, which `forward` and `prefill` call too) runs
    inside a fresh `wrap()`; yields what the contexts gave, one entry per pass (an instance attribute
    shadows the method, as bench's ForwardClock does)."""
    inner = runner.forward_groups
    entered: list[Any] = []

    def forward_groups(groups: list[Any]) -> list[Any]:
        with wrap() as value:
            entered.append(value)
            return inner(groups)

    runner.forward_groups = forward_groups
    try:
        yield entered
    finally:
        del runner.forward_groups


@dataclass(frozen=True)
class Sync:
    """One host sync seen by `counted_syncs`."""

    site: str  # file:line that made it
    thread: str  # the thread that made it (the overlapped target pass runs in "target-pass")
    in_pass: bool  # made inside a target pass marked by `marking_passes`, in whichever thread runs it


_passes = threading.local()  # .active: this thread is inside a marked target pass


@contextmanager
def marking_passes(runner: DecoderRunner) -> Iterator[None]:
    """While open, every pass of `runner` marks its own thread as inside a pass, so a sync it makes is
    attributed to the pass, not to the thread's other work."""

    @contextmanager
    def inside() -> Iterator[None]:
        _passes.active = True
        try:
            yield
        finally:
            _passes.active = False

    with wrapped_forward(runner, inside):
        yield


@contextmanager
def counted_syncs(device: torch.device) -> Iterator[list[Sync]]:
    """Record every host sync `torch.cuda.set_sync_debug_mode("warn")` warns of (CUDA), with the thread
    that made it; on CPU nothing is recorded (there is no sync debug mode)."""
    records: list[Sync] = []

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message).lower():
            records.append(Sync(f"{Path(filename).name}:{lineno}", threading.current_thread().name,
                                getattr(_passes, "active", False)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored by catch_warnings; called from every thread
        if is_cuda(device):  # CUDA-only
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield records
        finally:
            if is_cuda(device):  # CUDA-only
                torch.cuda.set_sync_debug_mode(0)


def sync_sites(caught: Iterable[warnings.WarningMessage]) -> list[str]:
    """`file:line` of each host-sync warning, in order."""
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


def site_summary(sites: list[str], limit: int = 6) -> str:
    counts = Counter(sites).most_common(limit)
    return ", ".join(f"{site} x{n}" if n > 1 else site for site, n in counts) or "-"


@contextmanager
def profiled(device: torch.device) -> Iterator[dict[str, set[str]]]:
    """Names of the ops (CPU side) and kernels (CUDA) that ran inside; filled on exit."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if is_cuda(device):  # CUDA-only
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    names: dict[str, set[str]] = {"ops": set(), "kernels": set()}
    with torch.profiler.profile(activities=activities) as prof:
        yield names
    for event in prof.events():
        kind = "kernels" if event.device_type == torch.autograd.DeviceType.CUDA else "ops"
        names[kind].add(event.name)


def attention_backends(op_names: Iterable[str]) -> list[str]:
    """The scaled_dot_product_attention backends whose ops ran (empty: no SDPA backend op seen)."""
    found = []
    for name in op_names:
        backend = next((label for op, label in SDPA_BACKENDS if op in name), None)
        if backend is not None and backend not in found:
            found.append(backend)
    return sorted(found)


def attention_kernels(kernel_names: Iterable[str], width: int = 70) -> list[str]:
    """Kernel names that look like attention (shortened), for the report."""
    hits = sorted({name for name in kernel_names if any(w in name.lower() for w in KERNEL_WORDS)})
    return [name if len(name) <= width else name[: width - 3] + "..." for name in hits]


def sleep_cycles_per_second(device: torch.device) -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per second, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # CUDA-only
    with torch.cuda.device(device):  # CUDA-only
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
    return CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)


@contextmanager
def slowed_layers(layers: list[nn.Module], seconds: float, device: torch.device) -> Iterator[list[int]]:
    """Every decoder layer's compute first stalls `seconds`: a spin kernel queued on the compute
    stream (CUDA), or the compute thread sleeping (CPU). Yields [number of stalls so far]."""
    cycles = int(seconds * sleep_cycles_per_second(device)) if is_cuda(device) else 0
    calls = [0]

    def stall(module: nn.Module, args: tuple) -> None:
        calls[0] += 1
        if is_cuda(device):
            torch.cuda._sleep(cycles)  # CUDA-only
        else:
            time.sleep(seconds)

    handles = [layer.input_layernorm.register_forward_pre_hook(stall) for layer in layers]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
