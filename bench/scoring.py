"""`specexec bench scoring`: how the draft's scoring temperature shapes SpecExec trees for sampled
requests, by the trees' exact expected tokens per pass on the same contexts.

Contexts are windows of held-out Python files (the build's held-out split of this machine's
stdlib; seeded positions). For each context, budget, temperature and scale the engine builds the
first step's tree (draft scores at temperature x scale) and scores it with the target;
StepStats.expected_accepted is E[accepted | tree] under sample-and-match, so no sampling noise
enters: differences between scales are paired on identical contexts, and the standard error is
that of the paired difference to scale 1.

    specexec bench scoring --budgets 256,1024 --temperatures 0.6,1.0 --scales 0.8,0.9,1,1.1,1.25
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from builder import training as tr
from engine.cli import DEFAULT_MODELS, CliError, comma_list
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams

HELDOUT_MOD = 50  # build-default's held-out split


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"), help="target checkpoint folder")
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"), help="draft checkpoint folder")
    parser.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]), help="held-out source")
    parser.add_argument("--budgets", type=comma_list(int), default=[256, 1024], help="comma list")
    parser.add_argument("--temperatures", type=comma_list(float), default=[0.6, 1.0], help="comma list")
    parser.add_argument("--scales", type=comma_list(float), default=[0.8, 0.9, 1.0, 1.1, 1.25], help="comma list")
    parser.add_argument("--contexts", type=int, default=48, help="held-out windows")
    parser.add_argument("--context-tokens", type=int, default=160, help="tokens per window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=None, help="write scoring.md and scoring.json here")


def contexts(tokenizer, corpus: Path, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens at seeded positions of the held-out files."""
    texts = tr.read_texts(corpus, tr.list_corpus_files(corpus), HELDOUT_MOD)[1]
    ids = [tokenizer.encode(text) for text in texts]
    ids = [doc for doc in ids if len(doc) > length + 1]
    if not ids:
        raise CliError(f"--corpus {corpus}: no held-out file longer than {length} tokens")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        doc = ids[rng.randrange(len(ids))]
        start = rng.randrange(len(doc) - length)
        out.append(doc[start : start + length])
    return out


def first_step_expectation(engine: Engine, prompt: list[int], temperature: float, seed: int) -> float:
    """E[accepted | tree] of the first step's tree for `prompt` (the request is dropped after it)."""
    params = SamplingParams(
        temperature=temperature, seed=seed, max_tokens=engine.config.speculation.max_depth + 1, ignore_eos=True
    )
    for delta in engine.generate(Request("scoring", prompt, params)):
        assert delta.stats is not None and delta.stats.expected_accepted is not None
        return delta.stats.expected_accepted
    raise AssertionError("no step")


def paired(values: list[float], base: list[float]) -> tuple[float, float]:
    """Mean of values - base and its standard error."""
    diffs = [v - b for v, b in zip(values, base, strict=True)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, float("nan")
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs))


def table(results: dict[tuple[int, float, float], list[float]], args: argparse.Namespace) -> str:
    lines = [
        "| budget | T | scale | expected tokens/pass | vs scale 1 |",
        "|---|---|---|---|---|",
    ]
    for budget in args.budgets:
        for temperature in args.temperatures:
            base = results.get((budget, temperature, 1.0))
            for scale in args.scales:
                values = results[budget, temperature, scale]
                mean = 1 + sum(values) / len(values)
                delta = "-"
                if base is not None and scale != 1.0:
                    diff, se = paired(values, base)
                    delta = f"{diff:+.3f} ± {se:.3f}"
                lines.append(f"| {budget} | {temperature:g} | {scale:g} | {mean:.3f} | {delta} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    base = Engine.load(EngineConfig(
        model=ModelConfig(target=args.target, draft=args.draft),
        speculation=SpeculationConfig(budget=max(args.budgets)),
        limits=LimitsConfig(max_running=1, prefix_cache_slots=0),
    ))
    windows = contexts(base.tokenizer, args.corpus, args.contexts, args.context_tokens, args.seed)
    results: dict[tuple[int, float, float], list[float]] = {}
    total = len(args.budgets) * len(args.temperatures) * len(args.scales) * len(windows)
    with tqdm(total=total, unit="tree", dynamic_ncols=True) as bar:
        for budget in args.budgets:
            for scale in args.scales:
                spec = dataclasses.replace(base.config.speculation, budget=budget, sampled_tree_temperature_scale=scale)
                engine = base.with_speculation(spec)
                for temperature in args.temperatures:
                    results[budget, temperature, scale] = []
                    for idx, window in enumerate(windows):
                        results[budget, temperature, scale].append(
                            first_step_expectation(engine, window, temperature, args.seed + idx)
                        )
                        bar.update(1)
    text = (
        f"# specexec bench scoring\n\n{len(windows)} held-out windows of {args.context_tokens} tokens; "
        f"expected tokens/pass = 1 + E[accepted | first tree]; ± = standard error of the paired "
        f"difference. {(time.time() - started) / 60:.1f} min.\n\n" + table(results, args)
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scoring.md").write_text(text)
        raw = {f"{b},{t},{s}": v for (b, t, s), v in results.items()}
        (args.out / "scoring.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "raw": raw}))
    return 0
