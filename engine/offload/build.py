"""Offloaded target: plan which decoder layers stay resident, store the rest on the host, stream them.

    runner = build_offloaded_runner(model, config, device)  # model loaded on the host

Embeddings, final norm, lm_head and rotary tables move to the device with the resident layers;
the streamed layers go to a RamStore (one contiguous, pinned-with-CUDA host buffer per layer) or a
DiskStore (read from the checkpoint's safetensors files), and flow through a LayerStreamer ring.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import EngineConfig, OffloadConfig
from engine.model import gptq
from engine.model.runner import DecoderRunner
from engine.multimodal import decoder_prefix
from engine.offload.device import empty_buffer, padded_bytes, pin_host
from engine.offload.disk_store import DiskStore
from engine.offload.layout import LayerBinding, LayerLayout, constant_buffers, layer_tensors, layout_of, views
from engine.offload.ram_store import RamStore, anonymous_bytes, host_memory_available
from engine.offload.ring import LayerStreamer
from engine.offload.safetensors_index import read_index
from engine.types import ConfigError, OffloadError

__all__ = ["OffloadError", "build_offloaded_runner", "plan_resident", "host_memory_available"]

GB = 10**9  # --gpu-memory is in GB (10^9 bytes)
SAMPLE = 1024  # elements compared per tensor end when checking the disk layout


def plan_resident(layer_bytes: list[int], cfg: OffloadConfig) -> list[int]:
    """Indices of resident layers, spread evenly so streamed loads overlap resident compute too.

    With gpu_memory, resident layers plus the ring (ring_size buffers of the largest layer, only if
    some layer streams) must fit in gpu_memory GB; resident_layers, if given, is checked against it.
    """
    num_layers = len(layer_bytes)
    largest = max(layer_bytes)
    ring_bytes = cfg.ring_size * largest
    budget = None if cfg.gpu_memory is None else int(cfg.gpu_memory * GB)
    if cfg.resident_layers is not None:
        num_resident = min(cfg.resident_layers, num_layers)
    elif budget is None:
        num_resident = 0
    elif budget >= sum(layer_bytes):
        num_resident = num_layers
    else:
        num_resident = max(0, min(num_layers - 1, (budget - ring_bytes) // largest))
    needed = sum(sorted(layer_bytes, reverse=True)[:num_resident])
    needed += ring_bytes if num_resident < num_layers else 0
    if budget is not None and needed > budget:
        raise ConfigError(
            "offload.gpu_memory",
            f"{cfg.gpu_memory} GB ({budget:,} bytes) cannot hold {num_resident} resident layers plus a ring "
            f"of {cfg.ring_size} x {largest:,} bytes: {needed:,} bytes needed",
        )
    return [(j * num_layers) // num_resident for j in range(num_resident)] if num_resident else []


def check_host_memory(needed: int, reclaimed: int, what: str) -> None:
    """Fail at load, before allocating, if `needed` new host bytes cannot fit.

    `reclaimed`: bytes of anonymous host memory the loaded layers hold and the store frees as it fills
    (memory-mapped weights are page cache, already counted as available)."""
    free = host_memory_available()
    if needed > free + reclaimed:
        raise OffloadError(
            f"not enough host memory for the offloaded target: {what} needs {needed:,} bytes, "
            f"{free + reclaimed:,} available ({free:,} free + {reclaimed:,} freed from the loaded layers)"
        )


def host_bytes_needed(
    layouts: dict[int, LayerLayout], cfg: OffloadConfig, device: torch.device
) -> tuple[int, str]:
    """New host bytes the store and the ring (or its staging) allocate, each buffer padded as
    `empty_buffer` pads it, and a description of them. `layouts`: the store's (a disk store lays
    layers out as its files do)."""
    slot_bytes = padded_bytes(max(layout.nbytes for layout in layouts.values()))
    store = sum(padded_bytes(layout.nbytes) for layout in layouts.values()) if cfg.source == "ram" else 0
    host_ring = cfg.ring_size * slot_bytes if device.type == "cpu" or cfg.source == "disk" else 0
    pinned = " pinned" if pin_host() else ""
    return store + host_ring, f"the{pinned} layer store ({store:,}) and ring/staging buffers ({host_ring:,})"


def move_to_device(model: nn.Module, skip: list[nn.Module], device: torch.device) -> None:
    """Move every parameter and buffer to `device` except the streamed ones of the layers in `skip`
    (their non-persistent constant buffers move: they are not streamed)."""
    for layer in skip:
        for owner_name, name in constant_buffers(layer):
            owner = layer.get_submodule(owner_name)
            owner._buffers[name] = owner._buffers[name].to(device)
    skipped = {id(m) for layer in skip for m in layer.modules()}
    for module in model.modules():
        if id(module) in skipped:
            continue
        for param in module._parameters.values():
            if param is not None:
                param.data = param.data.to(device)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


def build_store(
    config: EngineConfig,
    model: nn.Module,
    streamed: dict[int, nn.Module],
    layouts: dict[int, LayerLayout],
    device: torch.device,
) -> RamStore | DiskStore:
    """The host tier of the streamed layers, built once host memory for it and the ring is known to fit."""
    cfg = config.offload
    held = anonymous_bytes([t for layer in streamed.values() for t in layer_tensors(layer).values()])
    if cfg.source == "ram":
        needed, what = host_bytes_needed(layouts, cfg, device)
        check_host_memory(needed, held, what)
        return RamStore(streamed, layouts)
    try:
        store = open_disk_store(config.model.target, model.config, streamed, layouts, cfg.evict_page_cache)
    except (OSError, ValueError) as exc:
        raise OffloadError(
            f"offload source disk: cannot read layers from {config.model.target!r}: {exc}"
        ) from exc
    try:
        needed, what = host_bytes_needed(store.layouts, cfg, device)
        check_host_memory(needed, held, what)
        check_disk_layout(store, streamed)
    except BaseException:
        store.close()
        raise
    for idx, module in streamed.items():
        LayerBinding(module, store.layouts[idx]).bind(store.rest[idx])  # frees the host copy
    return store


def open_disk_store(
    folder: str, model_config, streamed: dict[int, nn.Module], layouts: dict[int, LayerLayout], evict: bool
) -> DiskStore:
    """The disk tier for decoder layers `streamed` of the checkpoint in `folder` (loaded in `layouts`),
    with the fixups that turn file bytes into the loaded form (quantized checkpoints)."""
    prefix = decoder_prefix(read_index(folder))
    prefixes = {idx: f"{prefix}layers.{idx}." for idx in streamed}
    return DiskStore(folder, prefixes, layouts, evict, gptq.disk_fixups(model_config, streamed))


def check_disk_layout(store: DiskStore, streamed: dict[int, nn.Module]) -> None:
    """Read the first streamed layer from disk and compare samples of each tensor with the loaded weights.

    Only the first and last SAMPLE elements of each loaded tensor are touched: the loaded weights may
    be memory-mapped, and pages touched through a mapping cannot be evicted from the page cache.
    """
    idx = min(streamed)
    layout = store.layouts[idx]
    buffer = empty_buffer(layout.nbytes, torch.device("cpu"))
    store.read_into(idx, buffer)
    loaded = layer_tensors(streamed[idx]).values()
    for entry, read, want in zip(layout.entries, views(buffer, layout), loaded, strict=True):
        read, want = read.reshape(-1), want.reshape(-1)
        if not (torch.equal(read[:SAMPLE], want[:SAMPLE]) and torch.equal(read[-SAMPLE:], want[-SAMPLE:])):
            raise OffloadError(
                f"offload source disk: layer {idx} tensor {entry.name} read from {store.plans[idx][0].path} "
                "differs from the loaded weights (unsupported checkpoint layout); use --offload-source ram"
            )


def build_offloaded_runner(model: nn.Module, config: EngineConfig, device: torch.device) -> DecoderRunner:
    """A DecoderRunner whose non-resident decoder layers stream from host RAM or disk."""
    cfg = config.offload
    layers = list(model.model.layers)
    all_layouts = [layout_of(layer) for layer in layers]
    resident = set(plan_resident([layout.nbytes for layout in all_layouts], cfg))
    streamed = {idx: layer for idx, layer in enumerate(layers) if idx not in resident}
    if not streamed:
        return DecoderRunner(model.to(device))
    layouts = {idx: all_layouts[idx] for idx in streamed}
    store = build_store(config, model, streamed, layouts, device)
    move_to_device(model, list(streamed.values()), device)
    return DecoderRunner(model, LayerStreamer(layers, store, device, cfg.ring_size))
