"""The draft's tree forward alone (issue 38's levers): a Llama-3.2-1B-shaped draft's forward over tree
segments, as a growth round makes it (each segment `rows` nodes after a committed prefix, an explicit
ancestor mask, positions prefix + depth: bench.small_pass's tree_segment), for 1 and 4 segments (one stream,
four), eager, replayed as CUDA graphs (engine.model.draft_graphs: the static pass, uncaptured on a CPU) and with
the layers compiled (DecoderRunner.compile_layers).

Per row: the host's time until the forward returns (its kernels queued), the wall time to its end
(synchronized after each forward, as a growth's next selection is), the device's time between CUDA events
around it, and the aten ops one forward dispatches. host ~ wall >> device: the forward is bound by launching
its kernels (the full-shape run's 11-21 ms a draft forward), which one graph launch, fewer, fused kernels
(compiled layers) or fewer segments' worth of attention calls would cut."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.gpu_check.context import CheckContext
from bench.gpu_check.fullshape_build import DRAFT_LOGIT_STD, build_draft
from bench.ops import OpCounter
from bench.small_pass import CACHE_SLOTS, tree_segment
from engine.model.draft_graphs import DraftGraphs
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner, Segment
from engine.offload.device import synchronize

PREFIX_LEN = 256  # committed slots before each tree
WARMUP = 3  # forwards before the timed ones (the compiled forward compiles in these)
TIMED = 20
SEGMENTS = (1, 4)
ROWS = (16, 64)  # nodes a segment expands in one forward (a growth's K at budget 256: 16-64)


VARIANTS = ("eager", "graphs", "graphs per segment", "compiled", "compiled graphs")


@dataclass(frozen=True)
class DraftPassRow:
    variant: str  # one of VARIANTS
    segments: int
    rows: int
    host_ms: float  # median, until forward_groups returned
    wall_ms: float  # median, until the device finished it
    device_ms: float  # median, CUDA events (wall on the CPU)
    aten_ops: int  # one forward's dispatched aten ops (eager, and graphs: outside the replay); 0 when not counted
    held_mb: float | None  # CUDA: device memory the caching allocator reserved while this shape first ran
    # (its graph's pool and buffers, or eager workspaces); None on a CPU
    peak_mb: float | None  # CUDA: allocation peak over the timed forwards, above what was allocated before


def draft_heads(ctx: CheckContext, seed: int) -> dict[str, torch.Tensor]:
    """The draft's embedding and head, drawn as fullshape_build's aligned pair draws them (no target's)."""
    full, device = ctx.plan.full, ctx.device
    generator = torch.Generator(device).manual_seed(seed)
    embed = torch.randn(full.vocab_size, full.draft_hidden, device=device, generator=generator)
    head = torch.randn(full.vocab_size, full.draft_hidden, device=device, generator=generator)
    return {"draft_embed": embed.to(ctx.dtype), "draft_head": (head * (DRAFT_LOGIT_STD / full.draft_hidden ** 0.5)).to(ctx.dtype)}


def time_forwards(runner: DecoderRunner, groups: list[list[Segment]], device: torch.device) -> tuple[float, float, float]:
    """Median (host, wall, device) ms of TIMED forwards, each synchronized before the next."""
    host, wall, on_device = [], [], []
    for _ in range(TIMED):
        synchronize(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
        if events:
            events[0].record()
        begin = time.perf_counter()
        runner.forward_groups(groups)
        queued = time.perf_counter()
        if events:
            events[1].record()
        synchronize(device)
        end = time.perf_counter()
        host.append((queued - begin) * 1e3)
        wall.append((end - begin) * 1e3)
        on_device.append(events[0].elapsed_time(events[1]) if events else (end - begin) * 1e3)
    return statistics.median(host), statistics.median(wall), statistics.median(on_device)


def measure(ctx: CheckContext, runner: DecoderRunner, caches: list[KVCache], variant: str) -> list[DraftPassRow]:
    rows_out = []
    for segments in SEGMENTS:
        for rows in ROWS:
            groups = [[tree_segment(runner, caches[i], rows, 7 * rows + i, PREFIX_LEN) for i in range(segments)]]
            cuda = ctx.device.type == "cuda"
            reserved = torch.cuda.memory_reserved(ctx.device) if cuda else 0
            for _ in range(WARMUP):
                runner.forward_groups(groups)
            ops = 0
            if variant in ("eager", "graphs", "graphs per segment"):  # a replay dispatches no aten op: these run outside
                with OpCounter() as counter:
                    runner.forward_groups(groups)
                ops = counter.count
            held = peak = None
            if cuda:  # CUDA-only: memory the shape took
                synchronize(ctx.device)
                held = (torch.cuda.memory_reserved(ctx.device) - reserved) / 2**20
                allocated = torch.cuda.memory_allocated(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
            host, wall, device = time_forwards(runner, groups, ctx.device)
            if cuda:  # CUDA-only
                peak = (torch.cuda.max_memory_allocated(ctx.device) - allocated) / 2**20
            rows_out.append(DraftPassRow(variant, segments, rows, host, wall, device, ops, held, peak))
    return rows_out


TOP_KERNELS = 8  # rows of the profiled replay's table


def top_kernels(ctx: CheckContext, runner: DecoderRunner, groups: list[list[Segment]]) -> list[tuple[str, int, float]]:
    """One forward under the profiler: (kernel, calls, self device ms) of its costliest kernels (on a CPU its
    ops and their self CPU time: a CPU has no kernels)."""
    cuda = ctx.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    synchronize(ctx.device)
    with torch.profiler.profile(activities=activities) as prof:
        runner.forward_groups(groups)
        synchronize(ctx.device)
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [(e.key, e.count, getattr(e, field, 0.0) / 1e3) for e in prof.key_averages()]
    rows = [r for r in rows if r[2] > 0 and (not cuda or not r[0].startswith(("cuda", "aten::", "Activity")))]
    return sorted(rows, key=lambda r: -r[2])[:TOP_KERNELS]


def draftpass_section(ctx: CheckContext) -> None:
    full = ctx.plan.full
    with torch.inference_mode():
        runner = build_draft(full, draft_heads(ctx, 11), ctx.device, ctx.dtype, 12)
        caches = runner.new_caches(max(SEGMENTS), CACHE_SLOTS)  # one block, as the KV pool's draft caches
        for cache in caches:
            runner.prefill(torch.arange(3, 3 + PREFIX_LEN, device=ctx.device), cache, 512)
            cache.length = PREFIX_LEN
        table = measure(ctx, runner, caches, "eager")
        cuda = ctx.device.type == "cuda"
        profiles = {}
        for variant, layout in (("graphs", "block"), ("graphs per segment", "segments")):
            runner.graphs = DraftGraphs(runner, capture=cuda, layout=layout)
            table += measure(ctx, runner, caches, variant)
            graphs = len(runner.graphs.passes)
            shapes = ((1, min(ROWS)), (max(SEGMENTS), max(ROWS))) if layout == "block" else ((max(SEGMENTS), max(ROWS)),)
            profiles |= {(variant, n, rows): top_kernels(ctx, runner, [[
                tree_segment(runner, caches[i], rows, 7 * rows + i, PREFIX_LEN) for i in range(n)]]) for n, rows in shapes}
        runner.graphs = None
        begin = time.perf_counter()
        runner.compile_layers()
        table += measure(ctx, runner, caches, "compiled")
        compile_s = time.perf_counter() - begin - sum(r.wall_ms for r in table if r.variant == "compiled") * TIMED / 1e3
        runner.graphs = DraftGraphs(runner, capture=cuda, layout="block")  # the compiled layers captured
        table += measure(ctx, runner, caches, "compiled graphs")
        compiled_graphs = "failed to capture" if runner.graphs.failed else f"{len(runner.graphs.passes)} captured"
        runner.graphs = None
    report = ctx.report
    report.line(f"Draft: {full.draft_layers} Llama layers, hidden {full.draft_hidden}, vocabulary {full.vocab_size}, "
                f"{ctx.dtype}; each segment after {PREFIX_LEN} committed slots; median of {TIMED} forwards, "
                "each synchronized before the next.")
    report.table("forward", "segments", "rows each", "host ms (queued)", "wall ms", "device ms", "aten ops a forward",
                 "host / device", "MB reserved on first runs", "MB peak above before")
    for r in table:
        report.row(r.variant, r.segments, r.rows, f"{r.host_ms:.2f}", f"{r.wall_ms:.2f}",
                   f"{r.device_ms:.2f}", r.aten_ops or "-", f"{r.host_ms / max(r.device_ms, 1e-6):.1f}",
                   "-" if r.held_mb is None else f"{r.held_mb:.0f}", "-" if r.peak_mb is None else f"{r.peak_mb:.0f}")
    report.line()
    eager = {(r.segments, r.rows): r.wall_ms for r in table if r.variant == "eager"}
    for variant in VARIANTS[1:]:
        report.line(f"{variant.capitalize()} / eager wall time: " + ", ".join(
            f"{r.segments} x {r.rows}: {r.wall_ms / eager[(r.segments, r.rows)]:.2f}x" for r in table if r.variant == variant))
    report.line(f"{graphs} graphs captured a layout (one per shape), compiled graphs {compiled_graphs}; compiling (warm-up forwards included) took about "
                f"{max(compile_s, 0.0):.0f} s.")
    report.line()
    report.line("Where a graphed forward's time goes (one replay under the profiler: its kernels by self device time; "
                "on a CPU the static pass's ops by self CPU time):")
    report.table("forward", "segments x rows", "kernel", "calls", "ms")
    for (variant, n, rows), kernels in profiles.items():
        for name, calls, ms in kernels:
            report.row(variant, f"{n} x {rows}", name if len(name) <= 90 else name[:87] + "...", calls, f"{ms:.3f}")
