"""SpecExec trees: best-first expansion of the best unexpanded leaves per draft forward, each
proposing its top-w children; the tree keeps the `budget` best nodes by cumulative draft log-prob
(docs/design.md, "Tree growth"). The search is resumable (best_first_search from any tree), which
the overlap extension and its seeds use (engine.speculation.overlap). While it runs, the tree is a
SearchTree (paths instead of the ancestor matrix: engine.speculation.search_tree)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator

import torch

from engine.config import SpeculationConfig
from engine.model.runner import Segment
from engine.speculation.drafter import Drafter, GrowLimits, Growth, MaskFn, renormalise, root_tree
from engine.speculation.sampling import apply_logit_bias
from engine.speculation.search_tree import SearchTree, add_best_children
from engine.speculation.tree import Tree
from engine.types import SamplingParams

# expand(tree, selected [k]) -> (yielding its forward) [k, vocab] draft log-probs
ExpandFn = Callable[[SearchTree, torch.Tensor], Generator[Segment, torch.Tensor, torch.Tensor]]
# a search: a growth (drafter.Growth) that returns the SearchTree, not yet a Tree
Search = Generator[Segment, torch.Tensor, SearchTree]


def draft_log_probs(
    logits: torch.Tensor, params: SamplingParams, greedy_temperature: float = 1.0, sampled_scale: float = 1.0
) -> torch.Tensor:
    """The draft's scoring distribution, biased like the target: at the request's temperature times
    `sampled_scale` when sampling; at `greedy_temperature` for greedy requests, where a node is accepted
    only if it is the target's argmax (verification is exact for any tree, so this only shapes the tree)."""
    logits = apply_logit_bias(logits, params.logit_bias)
    temperature = tree_temperature(params, greedy_temperature, sampled_scale)
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(dim=-1)

def tree_temperature(params: SamplingParams, greedy_temperature: float, sampled_scale: float) -> float:
    """The temperature of the draft's scoring distribution (draft_log_probs)."""
    return greedy_temperature if params.greedy else params.temperature * sampled_scale

def grow_tree(
    drafter: Drafter,
    root_id: int,
    pending_ids: list[int],
    params: SamplingParams,
    spec: SpeculationConfig,
    limits: GrowLimits,
    mask: MaskFn | None = None,
    seed: SearchTree | None = None,
    seeded_forwards: int = 0,
) -> Growth:
    """SpecExec: best-first expansion of the K best unexpanded leaves per draft forward, each
    proposing its top-w children; keep the `budget` best nodes by cumulative draft log-prob. With
    `mask`, children it forbids are never proposed. With a `seed` (a tree already grown under this
    root while the target scored the last one, engine.speculation.overlap) growth goes on from it for
    the forwards a fresh tree would get less those the extension spent on it, at least `seeded_forwards`."""
    expand = scored_expand(drafter, params, spec)
    if seed is not None and not pending_ids:
        tree, forwards = seeded_start(drafter, seed, spec, limits, seeded_forwards)
        grown = yield from best_first_search(tree, expand, spec, limits, drafter.room, mask, forwards)
        return grown.tree()
    root_logits = yield from drafter.catch_up(pending_ids, root_id)
    tree = root_tree(root_id, drafter.cache.length, drafter.tree_device)
    root_log_probs = draft_log_probs(
        root_logits, params, spec.greedy_tree_temperature, spec.sampled_tree_temperature_scale
    )
    grown = yield from search_from_root(tree, root_log_probs, expand, spec, limits, drafter.room, mask)
    return grown.tree()

def seeded_start(drafter: Drafter, seed: SearchTree, spec: SpeculationConfig, limits: GrowLimits,
                 seeded_forwards: int) -> tuple[SearchTree, int]:
    """A seed as the step's search state (cut to the limits, its KV adopted, its dropped proposals offered
    again) and its draft forwards: those a fresh tree gets less those its extension already spent (a long
    pass: few), at least `seeded_forwards`."""
    tree = drafter.adopt(seed.trim(limits.budget + 1, limits.max_depth)).widened(limits.max_depth)
    forwards = max(seeded_forwards, limits.max_depth - 1 - seed.extension_forwards)
    return dataclasses.replace(reoffer(tree, spec, limits), extension_forwards=0), forwards

