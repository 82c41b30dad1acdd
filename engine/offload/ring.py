"""The device ring: streamed layers flow through `ring_size` preallocated device buffers.

Loads are numbered k = 0, 1, 2, ... across passes: load k brings streamed layer streamed[k % m]
into slot k % ring_size, and the k-th streamed layer the compute thread asks for is load k. A
background loader thread runs ahead of compute; load k may start once use k - ring_size has
released its slot, so at most ring_size streamed layers are ever materialised on the device, and
after a pass's last streamed layer the loader goes on with the next pass's first layers (the ring
wraps, so they prefetch while the draft works).

CUDA: the loader queues copies on per-slot copy streams, ordered with events (engine.offload.device); with
the disk source it first reads each layer into pinned staging itself (a blocking read).
CPU: the loader thread does the copies (or disk reads) into RAM slots itself, in parallel with compute.
A loader failure is stored and raised in the compute thread at the next layer it needs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from engine.offload.device import CopyStreams, empty_buffer, empty_host, unpin_host
from engine.offload.disk_store import DiskStore
from engine.offload.layout import LayerBinding, LayerLayout, views
from engine.offload.ram_store import RamStore
from engine.types import OffloadError

EventHook = Callable[[str, int, int], None]  # (event, layer idx, slot)


class LayerStreamer:
    """LayerSource over resident layers (already on the device) and streamed ones (from `store`)."""

    def __init__(
        self,
        layers: list[nn.Module],
        store: RamStore | DiskStore,
        device: torch.device,
        ring_size: int,
    ):
        self.num_layers = len(layers)
        self.layers = layers
        self.store = store
        self.layouts: dict[int, LayerLayout] = store.layouts  # the store's bytes land in slots as they are
        self.streamed = sorted(self.layouts)  # layer indices, pass order
        self.ring_size = ring_size
        self.slot_bytes = max(layout.nbytes for layout in self.layouts.values())
        self.ring = [empty_buffer(self.slot_bytes, device) for _ in range(ring_size)]
        # CUDA + disk: reads land in pinned host staging, then copy; on CPU reads land in the slot.
        needs_staging = isinstance(store, DiskStore) and device.type != "cpu"
        self.staging = [empty_host(self.slot_bytes) for _ in range(ring_size)] if needs_staging else None
        self.copier = CopyStreams(device, ring_size)
        self.bindings = {idx: LayerBinding(layers[idx], self.layouts[idx]) for idx in self.streamed}
        self._slot_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.on_event: EventHook | None = None  # instrumentation, called from both threads
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._start()

    # -- bookkeeping shared with the loader thread (guarded by self._cond) --

    def _start(self) -> None:
        self._loaded = 0  # loads complete (CPU) or queued (CUDA)
        self._released = 0  # uses whose slot is free again
        self._used = 0  # uses begun (compute thread only)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run_loader, name="layer-loader", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    def instrument(self, hook: EventHook | None) -> None:
        """Call `hook(event, layer, slot)` on load_start, load_end, compute_start and release, from
        a clean ring (restarted), so the first event is the first load."""
        self._halt()
        self.on_event = hook
        self._start()

    def restart(self) -> None:
        """Stop the loader, forget what the ring holds, prefetch again from the first streamed layer."""
        self._halt()
        self._start()

    def wait_prefetched(self) -> None:
        """Block until the loader has filled the ring (or failed): no read or host copy is in flight;
        on CUDA the last queued device copies may still be running (benchmarks)."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._thread is None
                    or self._error is not None
                    or self._loaded - self._released >= self.ring_size
                )
            )

    def close(self) -> None:
        """Stop the loader and unpin the host memory copies read from, once those copies finished."""
        self._closed = True
        self._halt()
        for slot in range(self.ring_size):
            self.copier.wait_copied(slot)
        self.store.close()
        for buffer in self.staging or []:
            unpin_host(buffer)

    def _emit(self, event: str, idx: int, slot: int) -> None:
        if self.on_event is not None:
            self.on_event(event, idx, slot)

    # -- loader thread --

    def _run_loader(self) -> None:
        load = 0
        num_streamed = len(self.streamed)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda load=load: self._stop or load - self._released < self.ring_size
                    )
                    if self._stop:
                        return
                idx, slot = self.streamed[load % num_streamed], load % self.ring_size
                self._emit("load_start", idx, slot)
                self._load(idx, slot)
                self._emit("load_end", idx, slot)
                load += 1
                with self._cond:
                    self._loaded = load
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the compute thread, raised at its next layer
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _load(self, idx: int, slot: int) -> None:
        nbytes = self.layouts[idx].nbytes
        dst = self.ring[slot][:nbytes]
        try:
            if isinstance(self.store, RamStore):
                self.copier.copy(slot, dst, self.store.buffers[idx])
            elif self.staging is None:
                self.store.read_into(idx, dst)
            else:
                self.copier.wait_copied(slot)  # the staging buffer's previous copy is done
                self.store.read_into(idx, self.staging[slot][:nbytes])
                self.copier.copy(slot, dst, self.staging[slot][:nbytes])
        except Exception as exc:
            raise OffloadError(f"loading target layer {idx} from {self.store.source} failed: {exc}") from exc

    # -- compute thread (LayerSource) --

    def begin_pass(self) -> None:
        """Start from a clean ring after a pass that failed or stopped midway (its error was raised
        then); raise a prefetch error no pass has seen yet (this pass fails, the next one retries)."""
        if self._closed:
            raise OffloadError("the layer streamer is closed")
        with self._cond:
            error, mid_pass = self._error, self._used % len(self.streamed) != 0
        if self._thread is None or mid_pass:
            self.restart()
        elif error is not None:
            self._halt()  # the next begin_pass restarts
            raise OffloadError(f"prefetching target layers failed: {error}") from error

    @contextmanager
    def layer(self, idx: int) -> Iterator[nn.Module]:
        if idx not in self.bindings:
            yield self.layers[idx]
            return
        use = self._used
        expected = self.streamed[use % len(self.streamed)]
        if idx != expected:
            raise OffloadError(f"streamed layers must be used in pass order: expected {expected}, got {idx}")
        slot = use % self.ring_size
        self._used = use + 1
        self._wait_loaded(use, idx)
        self.copier.wait_ready(slot)
        binding = self.bindings[idx]
        binding.bind(self._views(slot, idx))
        self._emit("compute_start", idx, slot)
        try:
            yield binding.module
        finally:
            binding.bind(self.store.rest[idx])
            self.copier.release(slot)
            self._emit("release", idx, slot)
            with self._cond:
                self._released = use + 1
                self._cond.notify_all()

    def _wait_loaded(self, use: int, idx: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._loaded > use or self._error is not None or self._stop)
            if self._stop:
                raise OffloadError("the layer loader is stopped (closed, or a pass failed: call begin_pass)")
            error = self._error if self._loaded <= use else None
        if error is not None:
            self._halt()  # this pass fails; the next begin_pass restarts from a clean ring
            raise OffloadError(f"target layer {idx} is unavailable: {error}") from error

    def _views(self, slot: int, idx: int) -> list[torch.Tensor]:
        key = (slot, idx)
        if key not in self._slot_views:
            self._slot_views[key] = views(self.ring[slot], self.layouts[idx])
        return self._slot_views[key]
