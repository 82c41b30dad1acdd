"""How well RRS trees are shaped, replayed offline: `python -m bench.shape_replay [--target DIR --draft DIR]`.

Runs sampled RRS requests at a large budget (1024) and keeps every verified tree with each node's
exact P(the walk reaches it). A tree's E[accepted] is the sum of that over its non-root nodes, and a
subset of it closed under parents and earlier siblings keeps every node's value (a child's
acceptance depends only on the siblings drawn before it). So each tree is cut to the --select nodes
a shape model would pick, and its E[accepted] read off, for:
- own: each request learns from its own earlier trees only, from the prior (rrs_shape before the book);
- book: a request starts from the evidence of the requests before it (rrs_shape.ShapeBook);
- hindsight: the nodes with the largest true values (uses the target, so no growth can: a bound).
Prints the mean over trees, overall and by the step's index in its request.
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections import defaultdict

import torch

from bench.prompts import CODE_PROMPTS
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation import rrs_shape
from engine.speculation.verify import path_probabilities
from engine.types import Request, SamplingParams

STEP_GROUPS = ((0, 3), (3, 6), (6, 10**9))  # a request's steps 1-3, 4-6, 7 on


def capture(args: argparse.Namespace) -> list[dict]:
    """Every verified tree: parents, ranks, true reach, each child's (rank, pi) cell, its request."""
    trees: list[dict] = []
    observe = rrs_shape.TreeShape.observe
    request = [0, 0]  # index, step

    def keep(shape: rrs_shape.TreeShape, tree, node_log_probs: torch.Tensor) -> None:
        reach = path_probabilities(tree, node_log_probs)
        parents, ranks = tree.parents[1:], tree.proposals.ranks[1:]
        ranked = tree.proposals.probs.sort(dim=-1, descending=True).values[parents]  # [n-1, w]
        rank_cell, nll_cell = shape.cells(ranked)
        trees.append({
            "request": request[0], "step": request[1], "parents": tree.parents.tolist(), "ranks": tree.proposals.ranks.tolist(),
            "reach": reach.tolist(), "cells": list(zip(rank_cell.gather(1, ranks[:, None]).squeeze(1).tolist(),
                                                       nll_cell.gather(1, ranks[:, None]).squeeze(1).tolist(), strict=True)),
            "pi": ranked.gather(1, ranks[:, None]).squeeze(1).tolist(),
        })
        request[1] += 1
        observe(shape, tree, node_log_probs)

    rrs_shape.TreeShape.observe = keep
    try:
        engine = Engine.load(EngineConfig(
            model=ModelConfig(target=args.target, draft=args.draft),
            speculation=SpeculationConfig(method="rrs", budget=args.budget, overlap=False),
            limits=LimitsConfig(max_context=1024, max_running=1),
        ))  # fmt: skip
        for index in range(args.num_prompts):
            request[:] = [index, 0]
            params = SamplingParams(temperature=args.temperature, seed=args.seed + index, max_tokens=64, ignore_eos=True)
            for _ in engine.generate(Request(f"r{index}", engine.tokenizer.encode(CODE_PROMPTS[index]), params)):
                pass
    finally:
        rrs_shape.TreeShape.observe = observe
    return trees


def picked_value(tree: dict, scores: list[float], select: int) -> float:
    """E[accepted] of the `select` best-scored nodes (ties by index: parents, earlier siblings first)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: select + 1]
    return sum(tree["reach"][i] for i in order) - 1.0


def model_scores(tree: dict, sums: dict, counts: dict) -> list[float]:
    """Scores as rrs_shape.TreeShape.child_scores gives them from the evidence (sums, counts per cell)."""
    scores = [0.0] * len(tree["parents"])
    last_in_row: dict[int, float] = {}
    for node in range(1, len(scores)):
        parent, cell, pi = tree["parents"][node], tuple(tree["cells"][node - 1]), tree["pi"][node - 1]
        beta = (sums[cell] + rrs_shape.PRIOR_WEIGHT * pi) / (counts[cell] + rrs_shape.PRIOR_WEIGHT)
        score = min(scores[parent] + math.log(max(beta, 1e-30)), last_in_row.get(parent, 0.0), scores[parent])
        scores[node] = last_in_row[parent] = score
    return scores


def learn(tree: dict, memory: float, sums: dict, counts: dict) -> None:
    for cell in list(sums):
        sums[cell] *= memory
        counts[cell] *= memory
    for node in range(1, len(tree["parents"])):
        parent, cell = tree["parents"][node], tuple(tree["cells"][node - 1])
        # P(accepted first | parent reached), weighted by P(parent reached), as TreeShape.observe
        sums[cell] += tree["reach"][node]
        counts[cell] += tree["reach"][parent]


def hindsight(tree: dict, select: int) -> float:
    """Greedy by true reach over nodes whose parent and previous sibling are picked."""
    child = {(p, r): i for i, (p, r) in enumerate(zip(tree["parents"], tree["ranks"], strict=True)) if p >= 0}
    picked, heap, total = 1, [], 0.0
    if (0, 0) in child:
        heap.append((-tree["reach"][child[(0, 0)]], child[(0, 0)]))
    while heap and picked <= select:
        value, node = heapq.heappop(heap)
        total, picked = total - value, picked + 1
        for key in ((node, 0), (tree["parents"][node], tree["ranks"][node] + 1)):
            if key in child:
                heapq.heappush(heap, (-tree["reach"][child[key]], child[key]))
    return total


def replay(trees: list[dict], select: int) -> dict[str, list[tuple[int, float]]]:
    """Per shape model: (step index in its request, E[accepted]) for every tree large enough."""
    results: dict[str, list[tuple[int, float]]] = defaultdict(list)
    book_sums, book_counts = defaultdict(float), defaultdict(float)
    last = -1
    for tree in trees:
        if tree["request"] != last:
            own_sums, own_counts = defaultdict(float), defaultdict(float)
            sums, counts = defaultdict(float, book_sums), defaultdict(float, book_counts)
            last = tree["request"]
        if len(tree["parents"]) > select:
            results["own"].append((tree["step"], picked_value(tree, model_scores(tree, own_sums, own_counts), select)))
            results["book"].append((tree["step"], picked_value(tree, model_scores(tree, sums, counts), select)))
            results["hindsight"].append((tree["step"], hindsight(tree, select)))
        learn(tree, rrs_shape.MEMORY, own_sums, own_counts)
        learn(tree, rrs_shape.MEMORY, sums, counts)
        learn(tree, rrs_shape.BOOK_MEMORY, book_sums, book_counts)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"))
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--budget", type=int, default=1024, help="the trees grown")
    parser.add_argument("--select", type=int, default=256, help="the nodes each shape model keeps")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = replay(capture(args), args.select)
    print(f"T = {args.temperature:g}, trees of {args.budget} cut to {args.select}: mean E[accepted] per tree")
    print("| shape model | all trees | steps 1-3 | steps 4-6 | steps 7+ |\n|---|---|---|---|---|")
    for name, values in results.items():
        cells = [sum(v for _, v in values) / len(values)]
        for low, high in STEP_GROUPS:
            group = [v for step, v in values if low <= step < high]
            cells.append(sum(group) / len(group) if group else float("nan"))
        print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + f" |  ({len(values)} trees)")


if __name__ == "__main__":
    main()
