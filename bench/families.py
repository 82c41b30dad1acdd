"""`python -m bench.families`: does the generic layer path cost anything against the hand-written one?

Per-pass time of the engine's generic path (each family's own transformers decoder layer, with the
engine's attention registered through transformers' attention interface) against the hand-written
Llama layer path it replaced (bench.handwritten), on the same runner, weights and streamer:
- the built-in pair's target and draft, resident, at a few token counts;
- a Llama-shaped padded target (bench.pad_target: the built-in target widened with zero MLP units and
  zero-output layers to ~128 MB layers), every layer streamed from RAM through a ring of 2.
Single passes of the two paths are timed back to back in pairs, so a shared machine's slow phases hit
both alike; the table gives each path's median and the median of the pairs' ratios. Resident passes are
timed in CPU time of the computing thread (all their work runs there, one torch thread), streamed passes
in wall time (the loader thread's copies overlap compute). The two paths' logits are checked equal first.
`--baseline today`: the hand-written layer step calling the engine's attention of today instead
(bench.handwritten.HandwrittenTodayRunner), so that only transformers' own per-layer Python differs.

    python -m bench.families [--tokens 1 32 256] [--padded-tokens 1 32] [--pad-to-gb 1] [--pairs 300]
                             [--baseline old|today]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.handwritten import HandwrittenRunner, HandwrittenTodayRunner
from bench.offload import load_unmapped, set_threads
from bench.pad_target import cache_root, pad_checkpoint
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, ModelConfig, OffloadConfig
from engine.model.runner import DecoderRunner
from engine.offload.build import build_offloaded_runner
from engine.offload.ring import LayerStreamer
from engine.speculation.tree import causal_mask

GOAL = 1.05  # generic / hand-written per-pass time
BASELINES = {"old": HandwrittenRunner, "today": HandwrittenTodayRunner}  # --baseline: the hand-written step's attention


def runner_pair(folder: str, streamed: bool, ring_size: int = 2, baseline: str = "old") -> tuple[DecoderRunner, DecoderRunner]:
    """(hand-written, generic) runners over one loaded model (and one streamer when streamed from RAM)."""
    model = load_unmapped(folder)
    hand = BASELINES[baseline]
    if not streamed:
        return hand(model), DecoderRunner(model)
    offload = OffloadConfig(enabled=True, source="ram", resident_layers=0, ring_size=ring_size)
    generic = build_offloaded_runner(model, EngineConfig(model=ModelConfig(target=folder), offload=offload),
                                     torch.device("cpu"))
    return hand(model, generic.layers), generic


def check_equal(pair: tuple[DecoderRunner, DecoderRunner], num_tokens: int = 9) -> float:
    """Largest |logit difference| of the two paths on one causal pass."""
    ids, positions = torch.arange(3, 3 + num_tokens), torch.arange(num_tokens)
    outs = [runner.forward(ids, positions, runner.new_cache(num_tokens), 0, causal_mask(num_tokens, 0, ids.device))
            for runner in pair]
    return float((outs[0] - outs[1]).abs().max())


class PassTimer:
    """Times single causal passes of one runner over `num_tokens` tokens from slot 0: CPU time of this
    thread for a resident runner (all its work runs there), wall time for a streamed one (whose loader
    thread's copies overlap compute; it refills the ring before the next timing)."""

    def __init__(self, runner: DecoderRunner, num_tokens: int):
        self.runner = runner
        self.streamed = isinstance(runner.layers, LayerStreamer)
        self.clock = time.perf_counter if self.streamed else time.thread_time
        self.ids, self.positions = torch.arange(num_tokens) % runner.vocab_size, torch.arange(num_tokens)
        self.mask, self.cache = causal_mask(num_tokens, 0, self.ids.device), runner.new_cache(num_tokens)
        self.once()  # warm-up

    def once(self) -> float:
        begin = self.clock()
        self.runner.forward(self.ids, self.positions, self.cache, 0, self.mask)
        seconds = self.clock() - begin
        if self.streamed:
            self.runner.layers.wait_prefetched()
        return seconds


def measure_pairs(pair: tuple[DecoderRunner, DecoderRunner], num_tokens: int, num_pairs: int) -> tuple[float, float, float]:
    """(hand-written s, generic s, generic / hand-written): single passes of the two paths timed back to
    back in pairs (order alternating), so both see the same conditions of a shared machine; the times
    are each path's median, the ratio the median of the pairs' ratios."""
    timers = [PassTimer(runner, num_tokens) for runner in pair]
    times: list[list[float]] = [[], []]
    for i in range(num_pairs):
        for path in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[path].append(timers[path].once())
    ratios = [generic / hand for hand, generic in zip(*times, strict=True)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios)


def measure(cases: list[tuple[str, tuple[DecoderRunner, DecoderRunner], list[int]]], num_pairs: int,
            streamed_pairs: int) -> list[tuple[str, int, float, float, float]]:
    """(case, tokens, hand-written s, generic s, ratio) of every case and token count."""
    rows = []
    for name, pair, tokens in cases:
        pairs = streamed_pairs if isinstance(pair[1].layers, LayerStreamer) else num_pairs
        rows += [(name, n, *measure_pairs(pair, n, pairs)) for n in tokens]
    return rows


def print_table(rows: list[tuple[str, int, float, float, float]]) -> None:
    print("| model | tokens | hand-written ms | generic ms | generic / hand-written |")
    print("|---|--:|--:|--:|--:|")
    for name, num_tokens, hand, generic, ratio in rows:
        print(f"| {name} | {num_tokens} | {hand * 1e3:.2f} | {generic * 1e3:.2f} | {ratio:.3f}"
              f"{'' if ratio <= GOAL else ' (over the 5% goal)'} |")


def run(args: argparse.Namespace) -> int:
    set_threads(args.threads, torch.device("cpu"))
    padded, plan = pad_checkpoint(DEFAULT_MODELS / "target", cache_root(), args.pad_to_gb)
    cases = [
        ("built-in target, resident", runner_pair(str(DEFAULT_MODELS / "target"), False, baseline=args.baseline),
         args.tokens),
        ("built-in draft, resident", runner_pair(str(DEFAULT_MODELS / "draft"), False, baseline=args.baseline), args.tokens),
        (f"padded target ({plan.num_layers} x {plan.layer_bytes / 1e6:.0f} MB layers), streamed from RAM",
         runner_pair(str(padded), True, baseline=args.baseline), args.padded_tokens),
    ]
    for name, pair, _ in cases:
        error = check_equal(pair)
        assert error < 1e-4, f"{name}: the two paths' logits differ by {error}"
    rows = measure(cases, args.pairs, args.streamed_pairs)
    print(f"CPU, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), fp32; {args.pairs} pairs of "
          f"single passes ({args.streamed_pairs} streamed), the two paths back to back; median times and median "
          f"ratio of a causal pass over `tokens` tokens (resident: CPU time of the computing thread; streamed: "
          f"wall time); hand-written baseline: {args.baseline}\n")
    print_table(rows)
    for _, pair, _ in cases:
        if hasattr(pair[1].layers, "close"):
            pair[1].layers.close()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256], help="tokens per resident pass")
    parser.add_argument("--padded-tokens", type=int, nargs="+", default=[1, 32], help="tokens per streamed pass")
    parser.add_argument("--pad-to-gb", type=float, default=1.0, help="padded target's size (fp32 GB)")
    parser.add_argument("--pairs", type=int, default=300, help="pairs of resident passes (one of each path)")
    parser.add_argument("--streamed-pairs", type=int, default=15, help="pairs of streamed passes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores but one)")
    parser.add_argument("--baseline", choices=sorted(BASELINES), default="old",
                        help="the hand-written step's attention: old (per-layer cache write and view, as before "
                             "issue 35) or today (the engine's attention the generic path calls)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
