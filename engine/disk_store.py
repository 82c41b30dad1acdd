"""The disk tier: streamed layers read from the checkpoint's safetensors files, never memory-mapped.

Two ways to read a layer:
- span: its tensors lie back to back in one file with the loaded dtype (the usual case: safetensors
  sorts tensors by name, so a layer is contiguous). The layer's layout then mirrors the file, and
  one read of the block-aligned byte span lands every tensor in place. With `evict` that read uses
  O_DIRECT: no page cache, almost no CPU (the kernel's copy out of the page cache costs ~40% of
  the read time on this machine's CPU, which streaming must leave to compute).
- pieces: anything else (dtype conversion, fused MoE experts, a layer split over shards) reads
  tensor by tensor into the packed layout, dropping the pages afterwards with `evict`.
Either way, with `evict`, every pass reads from the device, as if the model were larger than RAM.

Where a loader changes a tensor from its file form (gptqmodel adds one to each zero point of a
GPTQ v1 checkpoint), `fixups` redo that change in place on each read, before the layer is used.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import torch

from engine.device import PAGE, empty_buffer
from engine.layer_store import LayerLayout, TensorEntry, placeholders
from engine.safetensors_index import ReadPiece, plan_pieces, read_index

READ_CHUNK = 64 << 20  # bytes per read call

Fixup = Callable[[torch.Tensor], None]  # in place, on a tensor just read: file form -> loaded form


def span_layout(layout: LayerLayout, pieces: list[list[ReadPiece]]) -> tuple[LayerLayout, int] | None:
    """The layout mirroring the file (offsets relative to a PAGE-aligned start) and that start, if
    each tensor is one same-dtype piece, all in one file, at offsets aligned for their dtype."""
    if any(len(p) != 1 or p[0].src_dtype != p[0].dst_dtype for p in pieces):
        return None
    flat = [p[0] for p in pieces]
    if len({p.path for p in flat}) != 1:
        return None
    start = min(p.file_offset for p in flat) // PAGE * PAGE
    end = max(p.file_offset + p.src_nbytes for p in flat)
    entries = []
    for entry, piece in zip(layout.entries, flat, strict=True):
        offset = piece.file_offset - start
        if offset % entry.dtype.itemsize:
            return None
        entries.append(TensorEntry(entry.name, entry.shape, entry.dtype, offset, entry.nbytes))
    return LayerLayout(tuple(entries), -(-(end - start) // PAGE) * PAGE), start


class DiskStore:
    """Reads streamed layers into any PAGE-aligned host buffer, in `self.layouts[idx]`."""

    source = "disk"

    def __init__(
        self,
        folder: str,
        prefixes: dict[int, str],
        packed: dict[int, LayerLayout],
        evict: bool,
        fixups: dict[int, dict[str, Fixup]] | None = None,
    ):
        index = read_index(folder)
        self.evict = evict
        self.fixups: dict[int, list[tuple[TensorEntry, Fixup]]] = {}
        self.layouts: dict[int, LayerLayout] = {}
        self.plans: dict[int, list[ReadPiece]] = {}  # every layer, in file order (pieces mode reads them)
        self.spans: dict[int, tuple[str, int, int]] = {}  # span mode: (path, start, bytes needed)
        for idx, prefix in prefixes.items():
            layout = packed[idx]
            pieces = [plan_pieces(index, prefix + e.name, e.shape, e.dtype, e.offset) for e in layout.entries]
            self.plans[idx] = sorted((p for ps in pieces for p in ps), key=lambda p: (p.path, p.file_offset))
            mirrored = span_layout(layout, pieces)
            if mirrored is not None:
                layout, start = mirrored
                end = max(p.file_offset + p.src_nbytes for p in self.plans[idx])
                self.spans[idx] = (self.plans[idx][0].path, start, end - start)
            self.layouts[idx] = layout
            entries = {entry.name: entry for entry in layout.entries}
            wanted = (fixups or {}).get(idx, {})
            unknown = sorted(set(wanted) - set(entries))
            if unknown:
                raise ValueError(f"layer {idx}: fixups for tensors it does not have: {', '.join(unknown)}")
            self.fixups[idx] = [(entries[name], fixup) for name, fixup in wanted.items()]
        self.rest = {idx: placeholders(layout) for idx, layout in self.layouts.items()}
        paths = sorted({p.path for plan in self.plans.values() for p in plan})
        self.fds = {path: os.open(path, os.O_RDONLY) for path in paths}
        self.direct_fds = {path: open_direct(path) for path in paths} if evict else {}
        converted = [p.src_nbytes for plan in self.plans.values() for p in plan if p.src_dtype != p.dst_dtype]
        self.staging = torch.empty(max(converted, default=0), dtype=torch.uint8)  # dtype-converting reads
        if evict:
            for fd in self.fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_into(self, idx: int, dst: torch.Tensor) -> None:
        """Fill `dst` (flat uint8 host buffer, PAGE-aligned) with layer idx; raises OSError on failure."""
        self._read(idx, dst)
        for entry, fixup in self.fixups[idx]:
            fixup(dst[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape))

    def _read(self, idx: int, dst: torch.Tensor) -> None:
        if idx in self.spans:
            path, start, needed = self.spans[idx]
            fd = self.direct_fds.get(path)
            total = self.layouts[idx].nbytes
            if fd is not None:
                read_span(fd, path, dst[:total], start, needed)
                return
            read_span(self.fds[path], path, dst[:total], start, needed)
            if self.evict:
                os.posix_fadvise(self.fds[path], start, needed, os.POSIX_FADV_DONTNEED)
            return
        self._read_pieces(idx, dst)

    def _read_pieces(self, idx: int, dst: torch.Tensor) -> None:
        for piece in self.plans[idx]:
            fd = self.fds[piece.path]
            target = dst[piece.dst_offset : piece.dst_offset + piece.dst_nbytes]
            if piece.src_dtype == piece.dst_dtype:
                read_span(fd, piece.path, target, piece.file_offset, piece.src_nbytes)
            else:
                raw = self.staging[: piece.src_nbytes]
                read_span(fd, piece.path, raw, piece.file_offset, piece.src_nbytes)
                target.view(piece.dst_dtype).copy_(raw.view(piece.src_dtype))
            if self.evict:
                os.posix_fadvise(fd, piece.file_offset, piece.src_nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in [*self.fds.values(), *(fd for fd in self.direct_fds.values() if fd is not None)]:
            os.close(fd)
        self.fds, self.direct_fds = {}, {}


def open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor if the platform and filesystem support direct reads, else None."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    probe = empty_buffer(PAGE, torch.device("cpu"))
    try:
        os.preadv(fd, [memoryview(probe.numpy())], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.EINVAL:  # the filesystem refuses direct I/O (tmpfs, some network FS)
            return None
        raise
    return fd


def read_span(fd: int, path: str, dst: torch.Tensor, offset: int, needed: int) -> None:
    """pread into `dst` (flat uint8, contiguous) from `offset`: all of it, or at least `needed`
    bytes if the file ends first (a direct read's block-rounded tail may pass the end of file)."""
    view = memoryview(dst.numpy()).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + READ_CHUNK]], offset + done)
        if got == 0:
            if done >= needed:
                return
            raise OSError(f"{path}: unexpected end of file at byte {offset + done} (wanted {needed} bytes)")
        done += got
