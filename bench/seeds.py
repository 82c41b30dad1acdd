"""`python -m bench.seeds`: what overlap's extensions leave the next step, on a pair whose trees are deep.

The pair is gpu-check's aligned random pair at its tiny CPU shape (bench.gpu_check.fullshape_build: the
target's logits are the draft's, sharper, so a greedy tree's best path is accepted and a step emits ~18
tokens, as a 70B pair with a good draft does), every target pass slowed to `--slow-pass-ms` with a host sleep
(a copy-bound pass that leaves the CPU to the draft, as bench.overlap's). Per budget x streams x (overlap off;
on at each extension factor): over the steps after the first two, tokens a pass, draft forwards before the
pass and during it, trees grown from a seed a step, draft ms and tokens/s, and a digest of every request's
tokens (cut to the shortest of the budget x streams' rows), the same in every row of a budget x streams.

    python -m bench.seeds [--budgets 256 1024] [--streams 1 2] [--factors 2 8] [--slow-pass-ms 150] [--steps 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics

import torch

from bench import module_main
from bench.gpu_check.fullshape import run_steps
from bench.gpu_check.fullshape_build import build_engine
from bench.gpu_check.plan import TINY
from bench.overlap import slow_passes
from engine.config import EXTENSION_FACTOR
from engine.runtime import Engine
from engine.types import Request, SamplingParams

WARMUP_STEPS = 2  # the prefill step, and one to grow a first seed from


def row(engine: Engine, budget: int, streams: int, factor: int | None, steps: int) -> dict:
    """factor None: overlap off."""
    spec = dataclasses.replace(engine.config.speculation, budget=budget, overlap=factor is not None,
                               extension_factor=factor or EXTENSION_FACTOR)
    requests = [Request(f"b{budget}-s{streams}-f{factor}-{i}",
                        torch.randint(3, TINY.full.vocab_size, (16,), generator=torch.Generator().manual_seed(i)).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=40 * steps, ignore_eos=True)) for i in range(streams)]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    stats = run_steps(engine.with_speculation(spec), requests, WARMUP_STEPS, steps - WARMUP_STEPS, tokens)

    def mean(field: str) -> float:
        return statistics.mean(getattr(s, field) for s in stats)

    return {"budget": budget, "streams": streams, "factor": factor, "tokens_per_pass": mean("num_emitted"),
            "before": mean("draft_forwards"), "during": mean("extension_forwards"), "seeded": mean("seeded_trees"),
            "draft_ms": 1e3 * mean("draft_seconds"),
            "tokens_per_s": sum(s.num_emitted for s in stats) / sum(s.step_seconds for s in stats),
            "tokens": list(tokens.values())}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    full = dataclasses.replace(TINY.full, budgets=(max(args.budgets),), streams=(max(args.streams),), max_context=4096)
    engine = build_engine(full, torch.device("cpu"), torch.float32, seed=0)
    slow_passes(engine, args.slow_pass_ms / 1000)
    print(f"aligned random pair (tiny shape), CPU, {torch.get_num_threads()} thread(s); greedy; every target pass "
          f">= {args.slow_pass_ms:g} ms; {args.steps} steps, the first {WARMUP_STEPS} not counted")
    print("\n| budget | streams | overlap | tokens/pass | draft forwards before the pass | during it | seeded trees "
          "| draft ms | tokens/s | digest |")
    print("|--:|--:|---|--:|--:|--:|--:|--:|--:|---|")
    ok = True
    try:
        for budget in args.budgets:
            for streams in args.streams:
                rows = [row(engine, budget, streams, factor, args.steps) for factor in [None, *args.factors]]
                # every row's requests to the same length (rows emit different counts in their steps)
                common = min(len(t) for r in rows for t in r["tokens"])
                digests = [hashlib.sha256(repr([t[:common] for t in r["tokens"]]).encode()).hexdigest()[:12]
                           for r in rows]
                for r, digest in zip(rows, digests, strict=True):
                    overlap = "off" if r["factor"] is None else f"on, {r['factor']}x"
                    print(f"| {budget} | {streams} | {overlap} | {r['tokens_per_pass']:.2f} | {r['before']:.1f} | "
                          f"{r['during']:.1f} | {r['seeded']:.2f} / {streams} | {r['draft_ms']:.1f} | "
                          f"{r['tokens_per_s']:.1f} | {digest} |", flush=True)
                ok &= len(set(digests)) == 1
    finally:
        engine.close()
    if not ok:
        print("MISMATCH: a row's tokens differ from overlap off's")
    return 0 if ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budgets", type=int, nargs="*", default=[256, 1024], help="tree budgets")
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 2], help="requests run together (at most 2)")
    parser.add_argument("--factors", type=int, nargs="*", default=[2, 8], help="extension factors, overlap on")
    parser.add_argument("--slow-pass-ms", type=float, default=150.0, help="every target pass lasts at least this")
    parser.add_argument("--steps", type=int, default=12, help="engine steps a row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


if __name__ == "__main__":
    module_main("bench.seeds", __doc__, add_arguments, run)
