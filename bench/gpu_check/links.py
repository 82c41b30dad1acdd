"""The links a streamed layer crosses: one layer's plain host->device copy, and the disk source's reads."""

from __future__ import annotations

import torch

from bench.gpu_check.build import meta_model, target_config
from bench.gpu_check.context import CheckContext
from bench.gpu_check.probes import GB, seconds_of
from bench.offload import plain_copy_seconds
from engine.offload.build import open_disk_store
from engine.offload.device import empty_buffer, empty_host
from engine.offload.layout import layout_of

DISK_SLOW_S = 10.0  # a read round this long is not repeated (a slow disk must not eat the time budget)


def best_copy_seconds(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Fastest of `reps` plain copies src -> dst (asynchronous when src is pinned), device work included."""
    return min(seconds_of(dst.device, lambda: dst.copy_(src, non_blocking=True)) for _ in range(reps))


def copy_section(ctx: CheckContext) -> None:
    """Bandwidth of one target layer's plain copy from the RAM store's kind of host buffer (page-locked
    with CUDA) and, for contrast, from pageable host memory."""
    nbytes, device, report = ctx.built().layer_bytes, ctx.device, ctx.report
    report.table("copy (one layer, no compute)", "bytes", "source pinned", "best of", "ms", "GB/s")
    dst = empty_buffer(nbytes, device)
    for label, src in (("store buffer -> device", empty_host(nbytes)), ("pageable host -> device", None)):
        if src is None:
            src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        seconds = best_copy_seconds(dst, src, ctx.plan.copy_reps)
        if "copy_bytes_per_s" not in ctx.facts:
            ctx.facts["copy_bytes_per_s"] = nbytes / seconds
        report.row(
            label,
            f"{nbytes:,}",
            src.is_pinned(),
            ctx.plan.copy_reps,
            f"{seconds * 1e3:.1f}",
            f"{nbytes / seconds / GB:.2f}",
        )
        del src


def disk_section(ctx: CheckContext) -> None:
    """Read the first target decoder layers through the disk source as streaming reads them: O_DIRECT
    where the filesystem allows it, else page-cache reads dropped with posix_fadvise(DONTNEED)."""
    checkpoints, plan, report = ctx.built(), ctx.plan, ctx.report
    model = meta_model(target_config(plan), ctx.dtype)  # shapes only: the store reads the file itself
    streamed = dict(enumerate(model.model.layers[: plan.disk_layers]))
    packed = {idx: layout_of(layer) for idx, layer in streamed.items()}
    store = open_disk_store(str(checkpoints.target), model.config, streamed, packed, evict=True)
    try:
        direct = bool(store.direct_fds) and all(fd is not None for fd in store.direct_fds.values())
        whole_spans = len(store.spans) == len(streamed)
        nbytes = sum(layout.nbytes for layout in store.layouts.values())
        host = empty_host(max(layout.nbytes for layout in store.layouts.values()))
        rounds = [plain_copy_seconds(store, host)]
        while len(rounds) < plan.disk_rounds and rounds[-1] < DISK_SLOW_S:
            rounds.append(plain_copy_seconds(store, host))
    finally:
        store.close()
    report.table("disk source read", "layers", "bytes", "reads", "best of", "s", "GB/s")
    reads = ("O_DIRECT" if direct else "page cache + fadvise(DONTNEED)") + (
        ", span" if whole_spans else ", per tensor"
    )
    seconds = min(rounds)
    report.row(
        "decoder layers, pages evicted",
        len(streamed),
        f"{nbytes:,}",
        reads,
        len(rounds),
        f"{seconds:.2f}",
        f"{nbytes / seconds / GB:.2f}",
    )
