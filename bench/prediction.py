"""`python -m bench.prediction`: predicted outputs (OpenAI's `prediction`) on the built-in pair.

Per budget and max_depth: greedy code completions generated plainly, then with the plain answer as the
request's prediction (an edit that changes nothing), then with a few tokens of it replaced in the middle
(an edit): target passes per request and tokens per pass; every text must equal the plain one (it is the
target's whatever the prediction says). Greedy chains reach past max_depth (up to half the budget).

    python -m bench.prediction [--budgets 64 256] [--max-depths 8 32] [--num-prompts 3] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import module_main
from bench.prompts import encode_prompt, select_prompts
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams

EDIT_AT = 0.5  # the edited prediction: tokens replaced at this fraction of the answer
EDIT_TOKENS = 3


def passes(engine: Engine, prompt: list[int], params: SamplingParams, prediction: list[int] | None) -> tuple[list[int], int]:
    """(emitted tokens, target passes: one a delta, the first also writing the prompt)."""
    deltas = list(engine.generate(Request("p", prompt, params, prediction_ids=prediction)))
    return [t for d in deltas for t in d.token_ids], len(deltas)


def rows(args: argparse.Namespace) -> list[dict]:
    base = Engine.load(EngineConfig(
        model=ModelConfig(target=str(DEFAULT_MODELS / "target"), draft=str(DEFAULT_MODELS / "draft")),
        speculation=SpeculationConfig(budget=max(args.budgets), overlap=False),
        limits=LimitsConfig(max_running=1, prefix_cache_slots=0)))
    prompts = [encode_prompt(base.tokenizer, kind, text) for kind, text in select_prompts("code", args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out = []
    for budget in args.budgets:
        for max_depth in args.max_depths:
            engine = base.with_speculation(SpeculationConfig(budget=budget, max_depth=max_depth, overlap=False))
            counts: dict[str, list[int]] = {"plain": [], "same": [], "edited": []}
            same_text = True
            for prompt in prompts:
                answer, plain = passes(engine, prompt, params, None)
                cut = int(len(answer) * EDIT_AT)
                edited = answer[:cut] + [(t + 1) % engine.pair.target.vocab_size for t in answer[cut:cut + EDIT_TOKENS]] \
                    + answer[cut + EDIT_TOKENS:]
                text_same, same = passes(engine, prompt, params, answer)
                text_edited, edited_passes = passes(engine, prompt, params, edited)
                same_text &= text_same == answer and text_edited == answer
                for key, value in (("plain", plain), ("same", same), ("edited", edited_passes)):
                    counts[key].append(value)
            out.append({"budget": budget, "max_depth": max_depth, "tokens": args.max_tokens, "same_text": same_text,
                        **{key: statistics.mean(values) for key, values in counts.items()}})
    base.close()
    return out


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    print(f"built-in pair, CPU, greedy code completions of {args.max_tokens} tokens, {args.num_prompts} prompts; "
          "target passes per request (tokens per pass)")
    print("\n| budget | max_depth | plain | the answer as prediction | an edited answer | same text |")
    print("|--:|--:|--:|--:|--:|---|")
    ok = True
    for row in rows(args):
        per = {key: f"{row[key]:.1f} ({row['tokens'] / row[key]:.1f})" for key in ("plain", "same", "edited")}
        print(f"| {row['budget']} | {row['max_depth']} | {per['plain']} | {per['same']} | {per['edited']} | "
              f"{'yes' if row['same_text'] else 'NO'} |")
        ok &= row["same_text"]
    return 0 if ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budgets", type=int, nargs="*", default=[64, 256], help="tree budgets")
    parser.add_argument("--max-depths", type=int, nargs="*", default=[8, 32], help="--max-depth values")
    parser.add_argument("--num-prompts", type=int, default=3, help="code prompts per row")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


if __name__ == "__main__":
    module_main("bench.prediction", __doc__, add_arguments, run)
