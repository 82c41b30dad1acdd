"""Is streaming hidden behind compute? `specexec bench offload`'s measurement on the 70B-shaped layers:
a streamed pass (RAM source, ring 2) against max(plain copy of its layers, resident compute)."""

from __future__ import annotations

import argparse

from bench.gpu_check.context import CheckContext
from bench.gpu_check.probes import GB
from bench.offload import GOAL, measure


def overlap_section(ctx: CheckContext) -> None:
    plan, report = ctx.plan, ctx.report
    args = argparse.Namespace(
        tokens=list(plan.overlap_tokens),
        passes=plan.overlap_passes,
        rounds=plan.overlap_rounds,
        ring_size=2,
        sources=["ram"],
    )
    rows = measure(str(ctx.built().target), args, ctx.device, ctx.dtype)
    report.line(
        f"Causal passes of n tokens over every streamed layer, best of {plan.overlap_rounds} rounds x "
        f"{plan.overlap_passes} back-to-back passes; copy: the same bytes copied with no compute alongside."
    )
    report.table(
        "tokens",
        "resident ms",
        "copy ms",
        "streamed ms",
        "stream GB/s",
        "streamed / max(copy, compute)",
        "goal",
    )
    for row in rows:
        ratio = row.streamed_s / max(row.copy_s, row.resident_s)
        ok = ratio <= GOAL
        if not ok:
            report.flag(f"overlap at n={row.num_tokens}: {ratio:.2f} > {GOAL}")
        report.row(
            row.num_tokens,
            f"{row.resident_s * 1e3:.1f}",
            f"{row.copy_s * 1e3:.1f}",
            f"{row.streamed_s * 1e3:.1f}",
            f"{row.bytes_per_pass / row.streamed_s / GB:.2f}",
            f"{ratio:.3f}",
            f"<= {GOAL} {'ok' if ok else 'MISS'}",
        )
