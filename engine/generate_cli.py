"""`specexec generate`: complete one prompt; only the completion goes to stdout."""

from __future__ import annotations

import argparse
import sys

from engine.cli import CliError
from engine.config import EngineConfig
from engine.runtime import Engine
from engine.types import GenerationStats, Request, SamplingParams


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="prompt text (raw, no chat template)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stats", action="store_true", help="speculation statistics to stderr")


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
    params = sampling_from_args(args)
    engine = Engine.load(config)
    if engine.tokenizer is None:
        raise CliError(f"{config.model.target}: no tokenizer files; generate needs one")
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
