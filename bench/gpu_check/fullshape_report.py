"""The full-shape section's tables (bench.gpu_check.fullshape measures)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.gpu_check.context import CheckContext
from bench.gpu_check.fullshape_kernels import KernelRow, PassRow
from bench.gpu_check.probes import gigabytes
from engine.types import PassStats

PASS_GOAL = 1.15  # streamed pass / max(copy, compute) at budget 256
OVERLAP_GOAL = 1.15  # tokens/s with overlap on / off, where the pass is copy-bound
STREAMS_GOAL = 3.0  # 4 streams' tokens/s / 1 stream's
VERDICT_GAIN = 1.03  # a draft variant pays with this geometric mean of its tokens/s over the variant it adds to ...
VERDICT_FLOOR = 0.97  # ... and no row below this
JOIN_GOAL = 2.0  # the running stream's longest gap while a prompt joins / its median gap before
PCIE4_GBPS = 25.0  # pinned host -> device on PCIe 4.0 x16: 31.5 GB/s theoretical, ~25 measured (bandwidthTest)
ACCEPTANCES = (  # tokens per pass at budget 256
    ("built-in pair, greedy (docs/bench/gpu.md, bench row of 2026-11-23)", 6.40),
    ("SpecExec paper: Llama-2-70B GPTQ on an RTX 4090, budget 256", 13.46),
)


@dataclass(frozen=True)
class StepRow:
    budget: int
    overlap: bool
    streams: int
    stats: list[PassStats]
    peak: int | None
    planned: int
    draft: str = "graphs"  # how the draft ran (plan.DraftVariant's name)
    reserved: int | None = None  # the caching allocator's peak reservation (CUDA)

    def median(self, field: str) -> float:
        return statistics.median(getattr(s, field) for s in self.stats)

    def mean(self, field: str) -> float:
        return statistics.mean(getattr(s, field) for s in self.stats)

    @property
    def tokens_per_pass(self) -> float:
        return sum(s.num_emitted for s in self.stats) / len(self.stats)

    @property
    def tokens_per_second(self) -> float:
        return sum(s.num_emitted for s in self.stats) / sum(s.step_seconds for s in self.stats)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def progress(r: StepRow) -> str:
    """One step row as a log line (the tables print once every variant ran)."""
    return (f"{r.draft}, budget {r.budget}, overlap {'on' if r.overlap else 'off'}, {r.streams} stream(s): draft "
            f"{ms(r.median('draft_seconds'))} ms ({r.median('draft_forwards'):.0f} forwards), pass {ms(r.median('target_seconds'))} ms, step "
            f"{ms(r.median('step_seconds'))} ms, {r.median('extension_forwards'):.0f} forwards during the pass, "
            f"{r.tokens_per_pass:.2f} tokens/pass, {r.tokens_per_second:.2f} tokens/s, peak {gigabytes(r.peak)} "
            f"allocated, {gigabytes(r.reserved)} reserved, plan {gigabytes(r.planned)}")


def print_kernels(ctx: CheckContext, rows: list[KernelRow]) -> None:
    full, report = ctx.plan.full, ctx.report
    layers = full.num_layers
    report.line(f"One decoder layer's seven projections (group {full.group_size}), best of 3 (fullshape_kernels' "
                f"doc says what each column runs; on CPU the first two are the engine's own kernel); x {layers} "
                "layers: a pass's projection compute.")
    report.table("rows per call", "tinygemm ms", "bf16 once ms", "bf16 once, compiled ms", "gptqmodel-like ms",
                 "bf16 dense ms", "engine ms", f"engine x {layers} ms", "fastest 4-bit")
    for r in rows:
        fastest = min((r.tinygemm_s, "tinygemm"), (r.bf16_once_s, "bf16 once"), (r.compiled_s, "bf16 once, compiled"),
                      (r.gptq_like_s, "gptqmodel-like"))[1]
        report.row(r.num_rows, ms(r.tinygemm_s), ms(r.bf16_once_s), ms(r.compiled_s), ms(r.gptq_like_s), ms(r.dense_s),
                   ms(r.engine_s), ms(r.engine_s * layers), fastest)


def pass_ratio(row: PassRow) -> float:
    return row.streamed_s / max(row.copy_s, row.compute_s)


def print_passes(ctx: CheckContext, rows: list[PassRow]) -> None:
    report, budget = ctx.report, min(ctx.plan.full.budgets)
    report.line(f"A causal pass of n tokens after {ctx.plan.full.prompt_len} cached ones, logits for every row: "
                "compute (one resident layer copy used for every layer, no copies), plain copy of every "
                "streamed layer (no compute), the engine's streamed pass; best of 3.")
    report.table("tokens", "compute ms", "copy ms", "streamed ms", "streamed / max(copy, compute)", "bound by", "goal")
    for r in rows:
        ratio = pass_ratio(r)
        goal = "-"
        if r.num_tokens == budget + 1:
            ok = ratio <= PASS_GOAL
            goal = f"<= {PASS_GOAL} {'ok' if ok else 'MISS'}"
            if not ok and ctx.device.type == "cuda":
                report.flag(f"full-shape streamed pass at {r.num_tokens} tokens: {ratio:.2f} x max(copy, compute)")
        report.row(r.num_tokens, ms(r.compute_s), ms(r.copy_s), ms(r.streamed_s), f"{ratio:.3f}",
                   "copy" if r.copy_s >= r.compute_s else "compute", goal)


def copy_bound(passes: list[PassRow], tree_tokens: int) -> bool:
    row = next((r for r in passes if r.num_tokens == tree_tokens), None)
    return row is not None and row.copy_s >= row.compute_s


def print_steps(ctx: CheckContext, rows: list[StepRow], passes: list[PassRow]) -> None:
    report, full, cuda = ctx.report, ctx.plan.full, ctx.device.type == "cuda"
    copy_ms = ms(passes[0].copy_s) if passes else "-"
    report.line(f"Engine steps, greedy, {full.prompt_len}-token random prompts, median of {full.measured_steps} "
                f"steps after {full.warmup_steps}; the budget is shared by the streams in a pass. copy: every "
                "streamed layer copied alone (the pass's floor).")
    report.table("budget", "overlap", "streams", "draft ms", "draft forwards before the pass", "ms per draft forward",
                 "pass ms", "copy ms", "overlap ms", "draft forwards during the pass", "seeded trees", "step ms", "tokens/pass", "tokens/s", "peak memory", "peak reserved",
                 "plan", "peak within plan", "draft")
    for r in rows:
        within = "n/a (CPU)" if r.peak is None else ("yes" if r.peak <= r.planned else "NO")
        if within == "NO":
            report.flag(f"full shape budget {r.budget}: peak {gigabytes(r.peak)} above the plan's {gigabytes(r.planned)}")
        forwards = r.median("draft_forwards")
        per_forward = ms(r.median("draft_seconds") / forwards) if forwards else "-"
        report.row(r.budget, "on" if r.overlap else "off", r.streams, ms(r.median("draft_seconds")), f"{forwards:.0f}",
                   per_forward, ms(r.median("target_seconds")), copy_ms, ms(r.median("overlap_seconds")),
                   f"{r.median('extension_forwards'):.0f}", f"{r.mean('seeded_trees'):.1f} / {r.streams}",
                   ms(r.median("step_seconds")), f"{r.tokens_per_pass:.2f}",
                   f"{r.tokens_per_second:.2f}", gigabytes(r.peak), gigabytes(r.reserved), gigabytes(r.planned), within,
                   r.draft)
    by_key = {(r.budget, r.overlap, r.streams, r.draft): r for r in rows}
    report.table("budget", "streams", "draft", "overlap on / off (tokens/s)", "pass copy-bound", "goal")
    for (budget, overlap, streams, draft), on in by_key.items():
        off = by_key.get((budget, False, streams, draft))
        if not overlap or off is None:
            continue
        gain, bound = on.tokens_per_second / off.tokens_per_second, copy_bound(passes, budget + 1)
        goal = f">= {OVERLAP_GOAL} {'ok' if gain >= OVERLAP_GOAL else 'MISS'}" if bound else "- (compute-bound)"
        if not passes:  # --steps-only: no pass table to tell
            goal = "- (passes not measured)"
        if bound and gain < OVERLAP_GOAL and cuda:
            report.flag(f"overlap at budget {budget}, {streams} stream(s), draft {draft}: {gain:.2f}x")
        report.row(budget, streams, draft, f"{gain:.2f}x", ("yes" if bound else "no") if passes else "-", goal)
    most = max(full.streams)
    report.table("budget", "overlap", "draft", f"{most} streams / 1 stream (tokens/s)", "goal")
    for (budget, overlap, streams, draft), many in by_key.items():
        one = by_key.get((budget, overlap, 1, draft))
        if streams != most or one is None or most == 1:
            continue
        gain = many.tokens_per_second / one.tokens_per_second
        if gain < STREAMS_GOAL and cuda:
            report.flag(f"{most} streams at budget {budget}, overlap {overlap}, draft {draft}: {gain:.2f}x one stream")
        report.row(budget, "on" if overlap else "off", draft, f"{gain:.2f}x",
                   f">= {STREAMS_GOAL} {'ok' if gain >= STREAMS_GOAL else 'MISS'}")
    baseline = full.variants[0].name
    report.table("budget", "overlap", "streams", "draft", f"tokens/s / {baseline}'s", f"draft ms / {baseline}'s")
    for (budget, overlap, streams, draft), row in by_key.items():
        base = by_key.get((budget, overlap, streams, baseline))
        if draft == baseline or base is None:
            continue
        report.row(budget, "on" if overlap else "off", streams, draft,
                   f"{row.tokens_per_second / base.tokens_per_second:.2f}x",
                   f"{ms(row.median('draft_seconds'))} / {ms(base.median('draft_seconds'))}")
    print_verdicts(ctx, rows)


def print_verdicts(ctx: CheckContext, rows: list[StepRow]) -> None:
    """Each draft variant against the one it adds to (DraftVariant.versus; the baseline by default) over the
    rows both ran: whether it pays (VERDICT_GAIN in the geometric mean, no row below VERDICT_FLOOR), so a
    default can be chosen from the table alone."""
    variants = ctx.plan.full.variants
    by_key = {(r.draft, r.budget, r.overlap, r.streams): r for r in rows}
    ran = {r.draft for r in rows}
    compared = [(v.name, v.versus or variants[0].name) for v in variants[1:] if v.name in ran]
    if not compared:
        return
    ctx.report.table("draft", "versus", "rows", "tokens/s ratio: geometric mean", "lowest", "highest", "verdict")
    for name, versus in compared:
        ratios = [r.tokens_per_second / other.tokens_per_second for r in rows if r.draft == name
                  and (other := by_key.get((versus, r.budget, r.overlap, r.streams))) is not None]
        if not ratios:
            continue
        mean = statistics.geometric_mean(ratios)
        pays = mean >= VERDICT_GAIN and min(ratios) >= VERDICT_FLOOR
        ctx.report.row(name, versus, len(ratios), f"{mean:.3f}x", f"{min(ratios):.2f}x", f"{max(ratios):.2f}x",
                       "pays" if pays else "does not pay")


def print_join(ctx: CheckContext, median_before: float, longest_after: float, steps: int, waited: float,
               first: bool) -> None:
    report, full = ctx.report, ctx.plan.full
    ratio = longest_after / median_before
    if ratio > JOIN_GOAL and ctx.device.type == "cuda":
        report.flag(f"a {full.join_len}-token prompt joining: longest gap {ratio:.2f}x the median")
    report.line(f"A {full.join_len}-token prompt joins a greedy stream (budget {min(full.budgets)}, prefill slices "
                "auto): the stream's steps before and until the prompt's first token.")
    report.table("median step before ms", "longest step after ms", "ratio", "steps until its first token",
                 "its time to first token s", "goal")
    report.row(ms(median_before), ms(longest_after), f"{ratio:.2f}", steps if first else f"none in {steps}",
               f"{waited:.2f}" if first else f"> {waited:.2f}",
               f"<= {JOIN_GOAL} {'ok' if ratio <= JOIN_GOAL else 'MISS'}")


def print_users(ctx: CheckContext, rows: list[StepRow], passes: list[PassRow], streamed_bytes: float) -> None:
    """Tokens/s for one user: measured draft time (overlap on, one stream) + the pass with its copy at
    PCIe 4.0 x16 (max of that copy and the measured compute), at other acceptances."""
    report, budget = ctx.report, min(ctx.plan.full.budgets)
    # overlap on, one stream; the last variant's (the rows put the variants in order)
    one = next((r for r in reversed(rows) if r.budget == budget and r.overlap and r.streams == 1), None)
    tree = next((r for r in passes if r.num_tokens == budget + 1), None)
    single = next((r for r in passes if r.num_tokens == 1), None)
    if one is None or tree is None or single is None:
        return
    copy_s = streamed_bytes / (PCIE4_GBPS * 1e9)
    draft_s = one.median("draft_seconds")
    step_here = one.median("step_seconds")
    step_pcie = draft_s + max(copy_s, tree.compute_s)
    report.line(f"Measured step costs turned into one user's tokens/s at budget {budget}: draft {ms(draft_s)} ms "
                f"(overlap on, seeded trees, draft: {one.draft}), tree pass compute {ms(tree.compute_s)} ms, {streamed_bytes / 1e9:.1f} GB "
                f"streamed per pass; PCIe 4.0 x16 at {PCIE4_GBPS:g} GB/s (pinned host-to-device; 31.5 GB/s theoretical) "
                f"-> copy {ms(copy_s)} ms. Autoregressive: one token per pass of max(copy, 1-token compute).")
    report.table("acceptance (tokens per pass)", "tokens/pass", "tokens/s, this GPU's link", "tokens/s, PCIe 4.0 x16")
    report.row("this run (aligned random pair)", f"{one.tokens_per_pass:.2f}", f"{one.tokens_per_pass / step_here:.2f}",
               f"{one.tokens_per_pass / step_pcie:.2f}")
    for name, accepted in ACCEPTANCES:
        report.row(name, f"{accepted:.2f}", f"{accepted / step_here:.2f}", f"{accepted / step_pcie:.2f}")
    report.row("autoregressive (same run)", "1.00", f"{1 / single.streamed_s:.2f}",
               f"{1 / max(copy_s, single.compute_s):.2f}")
