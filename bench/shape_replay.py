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
    """Every verified tree ([n] tensors): parents, depths, ranks, pis, true reach, acceptance
    (P(accepted first | parent reached)), and its request and step."""
    trees: list[dict] = []
    observe = rrs_shape.TreeShape.observe
    request = [0, 0]  # index, step

    def keep(shape: rrs_shape.TreeShape, tree, node_log_probs: torch.Tensor) -> None:
        trees.append({
            "request": request[0], "step": request[1], "parents": tree.parents, "depths": tree.depths,
            "ranks": tree.proposals.ranks, "pis": tree.proposals.pis,
            "reach": path_probabilities(tree, node_log_probs), "accepted": node_log_probs.exp(),
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


def model_scores(tree: dict, shape: rrs_shape.TreeShape) -> torch.Tensor:
    """[n] the scores `shape` gives the tree's nodes (TreeShape.child_scores over each parent's row,
    level by level; a node's children are a prefix of its row, so their pis are the row's first q)."""
    parents, ranks, depths, pis = tree["parents"], tree["ranks"], tree["depths"], tree["pis"]
    scores = torch.zeros(parents.shape[0])
    for depth in range(1, int(depths.max()) + 1):
        nodes = (depths == depth).nonzero().squeeze(1)
        rows, row_of = parents[nodes].unique(return_inverse=True)
        ranked = torch.zeros(rows.shape[0], int(ranks[nodes].max()) + 1)
        ranked[row_of, ranks[nodes]] = pis[nodes]
        scores[nodes] = shape.child_scores(scores[rows], ranked)[row_of, ranks[nodes]]
    return scores


def picked_value(tree: dict, scores: torch.Tensor, select: int) -> float:
    """E[accepted] of the `select` best-scored nodes (ties by index: parents, earlier siblings first)."""
    order = torch.sort(scores, descending=True, stable=True).indices[: select + 1]
    return float(tree["reach"][order].double().sum()) - 1.0  # float64, as hindsight sums


def hindsight(tree: dict, select: int) -> float:
    """Greedy by true reach over nodes whose parent and previous sibling are picked."""
    parents, ranks, reach = tree["parents"].tolist(), tree["ranks"].tolist(), tree["reach"].tolist()
    child = {(p, r): i for i, (p, r) in enumerate(zip(parents, ranks, strict=True)) if p >= 0}
    picked, heap, total = 1, [], 0.0
    if (0, 0) in child:
        heap.append((-reach[child[(0, 0)]], child[(0, 0)]))
    while heap and picked <= select:
        value, node = heapq.heappop(heap)
        total, picked = total - value, picked + 1
        for key in ((node, 0), (parents[node], ranks[node] + 1)):
            if key in child:
                heapq.heappush(heap, (-reach[child[key]], child[key]))
    return total


def replay(trees: list[dict], select: int, params: SamplingParams) -> dict[str, list[tuple[int, float]]]:
    """Per shape model: (step index in its request, E[accepted]) for every tree large enough. "own"
    is a TreeShape without a book; "book" one from a ShapeBook that every request adds to."""
    results: dict[str, list[tuple[int, float]]] = defaultdict(list)
    book = rrs_shape.ShapeBook(torch.device("cpu"))
    last = -1
    for tree in trees:
        if tree["request"] != last:
            shapes = {"own": rrs_shape.TreeShape(torch.device("cpu")), "book": book.shape(params, constrained=False)}
            last = tree["request"]
        if tree["parents"].shape[0] > select:
            for name, shape in shapes.items():
                results[name].append((tree["step"], picked_value(tree, model_scores(tree, shape), select)))
            results["hindsight"].append((tree["step"], hindsight(tree, select)))
        children = tree["parents"][1:]
        for shape in shapes.values():
            shape.learn(tree["ranks"][1:], tree["pis"][1:], tree["reach"][children], tree["accepted"][1:])
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
    results = replay(capture(args), args.select, SamplingParams(temperature=args.temperature))
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
