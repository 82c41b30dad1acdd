"""The disk tier: streamed layers read from the checkpoint's safetensors files, never memory-mapped.

Two ways to read a layer:
- spans: every tensor is one piece with the loaded dtype. Tensors lying back to back in a file form
  a run (safetensors sorts tensors by dtype, then name: a single-dtype layer is one run, a GPTQ
  layer one run per dtype). The layer's layout then mirrors the file run by run, and one read of
  each run's block-aligned byte span lands its tensors in place. With `evict` those reads use
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
from dataclasses import dataclass

import torch

from engine.offload.device import PAGE, empty_buffer
from engine.offload.layout import LayerLayout, TensorEntry, placeholders, view_of
from engine.offload.safetensors_index import ReadPiece, plan_pieces, read_index

READ_CHUNK = 64 << 20  # bytes per read call

Fixup = Callable[[torch.Tensor], None]  # in place, on a tensor just read: file form -> loaded form


@dataclass(frozen=True)
class SpanRead:
    """One read of a run of back-to-back tensors: file bytes [file_start, file_start + nbytes) land at
    dst_offset of the layer buffer; the file may end after `needed` of them (block-rounded tail)."""

    path: str
    file_start: int  # PAGE-aligned
    needed: int
    dst_offset: int  # PAGE-aligned
    nbytes: int  # a multiple of PAGE


def span_layout(layout: LayerLayout, pieces: list[list[ReadPiece]]) -> tuple[LayerLayout, list[SpanRead]] | None:
    """The layout mirroring the file run by run, and the reads that fill it, if each tensor is one
    same-dtype piece at an offset aligned for its dtype. A run: tensors of one file whose gaps are under
    a PAGE, so a read never carries more than a page of bytes the layer does not use."""
    if any(len(p) != 1 or p[0].src_dtype != p[0].dst_dtype for p in pieces):
        return None
    flat = [p[0] for p in pieces]
    runs: list[list[int]] = []
    for i in sorted(range(len(flat)), key=lambda i: (flat[i].path, flat[i].file_offset)):
        prev = flat[runs[-1][-1]] if runs else None
        if prev is not None and prev.path == flat[i].path and flat[i].file_offset - prev.file_offset - prev.src_nbytes < PAGE:
            runs[-1].append(i)
        else:
            runs.append([i])
    offsets, reads, dst = [0] * len(flat), [], 0
    for run in runs:
        start = flat[run[0]].file_offset // PAGE * PAGE
        end = max(flat[i].file_offset + flat[i].src_nbytes for i in run)
        for i in run:
            offsets[i] = dst + flat[i].file_offset - start
            if offsets[i] % layout.entries[i].dtype.itemsize:
                return None
        nbytes = -(-(end - start) // PAGE) * PAGE
        reads.append(SpanRead(flat[run[0]].path, start, end - start, dst, nbytes))
        dst += nbytes
    entries = tuple(
        TensorEntry(e.name, e.shape, e.dtype, offset, e.nbytes) for e, offset in zip(layout.entries, offsets, strict=True)
    )
    return LayerLayout(entries, dst), reads


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
        self.spans: dict[int, list[SpanRead]] = {}  # span mode: the layer's reads
        for idx, prefix in prefixes.items():
            layout = packed[idx]
            pieces = [plan_pieces(index, prefix + e.name, e.shape, e.dtype, e.offset) for e in layout.entries]
            self.plans[idx] = sorted((p for ps in pieces for p in ps), key=lambda p: (p.path, p.file_offset))
            mirrored = span_layout(layout, pieces)
            if mirrored is not None:
                layout, self.spans[idx] = mirrored
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
        # dtype-converting reads go through this, READ_CHUNK bytes at a time
        self.staging = torch.empty(min(max(converted, default=0), READ_CHUNK), dtype=torch.uint8)
        if evict:
            for fd in self.fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_into(self, idx: int, dst: torch.Tensor) -> None:
        """Fill `dst` (flat uint8 host buffer, PAGE-aligned) with layer idx; raises OSError on failure."""
        self._read(idx, dst)
        for entry, fixup in self.fixups[idx]:
            fixup(view_of(dst, entry))

    def _read(self, idx: int, dst: torch.Tensor) -> None:
        if idx not in self.spans:
            self._read_pieces(idx, dst)
            return
        for span in self.spans[idx]:
            direct = self.direct_fds.get(span.path)
            fd = self.fds[span.path] if direct is None else direct
            read_span(fd, span.path, dst[span.dst_offset : span.dst_offset + span.nbytes], span.file_start, span.needed)
            if direct is None and self.evict:
                os.posix_fadvise(fd, span.file_start, span.needed, os.POSIX_FADV_DONTNEED)

    def _read_pieces(self, idx: int, dst: torch.Tensor) -> None:
        for piece in self.plans[idx]:
            read_piece(self.fds[piece.path], piece, dst, self.staging, self.evict)

    def close(self) -> None:
        for fd in [*self.fds.values(), *(fd for fd in self.direct_fds.values() if fd is not None)]:
            os.close(fd)
        self.fds, self.direct_fds = {}, {}


def read_piece(fd: int, piece: ReadPiece, dst: torch.Tensor, staging: torch.Tensor, evict: bool) -> None:
    """Read `piece` into `dst` (flat uint8, any device) at piece.dst_offset, converting its dtype.

    Straight into `dst` when it is host memory and no conversion is needed; otherwise through
    `staging` (flat uint8 host memory, any size >= the piece's source element), one chunk at a time."""
    target = dst[piece.dst_offset : piece.dst_offset + piece.dst_nbytes]
    if piece.src_dtype == piece.dst_dtype and dst.device.type == "cpu":
        read_span(fd, piece.path, target, piece.file_offset, piece.src_nbytes)
    else:
        src_size, dst_size = piece.src_dtype.itemsize, piece.dst_dtype.itemsize
        chunk = staging.numel() // src_size * src_size  # whole source elements per read
        assert chunk > 0, "staging must hold one element"
        for begin in range(0, piece.src_nbytes, chunk):
            end = min(begin + chunk, piece.src_nbytes)
            raw = staging[: end - begin]
            read_span(fd, piece.path, raw, piece.file_offset + begin, end - begin)
            out = target[begin // src_size * dst_size : end // src_size * dst_size]
            out.view(piece.dst_dtype).copy_(raw.view(piece.src_dtype))
    if evict:
        os.posix_fadvise(fd, piece.file_offset, piece.src_nbytes, os.POSIX_FADV_DONTNEED)


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
