"""SpecExec trees of several requests grown as one forest (engine.speculation.forest): each round one
selection, one set of draft inputs, one top-w and one add-children for every tree, and one draft pass with
a segment per tree. Per tree the same search as specexec_growth.grow_tree (its nodes, scores and draft
forwards; only ties between equal scores may order differently), without grammar masks.

    fresh trees: catch up (one forward each, the root's log-probs); seeded trees: adopt + reoffer
    forest = every tree padded to one row; the fresh roots' children added
    rounds: select leaves -> their forward (a segment per tree) -> top-w -> add the best children

With overlap, the step's trees grow on beside their pass the same way (extend_forest; overlap.extension per tree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from engine.config import SpeculationConfig
from engine.model.runner import Segment
from engine.speculation.drafter import Drafter, GrowLimits, root_tree
from engine.speculation.forest import (
    Forest,
    add_best_children,
    assign_slots,
    draft_inputs,
    select_leaves,
    selected_nodes,
)
from engine.speculation.overlap import extension_start
from engine.speculation.sampling import apply_logit_bias
from engine.speculation.search_tree import SearchTree
from engine.speculation.specexec_growth import propose, seeded_start, tree_temperature
from engine.speculation.tree import Tree
from engine.types import SamplingParams

# a forest's search (as specexec_growth.Search for one tree): yields each round's draft forwards (a segment per
# tree that asks for one), is sent their logits in that order, returns the SearchTrees in the requests' order
ForestSearch = Generator[list[Segment], list[torch.Tensor], list[SearchTree]]


@dataclass
class TreeRequest:
    """One tree of a forest: its drafter, sampling params and limits; for a step's growth (grow_forest) also its
    root, the committed tokens its draft has not seen, and a seed (as specexec_growth.grow_tree's arguments)."""

    drafter: Drafter
    params: SamplingParams
    limits: GrowLimits
    root_id: int = -1
    pending_ids: list[int] = dataclasses.field(default_factory=list)
    seed: SearchTree | None = None  # the tree its extension grew during the last pass (overlap)


@dataclass
class Bounds:
    """A forest's per-tree limits, [S, 1] on its device: budgets, max depths, committed draft lengths; go_masks
    [S, vocab] (False at stop tokens); cuts: the budgets for add_best_children, None where they are all one."""

    budgets: torch.Tensor
    cuts: torch.Tensor | None
    max_depths: torch.Tensor
    go_masks: torch.Tensor
    committed: torch.Tensor

    @classmethod
    def of(cls, requests: list[TreeRequest], device: torch.device) -> Bounds:
        budgets = [r.limits.budget for r in requests]
        on_device = torch.tensor([[b, r.limits.max_depth, r.drafter.cache.length] for b, r in zip(budgets, requests,
                                                                                                  strict=True)],
                                 device=device)
        return cls(on_device[:, :1], None if len(set(budgets)) == 1 else on_device[:, :1], on_device[:, 1:2],
                   ~torch.stack([r.limits.stop_mask for r in requests]), on_device[:, 2:])


def grow_forest(requests: list[TreeRequest], spec: SpeculationConfig, seeded_forwards: int) -> ForestSearch:
    """Every request's SpecExec tree, grown in lockstep as one forest. All drafters share one runner, and
    their trees one device. A seeded tree gets the forwards grow_tree would give it, after the fresh trees'
    catch-up round; beside seeded trees a fresh one gets at most spec.fresh_forwards (0: no cap)."""
    trees: list[SearchTree | None] = [None] * len(requests)
    forwards = [0] * len(requests)  # draft forwards each tree may run
    fresh = []
    for index, request in enumerate(requests):
        limits, seed = request.limits, request.seed
        if seed is not None and not request.pending_ids:
            trees[index], forwards[index] = seeded_start(request.drafter, seed, spec, limits, seeded_forwards)
        else:
            fresh.append(index)
    root_logits = yield from catch_up([requests[index] for index in fresh])
    for index in fresh:
        drafter, limits = requests[index].drafter, requests[index].limits
        trees[index] = SearchTree.of(root_tree(requests[index].root_id, drafter.cache.length, drafter.tree_device),
                                     limits.max_depth)
        forwards[index] = limits.max_depth - 1
        if spec.fresh_forwards and len(fresh) < len(requests):  # beside seeded trees: they would wait on it
            forwards[index] = min(forwards[index], spec.fresh_forwards)
    forest = forest_of(trees, requests, spec)  # type: ignore[arg-type]  # every tree is set above
    bounds = Bounds.of(requests, forest.scores.device)
    if fresh:  # the fresh roots' children (as specexec_growth.search_from_root)
        roots = forest.parents.new_zeros((len(requests), 1))
        counts = [1 if index in fresh else 0 for index in range(len(requests))]
        selected = torch.tensor(counts, device=forest.scores.device)[:, None]  # [S, 1]
        valid = None if len(fresh) == len(requests) else selected > 0
        child_lp, child_ids = top_children(requests, root_logits, counts, selected, valid, spec)
        forest = add_best_children(forest, roots, valid, child_lp, child_ids, spec.decay, bounds.cuts)
    forest, _ = yield from search(forest, requests, bounds, forwards, spec)
    return forest.trees()


def extend_forest(requests: list[TreeRequest], trees: list[Tree], spec: SpeculationConfig,
                  stop: Callable[[], bool]) -> ForestSearch:
    """The step's scored trees grown on as one forest while their pass runs, as overlap.extension grows each
    (its proposals offered again, then best-first within each request's limits, up to its limits.max_depth draft
    forwards, until `stop()` between forwards); each SearchTree counts its extension_forwards. Set up here,
    before the pass is queued (its host syncs wait for the draft alone); the growth runs as it is driven."""
    searches = [extension_start(request.drafter, tree, spec, request.limits)
                for request, tree in zip(requests, trees, strict=True)]
    forest = forest_of(searches, requests, spec)
    return counted(search(forest, requests, Bounds.of(requests, forest.scores.device),
                          [request.limits.max_depth for request in requests], spec, stop))


def counted(growth: Generator[list[Segment], list[torch.Tensor], tuple[Forest, list[int]]]) -> ForestSearch:
    """An extension's trees, each with the forwards it ran as its extension_forwards."""
    forest, ran = yield from growth
    return [dataclasses.replace(tree, extension_forwards=count) for tree, count in zip(forest.trees(), ran, strict=True)]


def forest_of(trees: list[SearchTree], requests: list[TreeRequest], spec: SpeculationConfig) -> Forest:
    """The trees as a forest of as many columns as the largest budget + 1."""
    return Forest.of(trees, max(r.limits.budget for r in requests) + 1,
                     min(spec.max_children, requests[0].drafter.runner.vocab_size))


def search(forest: Forest, requests: list[TreeRequest], bounds: Bounds, forwards: list[int], spec: SpeculationConfig,
           stop: Callable[[], bool] | None = None) -> Generator[list[Segment], list[torch.Tensor], tuple[Forest, list[int]]]:
    """Best-first growth of every tree for at most forwards[s] draft forwards (specexec_growth.best_first_search
    per row), or until `stop()` says so between rounds. Returns the forest and the forwards each tree ran."""
    device = forest.scores.device
    ran = [0] * len(requests)
    # each drafter's next slot, kept where the forest is (the host knows them too: no copy a round)
    next_slots = torch.tensor([[r.drafter.next_slot] for r in requests], device=device)
    while stop is None or not stop():
        limits = [min(spec.max_expand, r.drafter.room()) if done < most else 0
                  for r, done, most in zip(requests, ran, forwards, strict=True)]
        limit: torch.Tensor | int = limits[0] if len(set(limits)) == 1 else torch.tensor(limits, device=device)[:, None]
        selection, rank = select_leaves(forest, limit, bounds.budgets, bounds.max_depths, bounds.go_masks)
        selected = selection.sum(1, keepdim=True)  # [S, 1]
        counts = selected.flatten().tolist()  # the round's host sync
        if not any(counts):
            break
        nodes = selected_nodes(selection, rank, max(counts))
        valid = None if len(set(counts)) == 1 else torch.arange(nodes.shape[1], device=device) < selected
        assign_slots(forest, selection, rank, next_slots)
        starts = [r.drafter.next_slot for r in requests]
        width_kv = max(start + count for start, count in zip(starts, counts, strict=True))
        logits = yield segments(requests, draft_inputs(forest, nodes, bounds.committed, width_kv), starts, counts)
        for index, (request, count) in enumerate(zip(requests, counts, strict=True)):
            if count:
                request.drafter.next_slot += count
                ran[index] += 1
        next_slots = next_slots + selected
        child_lp, child_ids = top_children(requests, logits, counts, selected, valid, spec)
        forest = add_best_children(forest, nodes, valid, child_lp, child_ids, spec.decay, bounds.cuts)
    return forest, ran


def catch_up(requests: list[TreeRequest]) -> Generator[list[Segment], list[torch.Tensor], list[torch.Tensor]]:
    """Each request's Drafter.catch_up in one round (none without requests): their roots' [1, vocab] logits."""
    if not requests:
        return []
    forwards = [request.drafter.catch_up(request.pending_ids, request.root_id) for request in requests]
    logits = yield [forward.send(None) for forward in forwards]  # type: ignore[arg-type]  # None starts it
    roots = []
    for forward, part in zip(forwards, logits, strict=True):
        try:
            forward.send(part)
        except StopIteration as done:
            roots.append(done.value)
    return roots


def segments(requests: list[TreeRequest], inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], starts: list[int],
             counts: list[int]) -> list[Segment]:
    """A draft forward's segment for each tree with selected nodes: its rows of the forest's inputs (ids,
    positions [S, K]; masks [S, K, width]) on the draft's device, at slots from its next slot."""
    device = requests[0].drafter.cache.device
    ids, positions, masks = (tensor.to(device) for tensor in inputs)  # the host's with --host-trees
    return [Segment(ids[s, :count], positions[s, :count], request.drafter.cache, start, masks[s, :count, : start + count])
            for s, (request, start, count) in enumerate(zip(requests, starts, counts, strict=True)) if count]


