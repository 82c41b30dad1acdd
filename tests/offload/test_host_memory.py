"""Host memory of the offloaded target: the load-time check counts exactly what the store and the ring
(or its staging) allocate, alignment slack included; with CUDA every host buffer copies read from is
page-locked in place, once, at its exact size, and unpinned on close or when freed. No real CUDA call:
the CUDA flag and the registration calls are faked; the `meta` device stands in for an accelerator
(device ring off the host, so disk reads go through host staging)."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, OffloadConfig
from engine.model import checkpoint
from engine.offload import build as offload_build
from engine.offload import device as offload_device
from engine.offload.build import build_store, host_bytes_needed
from engine.offload.device import PAGE, empty_host, unpin_host
from engine.offload.layout import LayerLayout, layer_tensors, layout_of
from engine.offload.ram_store import RamStore, anonymous_bytes
from engine.offload.ring import LayerStreamer
from engine.types import OffloadError
from tests.helpers.offload_passes import CPU
from tests.helpers.tiny_models import make_tiny_pair

META = torch.device("meta")
RESIDENT = {0}  # layer 0 stays on the device; 1, 2, 3 stream


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("host_memory")
    # hidden 72: layer sizes are not multiples of PAGE, so the padding shows
    path, _ = make_tiny_pair(folder, arch="llama", seed=5, layers=4, hidden=72)
    return str(path)


class Recorder:
    """Every allocation through engine.offload.device.allocate, and the bytes each check was asked for."""

    def __init__(self, monkeypatch):
        self.allocations: list[torch.Tensor] = []  # raw tensors, kept alive so their ranges stay ours
        self.checked: list[int] = []
        real_allocate, real_check = offload_device.allocate, offload_build.check_host_memory

        def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
            raw = real_allocate(nbytes, device)
            self.allocations.append(raw)
            return raw

        def check(needed: int, reclaimed: int, what: str) -> None:
            self.checked.append(needed)
            real_check(needed, reclaimed, what)

        monkeypatch.setattr(offload_device, "allocate", allocate)
        monkeypatch.setattr(offload_build, "check_host_memory", check)

    def allocated_for(self, buffers: list[torch.Tensor]) -> int:
        """Bytes of the host allocations that hold `buffers` (each buffer in exactly one)."""
        total = 0
        for buffer in buffers:
            owners = [
                raw
                for raw in self.allocations
                if raw.device.type == "cpu"
                and raw.data_ptr() <= buffer.data_ptr() < raw.data_ptr() + raw.numel()
            ]
            assert len(owners) == 1
            assert buffer.data_ptr() + buffer.numel() <= owners[0].data_ptr() + owners[0].numel()
            total += owners[0].numel()
        return total


class FakeCuda:
    """`pin_host()` is True and the CUDA registration calls are recorded instead of made."""

    def __init__(self, monkeypatch):
        self.registered: list[tuple[int, int]] = []  # (ptr, nbytes)
        self.unregistered: list[int] = []
        monkeypatch.setattr(offload_device, "pin_host", lambda: True)
        monkeypatch.setattr(offload_device, "register_host", lambda ptr, n: self.registered.append((ptr, n)))
        monkeypatch.setattr(offload_device, "unregister_host", self.unregistered.append)


def streamer(target: str, source: str, device: torch.device, ring_size: int = 2) -> LayerStreamer:
    cfg = EngineConfig(
        model=ModelConfig(target=target),
        offload=OffloadConfig(enabled=True, source=source, ring_size=ring_size),
    )
    model = checkpoint.load_model(target, torch.float32)
    layers = list(model.model.layers)
    streamed = {idx: layer for idx, layer in enumerate(layers) if idx not in RESIDENT}
    store = build_store(
        cfg, model, streamed, {idx: layout_of(layer) for idx, layer in streamed.items()}, device
    )
    return LayerStreamer(layers, store, device, ring_size)


def host_buffers(ring: LayerStreamer) -> list[torch.Tensor]:
    """The host buffers the store and ring keep: layer store, host ring slots, staging."""
    store = list(ring.store.buffers.values()) if isinstance(ring.store, RamStore) else []
    slots = ring.ring if ring.ring[0].device.type == "cpu" else []
    return store + slots + (ring.staging or [])


@pytest.mark.parametrize("device", [CPU, META])
@pytest.mark.parametrize(("source", "ring_size"), [("ram", 2), ("disk", 3)])
def test_checked_bytes_equal_what_the_store_and_ring_allocate(target, monkeypatch, source, ring_size, device):
    recorder = Recorder(monkeypatch)
    ring = streamer(target, source, device, ring_size)
    try:
        owned = host_buffers(ring)
        assert owned and all(buffer.data_ptr() % PAGE == 0 for buffer in owned)
        assert recorder.checked == [recorder.allocated_for(owned)]
        assert recorder.allocated_for(owned) > sum(buffer.numel() for buffer in owned)  # the slack counts
    finally:
        ring.close()


@pytest.mark.parametrize(("source", "device"), [("ram", CPU), ("ram", META), ("disk", META), ("disk", CPU)])
def test_with_cuda_each_copy_source_is_registered_once_at_its_size_and_unregistered_on_close(
    target, monkeypatch, source, device
):
    cuda = FakeCuda(monkeypatch)
    ring = streamer(target, source, device)
    pinned = (
        list(ring.store.buffers.values()) if isinstance(ring.store, RamStore) else list(ring.staging or [])
    )
    assert (len(pinned) > 0) == (source == "ram" or device != CPU)  # CPU + disk: reads land in the ring
    assert sorted(cuda.registered) == sorted((b.data_ptr(), b.numel()) for b in pinned)
    # is_pinned() asks CUDA about a tensor's storage's first byte: the registered range starts there
    assert all(b.untyped_storage().data_ptr() == b.data_ptr() and b.data_ptr() % PAGE == 0 for b in pinned)
    ring.wait_prefetched()
    assert cuda.unregistered == []
    ring.close()
    assert sorted(cuda.unregistered) == sorted(ptr for ptr, _ in cuda.registered)
    ring.close()
    assert len(cuda.unregistered) == len(cuda.registered)  # once


def test_without_cuda_nothing_is_registered(target, monkeypatch):
    monkeypatch.setattr(offload_device, "pin_host", lambda: False)
    calls = []
    monkeypatch.setattr(offload_device, "register_host", lambda ptr, n: calls.append(ptr))
    monkeypatch.setattr(offload_device, "unregister_host", calls.append)
    ring = streamer(target, "ram", CPU)
    assert all(not buffer.is_pinned() for buffer in ring.store.buffers.values())
    ring.close()
    assert calls == []


def test_a_freed_host_buffer_is_unregistered_first(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    buffer = empty_host(3 * PAGE + 5)
    ptr = buffer.data_ptr()
    assert cuda.registered == [(ptr, 3 * PAGE + 5)]
    del buffer
    gc.collect()
    assert cuda.unregistered == [ptr]
    kept = empty_host(PAGE)
    unpin_host(kept)
    unpin_host(kept)
    assert cuda.unregistered == [ptr, kept.data_ptr()]
    del kept
    gc.collect()
    assert len(cuda.unregistered) == 2


def test_a_failed_registration_fails_the_load_clearly(target, monkeypatch):
    FakeCuda(monkeypatch)

    def refuse(ptr: int, nbytes: int) -> None:
        raise RuntimeError("out of memory (2)")

    monkeypatch.setattr(offload_device, "register_host", refuse)
    with pytest.raises(OffloadError, match=r"target layer 1 .*cannot page-lock [\d,]+ bytes .*out of memory"):
        streamer(target, "ram", CPU)


def ram_needs(target: str) -> tuple[int, int]:
    """(bytes the ram source's check asks for, bytes the loaded streamed layers hold)."""
    model = checkpoint.load_model(target, torch.float32)
    streamed = [layer for idx, layer in enumerate(model.model.layers) if idx not in RESIDENT]
    layouts: dict[int, LayerLayout] = {idx: layout_of(layer) for idx, layer in enumerate(streamed)}
    needed, _ = host_bytes_needed(layouts, OffloadConfig(enabled=True, source="ram"), CPU)
    held = anonymous_bytes([t for layer in streamed for t in layer_tensors(layer).values()])
    return needed, held


def test_the_check_refuses_one_byte_short_of_the_padded_size(target, monkeypatch):
    needed, held = ram_needs(target)
    monkeypatch.setattr(offload_build, "host_memory_available", lambda: needed - held - 1)
    with pytest.raises(OffloadError, match=rf"needs {needed:,} bytes, {needed - 1:,} available"):
        streamer(target, "ram", CPU)
    monkeypatch.setattr(offload_build, "host_memory_available", lambda: needed - held)
    streamer(target, "ram", CPU).close()
