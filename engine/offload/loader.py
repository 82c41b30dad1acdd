"""Streaming load of a plain (unquantized) offloaded target, tensor by tensor, from its safetensors files.

    model, runner = load_offloaded_target(config, dtype, device)

The model is built on the `meta` device (shapes and dtypes, no memory). Each tensor is then read
with pread (never memory-mapped) straight where it will live: the embeddings', head's, norms' and
resident layers' tensors into device tensors (through a READ_CHUNK host staging buffer when they
convert or live off the host), a streamed layer's into its RamStore buffer (RAM source) or nowhere
(disk source: the DiskStore reads it on every pass). So host memory grows only by the store, the
ring and one chunk: `from_pretrained`'s transient copy of the whole model never exists (95% of a
Mixtral checkpoint, all of a bf16 checkpoint loaded as fp16, before this; docs/bench/load.md).

Reads follow the disk tier's plan (safetensors_index.plan_pieces): Mixtral's per-expert tensors
fused, dtype conversion, sharded files; GPT-OSS's MXFP4-packed experts are dequantized as they are
read (engine.model.mxfp4). Rotary tables are rebuilt (they are in no checkpoint); a
model with any other tensor that is in no checkpoint is refused. GPTQ checkpoints load through
transformers (engine.model.gptq); drafts and resident targets too.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

from engine.config import EngineConfig
from engine.model import mxfp4
from engine.multimodal import checkpoint_names, decoder_prefix, hf_config
from engine.offload.build import open_disk_store, plan_resident
from engine.offload.disk_store import READ_CHUNK, DiskStore, read_piece
from engine.offload.layout import LayerBinding, LayerLayout, constant_buffers, layout_of, placeholders
from engine.offload.ram_store import RamStore
from engine.offload.ring import LayerStreamer
from engine.offload.safetensors_index import plan_pieces, read_index
from engine.types import CheckpointError

ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")  # rebuilt, not read


class CheckpointReader:
    """Reads named tensors of a checkpoint folder into given tensors (any device), converting dtypes."""

    def __init__(self, folder: str, evict: bool, device: torch.device | None = None):
        self.folder = folder
        self.device = device  # where MXFP4 experts are dequantized (None: where each lands)
        self.index = read_index(folder)
        self.evict = evict  # drop the pages read from the page cache
        self.fds: dict[str, int] = {}
        self.staging = torch.empty(READ_CHUNK, dtype=torch.uint8)

    def read(self, names: list[str], dst: torch.Tensor, flat: torch.Tensor | None = None, offset: int = 0) -> None:
        """Fill `dst` from the first of `names` the checkpoint has (or, with `flat` and `offset`, the
        bytes of `flat` (flat uint8) from `offset` on, which `dst` only describes)."""
        for name in names:
            packed = mxfp4.packed_names(self.index, name)
            if packed is not None:  # GPT-OSS's MXFP4 experts: dequantized where they land
                if flat is not None:  # dst only describes the tensor at `offset` of `flat`
                    dst = flat[offset : offset + dst.numel() * dst.element_size()].view(dst.dtype).view(dst.shape)
                try:
                    mxfp4.read_dequantized(self._fd, *(self.index[n] for n in packed), dst, self.evict, self.device)
                except ValueError as exc:
                    raise CheckpointError(f"{self.folder}: {name}: {exc}") from exc
                return
            try:
                pieces = plan_pieces(self.index, name, tuple(dst.shape), dst.dtype, offset)
            except ValueError as exc:
                if str(exc).startswith("no checkpoint tensor"):
                    continue
                raise CheckpointError(f"{self.folder}: {exc}") from exc
            target = dst.reshape(-1).view(torch.uint8) if flat is None else flat
            for piece in pieces:
                read_piece(self._fd(piece.path), piece, target, self.staging, self.evict)
            return
        raise CheckpointError(f"{self.folder}: no checkpoint tensor for {' or '.join(names)}")

    def read_layer(self, prefix: str, layout: LayerLayout, buffer: torch.Tensor) -> None:
        """Fill `buffer` (flat uint8 host memory) with the tensors of `layout` named `prefix` + name."""
        for entry in layout.entries:
            shape_only = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
            self.read([prefix + entry.name], shape_only, buffer, entry.offset)

    def _fd(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def meta_model(folder: str, dtype: torch.dtype) -> nn.Module:
    """The checkpoint's model with every tensor on the `meta` device (config.json, generation config)."""
    config = hf_config(folder)  # a multimodal checkpoint: its text model's
    if getattr(config, "quantization_config", None) is not None:  # MXFP4 experts: dequantized as they are read
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval().requires_grad_(False)


def materialize(model: nn.Module, skip: list[nn.Module], reader: CheckpointReader, device: torch.device) -> None:
    """Read every parameter and persistent buffer of `model` outside the modules `skip` onto `device`
    (a tensor shared by several modules, tied embeddings, is read once, from the first name found)."""
    skipped = {id(m) for layer in skip for m in layer.modules()}
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if id(module) in skipped:
            continue
        tensors = {**module._parameters, **{k: v for k, v in module._buffers.items()
                                             if k not in module._non_persistent_buffers_set}}
        for leaf, tensor in tensors.items():
            if tensor is not None:
                owners.setdefault(id(tensor), []).append((f"{module_name}.{leaf}", module, leaf))
    for entries in owners.values():
        _, first_module, first_leaf = entries[0]
        meta = getattr(first_module, first_leaf)
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        reader.read([alias for name, _, _ in entries for alias in checkpoint_names(name)], tensor)
        is_param = first_leaf in first_module._parameters
        value = nn.Parameter(tensor, requires_grad=False) if is_param else tensor
        for _, module, leaf in entries:
            (module._parameters if is_param else module._buffers)[leaf] = value


def rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Rotary tables are computed at construction (non-persistent buffers): build them for real."""
    base = model.model
    base.rotary_emb = type(base.rotary_emb)(config=model.config).to(device)


def rebuild_constants(model: nn.Module, skip: list[nn.Module], device: torch.device) -> None:
    """Non-persistent buffers outside the streamed layers other than rotary tables (Gemma 3's embedding
    scale) are in no checkpoint: allocate them on `device` and let the model's own `_init_weights` fill
    them, as transformers' from_pretrained does after its meta-device load. Every tensor already read is
    flagged `_is_hf_initialized` first, so transformers' init functions leave it as read (5.17-5.24)."""
    skipped = {id(m) for layer in skip for m in layer.modules()}
    owners, fresh = [], set()
    for module in model.modules():
        if id(module) in skipped:
            continue
        for name in module._non_persistent_buffers_set:
            if module._buffers.get(name) is not None and module._buffers[name].is_meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
                fresh.add(id(module._buffers[name]))
                owners.append(module)
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in fresh:
            tensor._is_hf_initialized = True
    for module in dict.fromkeys(owners):  # each once, in order
        model._init_weights(module)


def check_no_meta(model: nn.Module, skip: list[nn.Module]) -> None:
    """Raise CheckpointError if a tensor outside `skip` is still on the meta device (one no checkpoint holds)."""
    skipped = {id(m) for layer in skip for m in layer.modules()}
    left = [f"{name}.{leaf}" for name, module in model.named_modules() if id(module) not in skipped
            for leaf, tensor in [*module._parameters.items(), *module._buffers.items()]
            if tensor is not None and tensor.is_meta]
    left += [f"decoder layer buffer {owner}.{leaf}" for layer in skip for owner, leaf in constant_buffers(layer)]
    if left:
        raise CheckpointError(f"cannot stream this model's weights: {', '.join(left[:5])} are in no checkpoint file "
                              "(use a resident target, or report the architecture)")


def load_offloaded_target(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, LayerStreamer | None]:
    """The target with its resident part on `device` and its streamed layers in a RAM or disk store,
    read tensor by tensor (module doc). Returns the model and its layer streamer (None: every layer
    is resident)."""
    cfg, folder = config.offload, config.model.target
    model = meta_model(folder, dtype)
    layers = list(model.model.layers)
    layouts = [layout_of(layer) for layer in layers]  # from meta tensors: shapes and dtypes only
    resident = set(plan_resident([layout.nbytes for layout in layouts], cfg))
    streamed = {idx: layer for idx, layer in enumerate(layers) if idx not in resident}
    try:
        reader = CheckpointReader(folder, cfg.evict_page_cache, device)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: cannot read the checkpoint's safetensors files: {exc}") from exc
    try:
        materialize(model, list(streamed.values()), reader, device)
        rebuild_rotary(model, device)
        rebuild_constants(model, list(streamed.values()), device)
        check_no_meta(model, list(streamed.values()))
        if not streamed:
            return model, None
        store_layouts = {idx: layouts[idx] for idx in streamed}
        store = streamed_store(config, model, streamed, store_layouts, reader)
    finally:
        reader.close()
    return model, LayerStreamer(layers, store, device, cfg.ring_size)


def leave_meta(module: nn.Module, layout: LayerLayout) -> None:
    """Point a streamed layer's meta tensors at host placeholders (a meta parameter cannot be rebound
    to real memory through `.data`, which is how the store and the ring bind layers)."""
    for entry, placeholder in zip(layout.entries, placeholders(layout), strict=True):
        owner_name, _, leaf = entry.name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(placeholder, requires_grad=False)
        else:
            owner._buffers[leaf] = placeholder


def streamed_store(
    config: EngineConfig,
    model: nn.Module,
    streamed: dict[int, nn.Module],
    layouts: dict[int, LayerLayout],
    reader: CheckpointReader,
) -> RamStore | DiskStore:
    """RAM: each streamed layer read into its store buffer. Disk: the layers bound to placeholders."""
    for idx, module in streamed.items():
        leave_meta(module, layouts[idx])
    if config.offload.source == "ram":
        prefix = decoder_prefix(reader.index)
        return RamStore(streamed, layouts, fill=lambda idx, buffer: reader.read_layer(
            f"{prefix}layers.{idx}.", layouts[idx], buffer))
    try:
        store = open_disk_store(config.model.target, model.config, streamed, layouts, config.offload.evict_page_cache)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"offload source disk: cannot read layers from {config.model.target!r}: {exc}") from exc
    for idx, module in streamed.items():
        LayerBinding(module, store.layouts[idx]).bind(store.rest[idx])
    return store