def scored_expand(drafter: Drafter, params: SamplingParams, spec: SpeculationConfig) -> ExpandFn:
    """expand(tree, selected) for best-first search: the drafter's forward, as draft_log_probs."""

    def expand(tree: SearchTree, selected: torch.Tensor) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        logits = yield from drafter.expand(tree, selected)
        return draft_log_probs(logits, params, spec.greedy_tree_temperature, spec.sampled_tree_temperature_scale)

    return expand

def search_from_root(
    tree: Tree,
    root_log_probs: torch.Tensor,
    expand: ExpandFn,
    spec: SpeculationConfig,
    limits: GrowLimits,
    room: Callable[[], int],
    mask: MaskFn | None = None,
) -> Search:
    """The search over a root-only tree whose root's draft log-probs ([1, vocab]) are known: its
    children, then up to max_depth - 1 more draft forwards."""
    root = tree.parents.new_zeros(1)
    if mask is not None:
        root_log_probs = renormalise(root_log_probs, mask(tree, root))
    search = add_best_children(SearchTree.of(tree, limits.max_depth), root,
                               *propose(root_log_probs, spec.max_children, root.device), spec.decay, limits.budget)
    return (yield from best_first_search(search, expand, spec, limits, room, mask, limits.max_depth - 1))

def best_first_search(
    tree: SearchTree,
    expand: ExpandFn,
    spec: SpeculationConfig,
    limits: GrowLimits,
    room: Callable[[], int],
    mask: MaskFn | None,
    max_forwards: int,
    stop: Callable[[], bool] | None = None,
) -> Search:
    """Best-first growth of `tree` for at most `max_forwards` draft forwards, or until `stop()` says so
    between forwards (then its extension_forwards count them). expand(tree, selected [k]) yields its forward and returns
    [k, vocab] draft log-probs; mask: every expanded node's log-probs are conditioned on what it allows."""
    num_forwards = 0
    for num_forwards in range(max_forwards):  # noqa: B007  # the count is read after the loop
        if stop is not None and stop():
            break
        selected = select_leaves(tree, spec.max_expand, limits, room())
        if selected.numel() == 0:
            break
        tree.expanded[selected] = True
        log_probs = yield from expand(tree, selected)
        if mask is not None:
            log_probs = renormalise(log_probs, mask(tree, selected))
        tree = add_best_children(tree, selected, *propose(log_probs, spec.max_children, selected.device), spec.decay,
                                 limits.budget)
    else:
        num_forwards = max_forwards
    return dataclasses.replace(tree, extension_forwards=num_forwards) if stop is not None else tree

def select_leaves(tree: SearchTree, max_expand: int, limits: GrowLimits, room: int) -> torch.Tensor:
    """The best unexpanded nodes whose children could still enter the top `budget` (tree is
    sorted by score, so index order is score order)."""
    candidates = ~tree.expanded & ~limits.stop_mask[tree.token_ids] & (tree.depths < limits.max_depth)
    if tree.num_nodes == limits.budget + 1:
        candidates &= tree.scores > tree.scores[-1]  # a child scores <= its parent; ties go to old nodes
    return candidates.nonzero().squeeze(1)[: min(max_expand, room)]

def propose(log_probs: torch.Tensor, max_children: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, vocab] log-probs -> the top-w children of each row: ([k, w] log-probs, [k, w] token ids) on
    `device`, the tree's (the host's with --host-trees: the only copy back of a forward's outcome)."""
    child_lp, child_ids = log_probs.topk(min(max_children, log_probs.shape[1]), dim=-1)
    return child_lp.to(device), child_ids.to(device)

def reoffer(tree: SearchTree, spec: SpeculationConfig, limits: GrowLimits) -> SearchTree:
    """Offer again the children every expanded node proposed (tree.child_lp / child_ids) that are not in
    the tree, e.g. dropped when it belonged to a larger tree; keeps the best budget + 1. No forward."""
    if tree.child_lp is None or tree.child_ids is None:
        return tree
    selected = (tree.expanded & (tree.depths < limits.max_depth)).nonzero().squeeze(1)
    return add_best_children(tree, selected, tree.child_lp[selected], tree.child_ids[selected],
                             spec.decay, limits.budget, skip_present=True)
