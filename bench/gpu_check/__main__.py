"""`python3 -m bench.gpu_check`: run every section, print the markdown report, exit 0 when no
section failed and every streamed result equals the resident one (goals missed are reported only)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.gpu_check.plan import FULL, TINY, Plan
from bench.gpu_check.report import Report

if TYPE_CHECKING:
    from bench.gpu_check.context import CheckContext

NO_CUDA = 2  # exit status without a CUDA device
# name -> (title, "module:function"); imported when the section runs, so one that cannot even import
# fails alone
SECTIONS = {
    "header": ("Machine", "header:header_section"),
    "build": ("Checkpoints (random, seeded, non-zero weights)", "build:build_section"),
    "copy": ("Plain copy bandwidth of one layer", "links:copy_section"),
    "equality": ("Streamed vs resident logits", "equality:equality_section"),
    "overlap": ("Overlap: streamed pass vs max(copy, compute), RAM source", "overlap:overlap_section"),
    "steps": ("Engine steps at a full context: memory, attention backend, host syncs", "steps:steps_section"),
    "serving": ("Serving: several requests per pass, seeded sampling, prefix cache, grammar", "serving:serving_section"),
    "disk": ("Disk source read bandwidth", "links:disk_section"),
    "bench": ("End to end: one `specexec bench` row", "bench_row:bench_section"),
    "fullshape": ("Full shape: a 70B-shaped 4-bit target streamed from pinned RAM, a 1B-shaped draft, 23 GB",
                  "fullshape:fullshape_section"),
    "draftpass": ("The draft's tree forward alone: host vs device time, 1 and 4 segments, compiled layers",
                  "draftpass:draftpass_section"),
    "growth": ("Draft phase: SpecExec trees grown on the device or the host (--host-trees), per tree or as a forest",
               "growth:growth_section"),
}
NEEDS_BUILD = ("copy", "equality", "overlap", "steps", "disk")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="built checkpoints (default ~/.cache/specexec/gpu-check)"
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)} (default: all)"
    )
    parser.add_argument("--seconds", type=float, default=None,
                        help="the run's time budget in seconds: the full-shape section runs its first draft variant, "
                             "then each next one only while the last one's time fits in what is left (the tables "
                             "print what ran)")
    parser.add_argument("--variants", default=None, metavar="I,J",
                        help="full shape: only these draft variants, by position in FullShape.variants from 0 (the "
                             "first one given is the baseline the verdicts compare with)")
    parser.add_argument("--budgets", default=None, metavar="B,B", help="full shape: only these budgets")
    parser.add_argument("--streams", default=None, metavar="S,S", help="full shape: only these stream counts")
    parser.add_argument("--steps-only", action="store_true",
                        help="full shape: only the step rows (no kernel, pass, join or users tables)")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: run on the CPU
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: tiny shapes
    return parser.parse_args(argv)


def narrowed(plan: Plan, args: argparse.Namespace) -> Plan:
    """The plan with the full shape's variants, budgets and streams cut to those asked for."""
    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(",") if part)

    full = plan.full
    if args.variants is not None:
        full = dataclasses.replace(full, variants=tuple(full.variants[i] for i in ints(args.variants)))
    if args.budgets is not None:
        full = dataclasses.replace(full, budgets=ints(args.budgets))
    if args.streams is not None:
        full = dataclasses.replace(full, streams=ints(args.streams))
    return dataclasses.replace(plan, full=full)


def selected_sections(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        raise SystemExit(f"gpu-check: unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if any(name in NEEDS_BUILD for name in names) and "build" not in names:
        names.append("build")
    return sorted(names, key=list(SECTIONS).index)


def run_section(ctx: CheckContext, name: str) -> None:
    from bench.gpu_check.probes import release_memory

    title, target = SECTIONS[name]
    module_name, function = target.split(":")
    with ctx.report.section(title, cleanup=lambda: release_memory(ctx.device)):
        module = importlib.import_module(f"bench.gpu_check.{module_name}")
        getattr(module, function)(ctx)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = selected_sections(args.sections)
    cuda = torch.cuda.is_available() and not args.allow_cpu
    if not cuda and not args.allow_cpu:
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}); "
            "nothing to check"
        )
        return NO_CUDA
    # imported only now: without CUDA the check answers after importing torch alone
    from bench.gpu_check.context import CheckContext
    from bench.pad_target import cache_base

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float32
    if cuda:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16  # CUDA-only
    work_dir = args.work_dir or cache_base() / "gpu-check"
    work_dir.mkdir(parents=True, exist_ok=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    plan = narrowed(TINY if args.tiny else FULL, args)
    deadline = None if args.seconds is None else report.begin + args.seconds
    ctx = CheckContext(plan, device, dtype, work_dir, report, deadline=deadline, steps_only=args.steps_only)
    report.line(f"# GPU check{' (tiny shapes, test mode)' if args.tiny else ''}")
    for name in names:
        run_section(ctx, name)
    report.line()
    report.line(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
