"""One end-to-end `specexec bench` row: bench's own machinery on the built-in pair, the target padded
to a few GB (outputs unchanged, so acceptance stays the trained pair's) and streamed from RAM, one
SpecExec budget and autoregressive for contrast."""

from __future__ import annotations

import argparse
import dataclasses

from tqdm import tqdm

from bench import decode as bench
from bench.gpu_check.context import CheckContext
from bench.pad_target import pad_checkpoint
from bench.prompts import encode_prompt, select_prompts
from bench.report import METHOD_LABELS, add_speedups, summarize
from engine.model.checkpoint import load_tokenizer

GB = 1e9


def bench_args(ctx: CheckContext) -> list[str]:
    plan = ctx.plan
    return [
        "--pad-to-gb", f"{plan.pad_to_gb:g}", "--modes", "ram", "--budgets", str(plan.bench_budget),
        "--methods", "autoregressive,specexec", "--temperatures", "0", "--no-auto",
        "--num-prompts", str(plan.bench_prompts), "--max-tokens", str(plan.bench_tokens),
    ]  # fmt: skip


def bench_section(ctx: CheckContext) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = bench_args(ctx)
    args = parser.parse_args(argv)
    padded, pad_plan = pad_checkpoint(args.target, ctx.work_dir / "padded", args.pad_to_gb)
    tokenizer = load_tokenizer(args.target)
    prompts = [
        encode_prompt(tokenizer, kind, text)
        for kind, text in select_prompts(args.prompt_set, args.num_prompts)
    ]
    with tqdm(total=0, disable=True) as bar:
        results, info = bench.run_mode("ram", str(padded), args, prompts, bar)
    rows = [{**dataclasses.asdict(result), **summarize(result, info)} for result in results]
    add_speedups(rows)
    copy_rate = ctx.facts.get("copy_bytes_per_s")
    ctx.report.line(
        f"`specexec bench {' '.join(argv)}` (padded into the work dir): {pad_plan.num_layers} layers, "
        f"{pad_plan.total_bytes / GB:.2f} GB fp32 on disk, "
        f"{info['bytes_per_pass'] / GB:.2f} GB streamed per pass; "
        f"bench's link figure (host RAM copy) {info['link_bytes_per_s'] / GB:.2f} GB/s"
        + (f", store->device copy {copy_rate / GB:.2f} GB/s (copy section)." if copy_rate else ".")
    )
    ctx.report.table(
        "method",
        "budget",
        "tokens/s",
        "tokens/pass",
        "speedup",
        "% of limit (bench)",
        "% of store->device copy limit",
    )
    for row in rows:
        device_limit = "-"
        if copy_rate:
            limit = row["emitted_per_pass"] * copy_rate / info["bytes_per_pass"]
            device_limit = f"{100 * row['tokens_per_s'] / limit:.0f}%"
        ctx.report.row(
            METHOD_LABELS[row["method"]],
            "-" if row["method"] == "autoregressive" else row["budget"],
            f"{row['tokens_per_s']:.2f}",
            f"{row['tokens_per_pass']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{100 * row['fraction_of_limit']:.0f}%",
            device_limit,
        )
