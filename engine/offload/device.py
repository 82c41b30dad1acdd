"""The few device-specific operations, behind one small interface (CPU and CUDA alike)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

import torch

from engine.types import OffloadError


def synchronize(device: torch.device) -> None:
    """Wait for ALL queued work on `device`, the offload ring's copy streams included (CUDA only;
    CPU work is already done). For benchmarks; the engine waits on its compute stream only."""
    if device.type == "cuda":  # CUDA-only
        torch.cuda.synchronize(device)


def synchronize_stream(device: torch.device) -> None:
    """Wait for the work queued on the current (compute) stream of `device`, not for other streams
    (prefetch copies of the next pass run there). CPU: no-op."""
    if device.type == "cuda":  # CUDA-only
        torch.cuda.current_stream(device).synchronize()


class PhaseClock:
    """Durations of consecutive phases of work on the compute stream, read after the caller's own
    host sync, with no device-wide sync.

    CUDA: `mark()` records a timing event on the current stream; `seconds()` reads the time between
    consecutive events (the copy streams are never waited for). CPU: wall time at each mark (the
    work is done when the call that queued it returns).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._events: list[torch.cuda.Event] = []
        self._times: list[float] = []
        self.mark()

    def mark(self) -> None:
        """End the current phase here (queue order on CUDA) and start the next."""
        if self.cuda:  # CUDA-only
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events.append(event)
        else:
            self._times.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds of each phase between consecutive marks. CUDA: call after a host sync on the compute
        stream that follows the last mark; waiting on the last event then returns at once."""
        if not self.cuda:
            return [end - begin for begin, end in pairwise(self._times)]
        self._events[-1].synchronize()  # CUDA-only: already complete after the caller's sync
        return [begin.elapsed_time(end) / 1000 for begin, end in pairwise(self._events)]


# torch.cuda.Stream hands out streams round robin from a pool of 32 per priority, so two calls can return the
# same CUDA stream. A stream another thread queues on (a layer copy, the target pass) must never be the one the
# main thread captures a CUDA graph on: that thread's work would join the capture (cudaErrorStreamCaptureIsolation,
# seen on an H200). So threads other than the main one use priority-0 streams, the main thread's side streams
# (the draft's, graph captures) come from the priority -1 pool, and `main_thread_stream` checks it.
WORKER_PRIORITY = 0
MAIN_PRIORITY = -1  # lower is sooner; CUDA maps it into the device's range
_worker_streams: set[int] = set()  # cuda_stream handles of every worker stream made so far
_main_thread_streams: set[int] = set()  # and of every main-thread side stream


def worker_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream for a thread other than the main one (CUDA-only)."""
    stream = torch.cuda.Stream(device, priority=WORKER_PRIORITY)
    _worker_streams.add(stream.cuda_stream)
    return stream


def main_thread_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream only the main thread queues on, never one a worker stream shares (CUDA-only)."""
    stream = torch.cuda.Stream(device, priority=MAIN_PRIORITY)
    if stream.cuda_stream in _worker_streams:  # the pools are per priority: only if CUDA mapped both to one level
        raise RuntimeError("no CUDA stream priority level left for the main thread's streams")
    _main_thread_streams.add(stream.cuda_stream)
    return stream


def stream_role(handle: int) -> str:
    """What a cuda_stream handle is used for (benchmarks' memory by stream): the default stream (the main
    thread's own work), a worker stream (the target pass, layer copies) or a main-thread side stream (the
    draft's, graph captures); "other" for streams made elsewhere."""
    if handle == 0:
        return "default"
    return "worker" if handle in _worker_streams else "main-thread side" if handle in _main_thread_streams else "other"


class PassStreams:
    """Where an overlapped step's work runs (CUDA): the target pass on a stream of its own, the draft's
    extensions on a higher-priority stream beside it, both ordered after what the current (main)
    stream queued before `begin` (the trees, the pass's inputs), and the main stream after both at
    `join`. The draft's host syncs (data-dependent shapes) then wait for the draft's own work only,
    never for the pass. CPU: no streams; the pass's thread and the draft compute side by side.

    Tensors crossing streams: the pass's inputs and the draft's are allocated on the main stream and
    kept alive by the caller until `join` (the main stream then waits for their readers before the
    allocator can hand their blocks out again); what the extensions allocate, their set-up included,
    comes from the draft stream's pool (the set-up runs `on_draft` too, so nothing made on the main
    stream is dropped while the draft stream may still read it); the pass's outputs and the extensions'
    grown trees are marked used by the main stream (`hand_over`). Without that, the allocator may unmap
    a freed block after waiting for its own stream only (expandable segments) while another still reads it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:  # CUDA-only
            self.target = worker_stream(device)
            self.draft = main_thread_stream(device)  # higher priority

    def begin(self) -> None:
        """Order both streams after the work queued so far on the current stream."""
        if self.cuda:  # CUDA-only
            current = torch.cuda.current_stream(self.device)
            self.target.wait_stream(current)
            self.draft.wait_stream(current)

    @contextmanager
    def on_target(self) -> Iterator[None]:
        """The pass's stream (entered in the pass's own thread: the current stream is per thread)."""
        if not self.cuda:
            yield
            return
        torch.cuda.set_device(self.device)  # CUDA-only from here
        with torch.cuda.stream(self.target):
            yield

    @contextmanager
    def on_draft(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.draft):  # CUDA-only
            yield

    def target_done_event(self) -> torch.cuda.Event | None:
        """An event recorded after everything queued on the target stream (call in the pass's thread
        once the pass is queued); None on CPU, where the pass is done when its call returns."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()  # CUDA-only
        event.record(self.target)
        return event

    def join(self) -> None:
        """The current stream waits for the pass and the draft (also after a failure: every later use
        of their tensors is ordered after them)."""
        if self.cuda:  # CUDA-only
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.target)
            current.wait_stream(self.draft)

    def hand_over(self, tensors: list[torch.Tensor]) -> None:
        """Mark tensors made on the target stream as used by the current stream too, so their blocks
        are not reused before the current stream's work on them is done."""
        if self.cuda:  # CUDA-only
            current = torch.cuda.current_stream(self.device)
            for tensor in tensors:
                if tensor.is_cuda:  # a tree grown on the host (--host-trees) has no stream
                    tensor.record_stream(current)


