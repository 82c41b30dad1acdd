"""The full-shape section: an 80-layer Llama-3-70B-shaped 4-bit target streamed from pinned RAM beside
a Llama-3.2-1B-shaped draft, GPU memory capped at a 24 GB card's (fullshape_build says how the pair
is made). Tables: int4 vs dequantize by rows per call; the streamed pass against max(copy, compute);
engine steps by budget x overlap x streams (draft, pass, copy, overlap and step ms, draft forwards
grown during the pass, peak memory against the plan); a 3,800-token prompt joining a running stream;
and the measured costs turned into tokens/s for a user on a PCIe 4.0 x16 link."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from bench.gpu_check.context import CheckContext
from bench.gpu_check.fullshape_build import build_engine
from bench.gpu_check.fullshape_kernels import kernel_rows, pass_rows
from bench.gpu_check.fullshape_report import (
    StepRow,
    print_join,
    print_kernels,
    print_passes,
    print_steps,
    print_users,
    progress,
)
from bench.gpu_check.plan import DraftVariant
from bench.gpu_check.probes import (
    GB,
    allocator_by_stream,
    allocator_state,
    peak_bytes,
    peak_reserved_bytes,
    reset_peak,
)
from engine.model import faults, memory_plan
from engine.runtime import Engine
from engine.types import EngineFault, OutOfMemory, PassStats, Request, SamplingParams

MAX_JOIN_STEPS = 200  # the joining prompt's first token within this many steps and seconds, or the table
MAX_JOIN_SECONDS = 90.0  # says how far it got
VARIANT_MARGIN = 1.3  # a draft variant starts only when its predecessor's time x this is left before --seconds


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def prompt(ctx: CheckContext, length: int, salt: int) -> list[int]:
    generator = torch.Generator().manual_seed(ctx.plan.seed + salt)
    return torch.randint(3, ctx.plan.full.vocab_size, (length,), generator=generator).tolist()


def run_steps(engine: Engine, requests: list[Request], warmup: int, measured: int,
              tokens: dict[str, list[int]] | None = None) -> list[PassStats]:
    """Add the requests, run warmup + measured steps, abort them; the measured steps' stats, and with `tokens`
    every request's emitted tokens by request id."""
    for request in requests:
        engine.add_request(request)
    stats: list[PassStats] = []
    try:
        for step in range(warmup + measured):
            output = engine.step()
            if output.failures:
                failure = output.failures[0][1]
                raise RuntimeError(f"a request failed: {failure}") from failure
            for delta in output.deltas if tokens is not None else ():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if step >= warmup and output.stats is not None:
                stats.append(output.stats)
    finally:
        for request in requests:
            engine.abort_request(request.request_id)
    return stats


