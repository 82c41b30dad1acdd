"""`python -m bench.forest`: the growth's own work a draft forward, one growth per tree vs the streams' trees as
one forest (--forest), on the built-in pair.

Per budget x streams x forest off / on: S greedy requests run together to the end; over the steps after
admission, the growth's own host ms a draft pass (the draft step's time less its draft passes') and its own
tensor ops a draft pass (kernels; views not counted: on a GPU each is a launch), draft passes a step, and a
digest of every request's tokens, which must be the same both ways.

    python -m bench.forest [--budgets 64 256 1024] [--streams 1 4] [--max-tokens 48] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from bench import module_main
from bench.ops import OpCounter
from bench.prompts import encode_prompt, select_prompts
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation import batch as batch_module
from engine.types import Request, SamplingParams


@dataclass
class GrowthTotals:
    """What the growths of the measured steps cost (engine.speculation.batch.grow_trees, the draft prefills in it)."""

    seconds: float = 0.0  # the draft phase, host time
    pass_seconds: float = 0.0  # of it in draft passes
    passes: int = 0
    ops: int = 0  # tensor ops outside the draft passes (when counted)
    steps: int = 0

    def own_ms(self) -> float:
        """The growth's own host ms a draft pass."""
        return 1e3 * (self.seconds - self.pass_seconds) / max(self.passes, 1)


@contextmanager
def measured_growth(engine: Engine, count_ops: bool) -> Iterator[GrowthTotals]:
    """While inside, every step's tree growth is timed (and its ops counted: slower) into the totals."""
    totals, draft = GrowthTotals(), engine.pair.draft
    counter = OpCounter(kernels_only=True) if count_ops else None
    forward_groups, grow_trees = draft.forward_groups, batch_module.grow_trees

    def timed_pass(groups):
        if counter is not None:
            counter.on = False
        begin = time.perf_counter()
        try:
            return forward_groups(groups)
        finally:
            totals.pass_seconds += time.perf_counter() - begin
            totals.passes += 1
            if counter is not None:
                counter.on = True

    def timed_growth(items, forwards):
        begin = time.perf_counter()
        try:
            if counter is None:
                return grow_trees(items, forwards)
            with counter:
                return grow_trees(items, forwards)
        finally:
            totals.seconds += time.perf_counter() - begin
            totals.steps += 1

    draft.forward_groups, batch_module.grow_trees = timed_pass, timed_growth
    try:
        yield totals
    finally:
        draft.forward_groups, batch_module.grow_trees = forward_groups, grow_trees
        totals.ops = 0 if counter is None else counter.count


def run_together(engine: Engine, prompts: list[list[int]], params: SamplingParams, count_ops: bool
                 ) -> tuple[list[list[int]], GrowthTotals]:
    """The prompts as requests run together to the end: their tokens, and the growth's costs after admission."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for index, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{index}", prompt, params))
    for delta in engine.step().deltas:  # admission: the prompts, the first trees
        tokens[delta.request_id] += delta.token_ids
    with measured_growth(engine, count_ops) as totals:
        while engine.num_running:
            for delta in engine.step().deltas:
                tokens[delta.request_id] += delta.token_ids
    return list(tokens.values()), totals


def rows(args: argparse.Namespace) -> list[dict]:
    base = Engine.load(EngineConfig(
        model=ModelConfig(target=str(DEFAULT_MODELS / "target"), draft=str(DEFAULT_MODELS / "draft")),
        speculation=SpeculationConfig(budget=max(args.budgets), overlap=False),
        limits=LimitsConfig(max_context=1024, max_running=max(args.streams), prefix_cache_slots=0)))
    prompts = [encode_prompt(base.tokenizer, kind, text) for kind, text in select_prompts("mixed", max(args.streams))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out = []
    for budget in args.budgets:
        for streams in args.streams:
            for forest in (False, True):
                engine = base.with_speculation(SpeculationConfig(budget=budget, overlap=False, forest=forest))
                tokens, timed = run_together(engine, prompts[:streams], params, count_ops=False)
                _, counted = run_together(engine, prompts[:streams], params, count_ops=True)
                out.append({"budget": budget, "streams": streams, "forest": forest, "own_ms": timed.own_ms(),
                            "ops": counted.ops / max(counted.passes, 1), "passes": timed.passes / max(timed.steps, 1),
                            "digest": hashlib.sha256(repr(tokens).encode()).hexdigest()[:12]})
    base.close()
    return out


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    print(f"built-in pair, CPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s); greedy, "
          f"{args.max_tokens} tokens a request; the steps after admission")
    print("\n| budget | streams | trees grow | own ms / draft pass | own ops / draft pass | draft passes / step | digest |")
    print("|--:|--:|---|--:|--:|--:|---|")
    digests: dict[tuple[int, int], str] = {}
    ok = True
    for row in rows(args):
        key = (row["budget"], row["streams"])
        ok &= digests.setdefault(key, row["digest"]) == row["digest"]
        print(f"| {row['budget']} | {row['streams']} | {'forest' if row['forest'] else 'per tree'} | "
              f"{row['own_ms']:.2f} | {row['ops']:.0f} | {row['passes']:.1f} | {row['digest']} |")
    if not ok:
        print("MISMATCH: a forest's tokens differ from one growth per tree's")
    return 0 if ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budgets", type=int, nargs="*", default=[64, 256, 1024], help="tree budgets")
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 4], help="requests run together")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


if __name__ == "__main__":
    module_main("bench.forest", __doc__, add_arguments, run)