def top_children(requests: list[TreeRequest], logits: list[torch.Tensor], counts: list[int], selected: torch.Tensor,
                 valid: torch.Tensor | None, spec: SpeculationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's logits of the trees with counts[s] > 0 ([counts[s], vocab] each, in order) -> their
    rows' top-w children under each request's scoring distribution (specexec_growth.draft_log_probs), as
    ([S, K, w] log-probs (-inf past a tree's count), [S, K, w] token ids) where the forest is, K = max(counts).
    selected: the counts, [S, 1] there; valid: [S, K], which rows are a tree's (None: all)."""
    asking = [(request, count) for request, count in zip(requests, counts, strict=True) if count]
    parts = [apply_logit_bias(part, request.params.logit_bias) for (request, _), part in zip(asking, logits, strict=True)]
    rows = requests[0].drafter.mask_vocab(parts[0] if len(parts) == 1 else torch.cat(parts))  # [sum(counts), vocab]
    temperatures = [tree_temperature(request.params, spec.greedy_tree_temperature, spec.sampled_tree_temperature_scale)
                    for request, _ in asking]
    if len(set(temperatures)) > 1:  # each row at its tree's
        rows = rows / torch.tensor([t for t, (_, count) in zip(temperatures, asking, strict=True) for _ in range(count)],
                                   device=rows.device)[:, None]
    elif temperatures[0] != 1.0:
        rows = rows / temperatures[0]
    child_lp, child_ids = propose(rows.log_softmax(dim=-1), spec.max_children, selected.device)
    num_trees, num_selected, width = len(requests), max(counts), child_lp.shape[1]
    if valid is not None:  # row j of tree s is row (its first) + j of the asking ones'; rows past its count: a spare
        first = selected.cumsum(0) - selected  # [S, 1]
        index = torch.where(valid, first + torch.arange(num_selected, device=valid.device), child_lp.shape[0]).flatten()
        child_lp = torch.nn.functional.pad(child_lp, (0, 0, 0, 1), value=float("-inf")).index_select(0, index)
        child_ids = torch.nn.functional.pad(child_ids, (0, 0, 0, 1)).index_select(0, index)
    return child_lp.view(num_trees, num_selected, width), child_ids.view(num_trees, num_selected, width)