def step_row(ctx: CheckContext, base: Engine, budget: int, overlap: bool, streams: int, draft: DraftVariant) -> StepRow:
    full = ctx.plan.full
    engine = base.with_speculation(dataclasses.replace(
        base.config.speculation, budget=budget, overlap=overlap, draft_graphs=draft.graphs, host_trees=draft.host_trees,
        extension_factor=draft.extension_factor, fresh_forwards=draft.fresh_forwards))
    label = f"g{int(draft.graphs)}h{int(draft.host_trees)}x{draft.extension_factor}f{draft.fresh_forwards}"
    requests = [Request(f"b{budget}-o{int(overlap)}-s{streams}-{label}-{i}", prompt(ctx, full.prompt_len, i),
                        greedy(full.max_context // 2)) for i in range(streams)]
    reset_peak(ctx.device)
    stats = run_steps(engine, requests, full.warmup_steps, full.measured_steps)
    planned = memory_plan.plan_memory(engine.memory_plan_inputs(budget)).total
    return StepRow(budget, overlap, streams, stats, peak_bytes(ctx.device), planned, draft.name,
                   peak_reserved_bytes(ctx.device))


def join_gaps(ctx: CheckContext, base: Engine) -> tuple[float, float, int, float, bool]:
    """A greedy stream at budget 256, overlap on; the long prompt joins after join_steps_before steps.
    (median step before, longest step until the prompt's first token, steps that took, its wait s,
    whether the first token came within MAX_JOIN_STEPS and MAX_JOIN_SECONDS)."""
    full = ctx.plan.full
    engine = base.with_speculation(dataclasses.replace(base.config.speculation, budget=min(full.budgets),
                                                       overlap=ctx.device.type == "cuda"))
    stream = Request("stream", prompt(ctx, full.prompt_len, 100), greedy(full.max_context // 2))
    joining = Request("join", prompt(ctx, full.join_len, 101), greedy(8))
    engine.add_request(stream)
    try:
        before = [engine.step().stats.step_seconds for _ in range(full.warmup_steps + full.join_steps_before)]
        engine.add_request(joining)
        begin, after, first = time.perf_counter(), [], False
        while not first and len(after) < MAX_JOIN_STEPS and time.perf_counter() - begin < MAX_JOIN_SECONDS:
            output = engine.step()
            after.append(output.stats.step_seconds)
            first = any(d.request_id == "join" and d.token_ids for d in output.deltas)
        waited = time.perf_counter() - begin
    finally:
        engine.abort_request("stream")
        engine.abort_request("join")
    return statistics.median(before[full.warmup_steps:]), max(after), len(after), waited, first


def fullshape_section(ctx: CheckContext) -> None:
    full, device, report = ctx.plan.full, ctx.device, ctx.report
    cuda = device.type == "cuda"
    if cuda:  # CUDA-only: a 24 GB card emulated
        total = torch.cuda.mem_get_info(device)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, full.memory_cap_gb * GB / total), device.index or 0)
    try:
        if not ctx.steps_only:
            print_kernels(ctx, kernel_rows(full, device, ctx.dtype))
        begin = time.perf_counter()
        engine = build_engine(full, device, ctx.dtype, ctx.plan.seed)
        report.line(f"Built and planned in {time.perf_counter() - begin:.1f} s: {full.num_layers} int4 layers "
                    f"(group {full.group_size}, {ctx.plan.full.hidden} hidden, MLP {full.mlp}) streamed from "
                    f"{'pinned ' if cuda else ''}RAM, {streamed_gb(engine):.2f} GB per pass; memory cap "
                    f"{f'{full.memory_cap_gb} GB' if cuda else 'n/a (CPU)'}; plan {engine.memory_plan_inputs().max_running} "
                    f"running requests.")
        try:
            run_sections(ctx, engine)
        finally:
            engine.close()
    finally:
        if cuda:  # CUDA-only
            torch.cuda.set_per_process_memory_fraction(1.0, device.index or 0)


def streamed_gb(engine: Engine) -> float:
    streamer = engine.pair.target.layers
    return sum(streamer.layouts[idx].nbytes for idx in streamer.streamed) / GB


def run_sections(ctx: CheckContext, engine: Engine) -> None:
    full = ctx.plan.full
    passes: list = []
    if not ctx.steps_only:
        passes = pass_rows(engine.pair.target, full, ctx.device, sorted({1, *(budget + 1 for budget in full.budgets)}))
        print_passes(ctx, passes)
    warm_graphs(ctx, engine)
    begin = time.perf_counter()
    rows = variant_rows(ctx, engine, full.variants[0])
    last_seconds = time.perf_counter() - begin
    # measured after the baseline's rows: a run short of time still has it
    join = None if ctx.steps_only else join_gaps(ctx, engine)
    for index, draft in enumerate(full.variants[1:], start=1):
        if ctx.time_left() < last_seconds * VARIANT_MARGIN:
            skipped = ", ".join(v.name for v in full.variants[index:])
            ctx.report.line(f"Not run: draft variants {skipped} (the run's --seconds left {ctx.time_left():.0f} s, "
                            f"a variant took {last_seconds:.0f} s).")
            break
        begin = time.perf_counter()
        rows += variant_rows(ctx, engine, draft)
        last_seconds = time.perf_counter() - begin
    print_steps(ctx, rows, passes)
    if join is not None:
        print_join(ctx, *join)
        print_users(ctx, rows, passes, streamed_gb(engine) * GB)


def warm_graphs(ctx: CheckContext, engine: Engine) -> None:
    """Every budget x streams once, overlap on, at the variants' largest extension, unmeasured: the draft's
    graphs of the shapes the rows meet are captured before any row (in run 4 the first variant's rows paid for
    the captures, so a later variant's overlap-off rows, which extensions cannot change, ran up to 1.4x faster)."""
    full = ctx.plan.full
    graphs = engine.pair.draft.graphs if engine.pair.draft is not None else None
    before = len(graphs.passes) if graphs is not None else 0
    factor = max(v.extension_factor for v in full.variants)
    begin = time.perf_counter()
    for budget in full.budgets:
        for streams in full.streams:
            warm = engine.with_speculation(dataclasses.replace(
                engine.config.speculation, budget=budget, overlap=True, extension_factor=factor))
            requests = [Request(f"warm-b{budget}-s{streams}-{i}", prompt(ctx, full.prompt_len, i),
                                greedy(full.max_context // 2)) for i in range(streams)]
            try:
                run_steps(warm, requests, full.warmup_steps + full.measured_steps, 0)
            except EngineFault:  # the device is in doubt
                raise
            except RuntimeError as exc:  # out of memory: the rows that meet it report it
                print(f"warm-up: budget {budget}, {streams} stream(s): {exc}", file=sys.stderr, flush=True)
    after = len(graphs.passes) if graphs is not None else 0
    ctx.report.line(f"Warm-up before the rows ({time.perf_counter() - begin:.1f} s): every budget x streams with "
                    f"overlap on at {factor}x extensions, unmeasured; {after - before} draft graphs captured.")


def variant_rows(ctx: CheckContext, engine: Engine, draft: DraftVariant) -> list[StepRow]:
    """One draft variant's rows (budget x overlap x streams), each printed to stderr (the log) as it is measured."""
    full, rows = ctx.plan.full, []
    for budget in full.budgets:
        for overlap in (False, True):
            for streams in full.streams:
                try:
                    rows.append(step_row(ctx, engine, budget, overlap, streams, draft))
                except EngineFault:  # the device is in doubt: the section ends
                    raise
                except RuntimeError as exc:  # a request failed (out of memory under the cap): reported, the next row runs
                    failed_row(ctx, f"{draft.name}, budget {budget}, overlap {'on' if overlap else 'off'}, "
                                    f"{streams} stream(s)", exc)
                    continue
                print(f"row: {progress(rows[-1])}; by stream (reserved / allocated): "
                      f"{allocator_by_stream(ctx.device)}", file=sys.stderr, flush=True)  # the log, not the report
    return rows


def failed_row(ctx: CheckContext, label: str, exc: Exception) -> None:
    """A row whose step failed: its error and the allocator's state, in the report and the log; flagged when
    it ran out of memory (the plan accepted what allocation could not hold)."""
    line = (f"Row failed: {label}: {str(exc).splitlines()[0][:600]}; allocator: {allocator_state(ctx.device)}; "
            f"by stream (reserved / allocated): {allocator_by_stream(ctx.device)}")
    ctx.report.line(line)
    print(f"row: {line}", file=sys.stderr, flush=True)
    if isinstance(exc.__cause__, OutOfMemory) or faults.is_out_of_memory(exc):
        ctx.report.flag(f"full shape {label}: out of memory under the cap the plan accepted")
