"""`specexec bench self-draft`: tokens per target pass with the self-draft (`--draft self`) against the
pair's own draft, by temperature and budget, with standard errors, and the draft's cost per step.

For each pair (--pairs: target folder, draft folder), the target is loaded once with its own draft and
once with the self-draft (every layer a 4-bit copy: a resident target), and, at --half-budgets, once
streamed with half its layers resident (shared with the self-draft at full precision, the rest copied).
Every (temperature, budget) runs every prompt once, unseeded as clients send requests, so at temperatures
>= speculation.specinfer_temperature (0.85) both drafts grow SpecInfer trees, as the server does. Standard errors are clustered by prompt (bench.report.ratio_with_se). Writes raw.json, bench.md
and tokens_per_pass.png to --out (bench.self_draft_report).

    specexec bench self-draft --pairs models/default/target,models/default/draft --out docs/bench/self-draft
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.prompts import encode_prompt, select_prompts
from bench.self_draft_report import write_report
from engine.cli import DEFAULT_MODELS, comma_list
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model.checkpoint import load_tokenizer
from engine.runtime import Engine
from engine.types import Request, SamplingParams

DEFAULT_PAIR = f"{DEFAULT_MODELS / 'target'},{DEFAULT_MODELS / 'draft'}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", nargs="+", default=[DEFAULT_PAIR], metavar="TARGET,DRAFT",
                        help="trained pairs: target folder,draft folder (default: the built-in pair)")
    parser.add_argument("--names", type=comma_list(str), default=None, help="a label per pair (default: folder names)")
    parser.add_argument("--temperatures", type=comma_list(float), default=[0.0, 0.6, 1.0])
    parser.add_argument("--budgets", type=comma_list(int), default=[64, 256, 1024])
    parser.add_argument("--num-prompts", type=int, default=8, help="code prompts (bench.prompts)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--specinfer-temperature", type=float, default=SpeculationConfig.specinfer_temperature,
                        help="speculation.specinfer_temperature: requests at this temperature or above grow SpecInfer trees")
    parser.add_argument("--max-depth", type=int, default=SpeculationConfig.max_depth,
                        help="speculation.max_depth: deepest tree node (a tree's tokens per pass are at most this + 1)")
    parser.add_argument("--half-budgets", type=comma_list(int), default=[],
                        help="at these budgets also the self-draft of a target streamed from RAM with half its layers "
                             "resident (shared with the draft at full precision)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default="self-draft-bench", help="output folder")


def speculation(args: argparse.Namespace, budget: int) -> SpeculationConfig:
    return SpeculationConfig(budget=budget, max_depth=args.max_depth, specinfer_temperature=args.specinfer_temperature)


def engine_for(target: str, draft: str, spec: SpeculationConfig, half: bool = False) -> Engine:
    offload = OffloadConfig()
    if half:
        num_layers = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
        offload = OffloadConfig(enabled=True, resident_layers=num_layers // 2)
    return Engine.load(EngineConfig(
        model=ModelConfig(target=target, draft=draft),
        speculation=spec,
        offload=offload,
        limits=LimitsConfig(max_context=512, max_running=1, prefix_cache_slots=0),
    ))


class DraftMeter:
    """The draft's passes during decoding: how many, and the wall time inside them."""

    def __init__(self, runner):
        self.runner, self.forwards, self.seconds = runner, 0, 0.0
        inner = runner.forward_groups

        def metered(groups: list) -> list:
            begin = time.perf_counter()
            out = inner(groups)
            self.forwards += 1
            self.seconds += time.perf_counter() - begin
            return out

        runner.forward_groups = metered  # instance attribute shadows the method

    def take(self) -> tuple[int, float]:
        taken, self.forwards, self.seconds = (self.forwards, self.seconds), 0, 0.0
        return taken

    def remove(self) -> None:
        del self.runner.forward_groups


def run_cell(engine: Engine, prompts: list[list[int]], temperature: float, args: argparse.Namespace,
             bar: tqdm) -> dict:
    """Every prompt once at `temperature`, unseeded (the server's trees): per prompt, tokens per step
    (accepted + bonus), the draft's time per step (engine split, and inside its passes) and its passes."""
    meter = DraftMeter(engine.pair.draft)
    cell: dict = {"temperature": temperature, "budget": engine.budget, "max_depth": engine.config.speculation.max_depth,
                  "prompts": []}
    try:
        for idx, prompt_ids in enumerate(prompts):
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
            steps, draft_s, target_s = [], 0.0, 0.0
            meter.take()
            for delta in engine.generate(Request(f"b{idx}", prompt_ids, params)):
                steps.append(delta.stats.num_accepted + 1)
                draft_s += delta.stats.draft_seconds
                target_s += delta.stats.target_seconds
            forwards, forward_s = meter.take()
            cell["prompts"].append({"steps": steps, "draft_seconds": draft_s, "target_seconds": target_s,
                                    "draft_forward_seconds": forward_s, "draft_forwards": forwards})
            bar.update(1)
    finally:
        meter.remove()
    return cell


def run_variant(target: str, draft: str, half: bool, prompts: list[list[int]], args: argparse.Namespace,
                bar: tqdm) -> list[dict]:
    budgets = args.half_budgets if half else args.budgets
    base = engine_for(target, draft, speculation(args, max(budgets)), half)
    cells = []
    try:
        for budget in budgets:
            engine = base.with_speculation(speculation(args, budget))
            engine.generate_ids(prompts[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
            for temperature in args.temperatures:
                cells.append(run_cell(engine, prompts, temperature, args, bar))
    finally:
        base.close()
    return cells


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    pairs = [tuple(entry.split(",")) for entry in args.pairs]
    names = args.names or [Path(target).parent.name for target, _ in pairs]
    variants = [("pair draft", False, False), ("self-draft", True, False)]
    if args.half_budgets:
        variants.append(("self-draft, half resident", True, True))
    cells_per_pair = (2 * len(args.budgets) + len(args.half_budgets)) * len(args.temperatures)
    total = len(pairs) * cells_per_pair * args.num_prompts
    results = []
    begin = time.perf_counter()
    with tqdm(total=total, desc="self-draft bench", unit="request") as bar:
        for name, (target, draft) in zip(names, pairs, strict=True):
            tokenizer = load_tokenizer(target)
            prompts = [encode_prompt(tokenizer, kind, text) for kind, text in select_prompts("code", args.num_prompts)]
            for label, is_self, half in variants:
                cells = run_variant(target, "self" if is_self else draft, half, prompts, args, bar)
                results.append({"pair": name, "target": target, "draft": label, "cells": cells})
    meta = {"machine": f"{platform.processor() or platform.machine()}, {args.threads} torch thread(s), CPU",
            "torch": torch.__version__, "prompts": args.num_prompts, "max_tokens": args.max_tokens,
            "max_depth": args.max_depth, "specinfer_temperature": args.specinfer_temperature,
            "minutes": round((time.perf_counter() - begin) / 60, 1)}
    paths = write_report(Path(args.out), meta, results)
    print("\n".join(str(path) for path in paths))
    return 0