PAGE = 4096  # bytes; direct (O_DIRECT) reads need block-aligned buffers, offsets and lengths
CPU = torch.device("cpu")


def padded_bytes(nbytes: int) -> int:
    """Bytes `empty_buffer(nbytes, ...)` allocates: whole pages, plus one page of alignment slack."""
    return -(-nbytes // PAGE) * PAGE + PAGE


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor of `nbytes`, never pinned: every buffer here comes from this one call."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def empty_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 buffer of `nbytes` whose first byte is PAGE-aligned; every page it touches lies
    inside its own allocation (page-locking it touches no other buffer's pages)."""
    raw = allocate(padded_bytes(nbytes), device)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


def pin_host() -> bool:
    """Whether host buffers are page-locked: with CUDA (asynchronous copies need it); never without."""
    return torch.cuda.is_available()


def register_host(ptr: int, nbytes: int) -> None:
    """Page-lock host memory [ptr, ptr + nbytes) in place for CUDA copies."""
    cudart = torch.cuda.cudart()  # CUDA-only
    torch.cuda.check_error(cudart.cudaHostRegister(ptr, nbytes, 0))  # flags 0: cudaHostRegisterDefault


def unregister_host(ptr: int) -> None:
    """Undo `register_host(ptr, ...)`."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))  # CUDA-only


_pinned: dict[int, weakref.finalize] = {}  # data_ptr of a page-locked buffer -> its unregistration


def _unpin(ptr: int) -> None:
    _pinned.pop(ptr, None)
    unregister_host(ptr)


def empty_host(nbytes: int) -> torch.Tensor:
    """A PAGE-aligned flat uint8 host buffer; with CUDA page-locked in place, exactly its own pages
    (`pin_memory=True` would take a power-of-two block), until `unpin_host(buffer)` or until the
    buffer is freed (memory must never be freed while registered)."""
    view = empty_buffer(nbytes, CPU)
    start = view.storage_offset()
    # a storage of its own that begins at the buffer: is_pinned() asks about a storage's first byte
    buffer = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage()[start : start + nbytes])
    if not pin_host():
        return buffer
    ptr = buffer.data_ptr()  # CUDA-only
    try:
        register_host(ptr, nbytes)
    except RuntimeError as exc:
        raise OffloadError(f"cannot page-lock {nbytes:,} bytes of host memory for CUDA copies: {exc}") from exc
    unpin = weakref.finalize(buffer, _unpin, ptr)
    unpin.atexit = False  # at exit the process's memory goes with it
    _pinned[ptr] = unpin
    return buffer


def unpin_host(buffer: torch.Tensor) -> None:
    """Unregister a buffer from `empty_host` now (idempotent; a no-op for one never page-locked).
    Copies from it must have finished."""
    unpin = _pinned.get(buffer.data_ptr())
    if unpin is not None:
        unpin()


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
            self.streams = [worker_stream(device) for _ in range(num_slots)]
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
