"""Real engine steps at a full context: peak device memory (against the engine's startup memory
plan), the attention backend of the target's tree pass, and host syncs, at each budget, with top_p
and all three penalties on (the per-node logits processing runs on every node of the tree).

The target streams from RAM (ring 2); a prompt of `context_len` random tokens fills the context.
Per budget: step 1 (prefill + first step), step 2 measured for memory, step 3 with the target pass
under the profiler, step 4 under `torch.cuda.set_sync_debug_mode("warn")`."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from bench.gpu_check.context import CheckContext
from bench.gpu_check.probes import (
    allocated_bytes,
    attention_backends,
    attention_kernels,
    counted_syncs,
    gigabytes,
    marking_passes,
    peak_bytes,
    profiled,
    reset_peak,
    site_summary,
    wrapped_forward,
)
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import memory_plan
from engine.runtime import Engine
from engine.types import Request, SamplingParams, TokenDelta

MAX_NEW_TOKENS = 128  # room after the prompt; four steps of a random pair emit a few tokens
SAMPLING = {
    "temperature": 1.0,
    "top_p": 0.9,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
}


@dataclass
class BudgetResult:
    budget: int
    tree_nodes: int
    first_seconds: float  # prefill + step 1
    step_seconds: float  # step 2
    peak: int | None  # max_memory_allocated during step 2
    before: int | None  # memory_allocated before step 2
    planned: int  # the memory plan's total at this budget
    backends: list[str]  # SDPA backends of the profiled target pass
    kernels: list[str]
    efficient_accepts: bool  # the memory-efficient kernel alone runs a tree pass at this context
    pass_syncs: list[str]  # sync sites inside step 4's target pass (whichever thread ran it)
    step_syncs: list[str]  # sync sites of step 4 in the engine's own thread, outside the pass


def engine_config(ctx: CheckContext, budget: int) -> EngineConfig:
    checkpoints = ctx.built()
    return EngineConfig(
        model=ModelConfig(
            target=str(checkpoints.target), draft=str(checkpoints.draft), device=str(ctx.device)
        ),
        speculation=SpeculationConfig(method="specexec", budget=budget),
        offload=OffloadConfig(enabled=True, source="ram", resident_layers=0, ring_size=2),
        limits=LimitsConfig(max_context=ctx.plan.context_len + MAX_NEW_TOKENS),
    )


def next_step(steps: Iterator[TokenDelta], number: int) -> TokenDelta:
    delta = next(steps, None)
    if delta is None or delta.stats is None:
        raise RuntimeError(f"the request finished before step {number}")
    return delta


def steps_section(ctx: CheckContext) -> None:
    plan = ctx.plan
    base = Engine.load(engine_config(ctx, max(plan.budgets)))
    results: list[BudgetResult] = []
    try:
        ctx.report.line(
            f"Engine.load: target {base.pair.target.dtype}, streamed from RAM; prompt {plan.context_len} "
            f"random tokens; sampling {SAMPLING}."
        )
        for budget in sorted(plan.budgets):
            spec = dataclasses.replace(base.config.speculation, budget=budget)
            engine = base if budget == base.budget else base.with_speculation(spec)
            results.append(measure_budget(ctx, engine, budget))
    finally:
        print_results(ctx, results)
        streamer = base.pair.target.layers
        if hasattr(streamer, "close"):
            streamer.close()


def measure_budget(ctx: CheckContext, engine: Engine, budget: int) -> BudgetResult:
    device, plan = ctx.device, ctx.plan
    generator = torch.Generator().manual_seed(plan.seed + budget)
    prompt = torch.randint(0, plan.vocab_size, (plan.context_len,), generator=generator).tolist()
    params = SamplingParams(**SAMPLING, seed=plan.seed, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    target = engine.pair.target
    inputs = engine.memory_plan_inputs(budget)
    planned = memory_plan.plan_memory(inputs).total
    steps = engine.generate(Request(f"gpu-check-{budget}", prompt, params))
    try:
        begin = time.perf_counter()
        next_step(steps, 1)
        first_seconds = time.perf_counter() - begin
        reset_peak(device)
        before = allocated_bytes(device)
        second = next_step(steps, 2)
        peak = peak_bytes(device)
        with wrapped_forward(target, lambda: profiled(device)) as profiles:
            next_step(steps, 3)
        with counted_syncs(device) as caught, marking_passes(target):
            next_step(steps, 4)
        main = threading.current_thread().name
        pass_syncs = [sync.site for sync in caught if sync.in_pass]
        step_syncs = [sync.site for sync in caught if sync.thread == main and not sync.in_pass]
    finally:
        steps.close()
    cache = target.new_cache(plan.context_len + budget + 1)
    cache.length = plan.context_len
    return BudgetResult(
        budget=budget,
        tree_nodes=second.stats.tree_size,
        first_seconds=first_seconds,
        step_seconds=second.stats.step_seconds,
        peak=peak,
        before=before,
        planned=planned,
        backends=attention_backends(set().union(*(names["ops"] for names in profiles))),
        kernels=attention_kernels(set().union(*(names["kernels"] for names in profiles))),
        efficient_accepts=target.attention_accepts(SDPBackend.EFFICIENT_ATTENTION, cache, budget + 1),
        pass_syncs=pass_syncs,
        step_syncs=step_syncs,
    )


def print_results(ctx: CheckContext, results: list[BudgetResult]) -> None:
    report, cuda = ctx.report, ctx.device.type == "cuda"
    cpu = "n/a (CPU)"
    report.table(
        "budget", "tree nodes", "prefill + step 1 s", "step 2 s", "peak device memory (step 2)",
        "peak above pre-step", "memory plan total", "peak within plan",
    )  # fmt: skip
    for r in results:
        within = "n/a (CPU)" if r.peak is None else ("yes" if r.peak <= r.planned else "NO")
        if within == "NO":
            report.flag(
                f"budget {r.budget}: peak {gigabytes(r.peak)} above the memory plan's {gigabytes(r.planned)}"
            )
        report.row(
            r.budget, r.tree_nodes, f"{r.first_seconds:.2f}", f"{r.step_seconds:.3f}", gigabytes(r.peak),
            gigabytes(None if r.peak is None else r.peak - r.before), gigabytes(r.planned), within,
        )  # fmt: skip
    report.table(
        "budget", "SDPA backend (tree pass, profiled)", "attention kernels",
        "memory-efficient kernel takes it", "host syncs: target pass", "host syncs: engine step (its own thread, outside the pass)", "where the engine step synced (file:line)",
    )  # fmt: skip
    for r in results:
        report.row(
            r.budget,
            ", ".join(r.backends) or "no SDPA op seen",
            ", ".join(r.kernels) or ("-" if cuda else cpu),
            "yes" if r.efficient_accepts else "no",
            len(r.pass_syncs) if cuda else cpu,
            len(r.step_syncs) if cuda else cpu,
            site_summary(r.step_syncs) if cuda else cpu,
        )
