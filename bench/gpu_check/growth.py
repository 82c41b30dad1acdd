"""The growth section: the draft phase of engine steps with SpecExec trees grown on the device or on the host
(--host-trees), one growth per tree or several streams' trees as one forest (--forest), the draft's forwards as
CUDA graphs (on a CPU: the same static pass, uncaptured).

The pair is two copies of the full shape's 1B-shaped draft, resident (the target's pass is not what this
measures: overlap is off, and the draft phase, `draft_seconds`, is the growth's forwards and its own tensor
work between them). Per budget x streams x how the trees grow (on the device, one growth each; with several
streams, as a forest; as a forest on the host): draft ms a step (median), draft forwards a step, ms a forward,
tokens a step, draft ms against one growth per tree on the device; and whether every stream's greedy tokens
are the same every way (they must be: how a tree grows changes nothing it holds)."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from bench.gpu_check.context import CheckContext
from bench.gpu_check.draftpass import draft_heads
from bench.gpu_check.fullshape import greedy, prompt, run_steps
from bench.gpu_check.fullshape_build import build_draft
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.model.pair import LoadedPair
from engine.runtime import Engine
from engine.types import PassStats, Request

MEASURED = 4  # steps after the full shape's warm-up ones (the prompts' prefill, the first trees)


@dataclasses.dataclass(frozen=True)
class GrowthRow:
    budget: int
    streams: int
    host_trees: bool
    forest: bool  # several streams' trees as one forest (a lone tree grows on its own either way)
    stats: list[PassStats]
    tokens: list[list[int]]  # every stream's emitted tokens, in stream order

    def median(self, field: str) -> float:
        return statistics.median(getattr(s, field) for s in self.stats)


def growth_row(ctx: CheckContext, base: Engine, budget: int, streams: int, host_trees: bool, forest: bool) -> GrowthRow:
    engine = base.with_speculation(dataclasses.replace(base.config.speculation, budget=budget, host_trees=host_trees,
                                                       forest=forest))
    full = ctx.plan.full
    requests = [Request(f"b{budget}-s{streams}-h{int(host_trees)}f{int(forest)}-{i}", prompt(ctx, full.prompt_len, i),
                        greedy(full.max_context // 2)) for i in range(streams)]
    emitted: dict[str, list[int]] = {}
    stats = run_steps(engine, requests, full.warmup_steps, MEASURED, emitted)
    return GrowthRow(budget, streams, host_trees, forest, stats, [emitted.get(r.request_id, []) for r in requests])


def ways(streams: int) -> list[tuple[bool, bool]]:
    """(host trees, forest) of a growth row: the baseline (device, one growth per tree) first."""
    return [(False, False), (False, True), (True, True)] if streams > 1 else [(False, False), (True, False)]


def growth_section(ctx: CheckContext) -> None:
    full = ctx.plan.full
    with torch.inference_mode():
        heads = draft_heads(ctx, 11)
        pair = LoadedPair(build_draft(full, heads, ctx.device, ctx.dtype, 12),
                          build_draft(full, heads, ctx.device, ctx.dtype, 12),
                          tokenizer=None, eos_token_ids=frozenset(), max_context=full.max_context)
        del heads
    config = EngineConfig(
        model=ModelConfig(target="growth-target", draft="growth-draft", device=str(ctx.device),
                          dtype=str(ctx.dtype).removeprefix("torch.")),
        speculation=SpeculationConfig(method="specexec", budget=max(full.budgets), overlap=False, draft_graphs=True),
        limits=LimitsConfig(max_context=full.max_context, max_running=max(full.streams), prefix_cache_slots=0),
    )
    engine = Engine(pair, config)
    try:
        engine.reserve_memory()
        rows = [growth_row(ctx, engine, budget, streams, host, forest) for budget in full.budgets
                for streams in full.streams for host, forest in ways(streams)]
    finally:
        engine.close()
    print_growth(ctx, rows)


def print_growth(ctx: CheckContext, rows: list[GrowthRow]) -> None:
    full, report = ctx.plan.full, ctx.report
    report.line(f"Target and draft: the full shape's draft ({full.draft_layers} Llama layers, hidden "
                f"{full.draft_hidden}, {ctx.dtype}), resident, overlap off, the draft's forwards as graphs; greedy; "
                f"median of {MEASURED} steps after {full.warmup_steps}.")
    report.table("budget", "streams", "trees grow", "draft ms / step", "draft forwards / step", "ms / forward",
                 "tokens / step", "draft ms vs per tree on the device", "same tokens")
    by_key = {(r.budget, r.streams, r.host_trees, r.forest): r for r in rows}
    for r in rows:
        draft_ms = r.median("draft_seconds") * 1e3
        forwards = r.median("draft_forwards")
        base = by_key[(r.budget, r.streams, False, False)]
        same = r.tokens == base.tokens and all(r.tokens)  # every stream emitted something, the same
        way = ("on the host" if r.host_trees else "on the device") + (", forest" if r.forest else ", per tree")
        if not same:
            report.mismatch(f"growth: budget {r.budget}, {r.streams} streams, trees {way}: the tokens differ")
        ratio = draft_ms / (base.median("draft_seconds") * 1e3)
        report.row(r.budget, r.streams, way, f"{draft_ms:.1f}", f"{forwards:.1f}",
                   f"{draft_ms / max(forwards, 1):.2f}", f"{sum(s.num_emitted for s in r.stats) / len(r.stats):.1f}",
                   f"{ratio:.2f}x" if r is not base else "", "yes" if same else "NO")
