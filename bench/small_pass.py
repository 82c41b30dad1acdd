"""`python -m bench.small_pass`: the fixed cost of a small draft pass, and the draft's time per step.

1. Per pass: the built-in draft's `forward_groups` over one tree-shaped segment as a draft expansion makes
   it (`tokens` nodes after a committed prefix, an explicit ancestor mask, positions prefix + depth), timed
   in CPU time of the computing thread (all its work runs there, one torch thread); the median of `--passes`.
2. Per step: the built-in pair (both resident, overlap off), greedy requests at each budget; the median and
   mean of the steps' `draft_seconds` (the whole draft phase: catch-up, every tree forward, the growth's own
   tensor work), the mean wall time of its draft passes, draft passes per step, the growth's own time per
   draft pass (the draft phase less its passes: selection, masks, the tree's bookkeeping), and a digest of
   every emitted token id (equal digests: the same text, token for token, e.g. before and after a change).

    python -m bench.small_pass [--tokens 1 8 32] [--budgets 16 64] [--passes 2000] [--num-prompts 4]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from bench import module_main
from bench.offload import load_unmapped
from bench.prompts import encode_prompt, select_prompts
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.model.runner import DecoderRunner, Segment
from engine.runtime import Engine
from engine.types import Request, SamplingParams

PREFIX_LEN = 200  # committed slots before the tree
CACHE_SLOTS = 1024


def tree_segment(runner: DecoderRunner, cache, num_tokens: int, seed: int, prefix_len: int = PREFIX_LEN) -> Segment:
    """`num_tokens` nodes of a tree whose root sits at slot `prefix_len`, written after 4 earlier nodes: each
    sees the prefix and about half of the tree slots before it; positions prefix + depth (1-4); on the
    cache's device."""
    gen = torch.Generator().manual_seed(seed)
    start = prefix_len + 5
    allowed = torch.rand(num_tokens, start + num_tokens, generator=gen) < 0.5
    allowed[:, :prefix_len] = True
    positions = prefix_len + torch.randint(1, 5, (num_tokens,), generator=gen)
    ids = torch.randint(3, runner.vocab_size, (num_tokens,), generator=gen)
    device = cache.device
    return Segment(ids.to(device), positions.to(device), cache, start, allowed.to(device))


def prefilled_cache(runner: DecoderRunner, prefix_len: int = PREFIX_LEN, slots: int = CACHE_SLOTS):
    """A cache of `slots` slots holding `prefix_len` committed tokens (the prefix a tree_segment follows)."""
    cache = runner.new_cache(slots)
    runner.prefill(torch.arange(3, 3 + prefix_len, device=cache.device), cache, 512)
    cache.length = prefix_len
    return cache


def pass_times(tokens: list[int], num_passes: int) -> dict[int, float]:
    """tokens -> median seconds (thread CPU time) of one draft pass over that many tree nodes."""
    runner = DecoderRunner(load_unmapped(str(DEFAULT_MODELS / "draft")))
    cache = prefilled_cache(runner)
    out = {}
    for num_tokens in tokens:
        groups = [[tree_segment(runner, cache, num_tokens, num_tokens)]]
        for _ in range(20):  # warm-up
            runner.forward_groups(groups)
        times = []
        for _ in range(num_passes):
            begin = time.thread_time()
            runner.forward_groups(groups)
            times.append(time.thread_time() - begin)
        out[num_tokens] = statistics.median(times)
    return out


class PassCounter:
    """Counts a runner's passes and their wall time (an instance attribute shadows forward_groups)."""

    def __init__(self, runner: DecoderRunner):
        self.runner, self.count, self.seconds = runner, 0, 0.0
        forward_groups = runner.forward_groups

        def counted(groups):
            begin = time.perf_counter()
            out = forward_groups(groups)
            self.seconds += time.perf_counter() - begin
            self.count += 1
            return out

        runner.forward_groups = counted

    def remove(self) -> None:
        del self.runner.forward_groups


def step_times(budgets: list[int], num_prompts: int, max_tokens: int) -> list[dict]:
    """Per budget: draft ms per step (median, mean), draft passes per step, tokens per step, digest."""
    base = Engine.load(EngineConfig(
        model=ModelConfig(target=str(DEFAULT_MODELS / "target"), draft=str(DEFAULT_MODELS / "draft")),
        speculation=SpeculationConfig(budget=max(budgets), overlap=False),
        limits=LimitsConfig(max_context=1024, max_running=1, prefix_cache_slots=0),
    ))
    prompts = [encode_prompt(base.tokenizer, kind, text) for kind, text in select_prompts("mixed", num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for budget in budgets:
        engine = base.with_speculation(SpeculationConfig(budget=budget, overlap=False))
        engine.generate_ids(prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        counter = PassCounter(engine.pair.draft)
        steps, digest, passes, forward_seconds = [], hashlib.sha256(), 0, 0.0
        for index, prompt in enumerate(prompts):
            for number, delta in enumerate(engine.generate(Request(f"p{index}", prompt, params))):
                digest.update(repr(delta.token_ids).encode())
                if number and delta.stats is not None:  # the first step also writes the prompt
                    steps.append(delta.stats)
                    passes, forward_seconds = passes + counter.count, forward_seconds + counter.seconds
                counter.count, counter.seconds = 0, 0.0
        counter.remove()
        draft = [s.draft_seconds for s in steps]
        rows.append({"budget": budget, "draft_ms_median": 1e3 * statistics.median(draft),
                     "draft_ms_mean": 1e3 * statistics.mean(draft), "steps": len(steps),
                     "draft_passes_per_step": passes / len(steps),
                     "forward_ms_mean": 1e3 * forward_seconds / len(steps),
                     "tokens_per_step": statistics.mean(s.num_emitted for s in steps),
                     "digest": digest.hexdigest()[:16]})
    base.close()
    return rows


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    print(f"CPU, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), fp32")
    if args.tokens:
        print("| draft pass, tokens | ms (median, thread CPU time) |\n|--:|--:|")
        for num_tokens, seconds in pass_times(args.tokens, args.passes).items():
            print(f"| {num_tokens} | {seconds * 1e3:.3f} |")
    if args.budgets:
        print("\n| budget | draft ms / step (median) | mean | of it in draft passes (mean) | draft passes / step | "
              "growth's own ms / draft pass | tokens / step | steps | digest |")
        print("|--:|--:|--:|--:|--:|--:|--:|--:|---|")
        for row in step_times(args.budgets, args.num_prompts, args.max_tokens):
            own = (row["draft_ms_mean"] - row["forward_ms_mean"]) / row["draft_passes_per_step"]
            print(f"| {row['budget']} | {row['draft_ms_median']:.2f} | {row['draft_ms_mean']:.2f} | "
                  f"{row['forward_ms_mean']:.2f} | {row['draft_passes_per_step']:.2f} | {own:.2f} | "
                  f"{row['tokens_per_step']:.2f} | {row['steps']} | {row['digest']} |")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 32], help="tree nodes per timed draft pass")
    parser.add_argument("--passes", type=int, default=2000, help="timed passes per token count")
    parser.add_argument("--budgets", type=int, nargs="*", default=[16, 64], help="tree budgets of the step rows")
    parser.add_argument("--num-prompts", type=int, default=4, help="greedy requests per budget")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


if __name__ == "__main__":
    module_main("bench.small_pass", __doc__, add_arguments, run)
