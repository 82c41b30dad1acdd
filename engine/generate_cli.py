"""`specexec generate`: complete one prompt; only the completion goes to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from engine.cli import CliError
from engine.config import EngineConfig
from engine.types import GenerationStats, Request, SamplingParams

if TYPE_CHECKING:
    from engine.runtime import Engine


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generate")
    group.add_argument("--prompt", required=True, help="prompt text (raw, no chat template)")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampling")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability "
                       "(default 0: off)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one per run)")
    group.add_argument("--stats", action="store_true", help="speculation statistics to stderr")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def format_stats(totals: GenerationStats) -> str:
    decode = totals.decode_seconds or float("nan")
    return (
        f"prompt_tokens={totals.prompt_tokens} completion_tokens={totals.completion_tokens} "
        f"target_passes={totals.target_passes} accepted_tokens={totals.accepted_tokens} "
        f"tokens_per_pass={totals.mean_accepted_per_pass:.2f} "
        f"prefill_s={totals.prefill_seconds:.3f} decode_s={totals.decode_seconds:.3f} "
        f"draft_s={totals.draft_seconds:.3f} target_s={totals.target_seconds:.3f} "
        f"tokens_per_s={totals.completion_tokens / decode:.2f}"
    )


def run_generate(config: EngineConfig, args: argparse.Namespace) -> int:
    from engine.runtime import Engine  # here, so `specexec --help` imports no torch

    params = sampling_from_args(args)
    with Engine.load(config) as engine:
        return complete(engine, args, params, config.model.target)


def complete(engine: Engine, args: argparse.Namespace, params: SamplingParams, target: str) -> int:
    if engine.tokenizer is None:
        raise CliError(f"{target}: no tokenizer files; generate needs one")
    # as /v1/completions encodes a text prompt (BOS where the tokenizer adds one), so both give the same text
    prompt_ids = engine.tokenizer.encode(args.prompt, add_special_tokens=True)
    if not prompt_ids:
        raise CliError("--prompt is empty")
    token_ids: list[int] = []
    totals = None
    for delta in engine.generate(Request("cli", prompt_ids, params)):
        token_ids.extend(delta.token_ids)
        totals = delta.totals or totals
    sys.stdout.write(engine.tokenizer.decode(token_ids, skip_special_tokens=True))
    sys.stdout.write("\n")
    if args.stats and totals is not None:
        print(format_stats(totals), file=sys.stderr)
    return 0
