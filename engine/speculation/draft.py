"""Draft tree growth: SpecExec best-first search, and SpecInfer's sampled tree (baseline).

The draft KV cache holds the committed prefix plus one slot per node the draft expanded.
Unexpanded nodes (and committed tokens the draft never saw) are caught up by the next step's
first draft forward.

A growth is a generator (`Growth`): it yields each draft forward it needs as a Segment over its own
cache, is sent that forward's [rows, vocab] logits, and returns the tree. It runs no model itself,
so the growths of every request in a step advance in lockstep and share one draft pass per round
(`run_growths`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from engine.config import SpeculationConfig
from engine.model.faults import request_error
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner, Segment
from engine.speculation.sampling import apply_logit_bias, process_logits
from engine.speculation.tree import Tree, append_nodes, causal_mask, trim
from engine.types import SamplingParams

# mask(tree, nodes [k]) -> [k, vocab] bool: the tokens a grammar allows after each node (structured output)
MaskFn = Callable[[Tree, torch.Tensor], torch.Tensor]
# a tree's growth: yields each draft forward (one Segment), is sent its [rows, vocab] logits, returns the tree
Growth = Generator[Segment, torch.Tensor, Tree]
# expand(tree, selected [k]) -> (yielding its forward) [k, vocab] draft log-probs
ExpandFn = Callable[[Tree, torch.Tensor], Generator[Segment, torch.Tensor, torch.Tensor]]


@dataclass
class GrowLimits:
    budget: int  # draft tokens in the tree (root excluded)
    max_depth: int  # deepest node depth, and cap on draft forwards
    stop_mask: torch.Tensor  # [draft vocab] bool: EOS / stop token ids, never expanded


class Drafter:
    """The draft model with its cache, restricted to the target's vocabulary and its own embedding.

    It drafts only ids below both (an id past its embedding could not be fed back to it). Ids the
    target emits past the draft's embedding (a target vocabulary padded further than the draft's)
    are fed to the draft as its runner's fallback_input_id: the draft only proposes, so exactness
    does not depend on what it sees."""

    def __init__(self, runner: DecoderRunner, cache: KVCache, target_vocab_size: int):
        self.runner = runner
        self.cache = cache
        self.vocab_limit = min(target_vocab_size, runner.vocab_size, runner.num_embeddings)
        # [draft vocab] bool: ids past the target's vocabulary or the draft's embedding, never drafted
        self.outside_target = torch.arange(runner.vocab_size, device=cache.device) >= self.vocab_limit
        self.next_slot = 0

    def catch_up(self, pending_ids: list[int], root_id: int) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        """Feed committed tokens the draft has not seen, then the root (one forward). Commits the
        pending ones. Returns the root's draft logits [1, vocab]; the root's KV lands at slot cache.length."""
        device = self.cache.device
        ids = torch.tensor([*pending_ids, root_id], device=device)
        start = self.cache.length
        positions = torch.arange(start, start + ids.shape[0], device=device)
        mask = causal_mask(ids.shape[0], start, device)
        last = torch.tensor([ids.shape[0] - 1], device=device)
        logits = yield Segment(ids, positions, self.cache, start, mask, last)
        self.cache.length = start + len(pending_ids)
        self.next_slot = self.cache.length + 1
        return self.mask_vocab(logits)

    def expand(self, tree: Tree, selected: torch.Tensor) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        """One forward of `selected` nodes ([k]) under the tree mask. Returns [k, vocab]."""
        num = selected.shape[0]
        start = self.next_slot
        tree.draft_slots[selected] = torch.arange(start, start + num, device=selected.device)
        allowed = torch.zeros(num, start + num, dtype=torch.bool, device=selected.device)
        allowed[:, : self.cache.length] = True
        has_slot = tree.draft_slots >= 0
        allowed[:, tree.draft_slots[has_slot]] = tree.ancestors[selected][:, has_slot]
        positions = self.cache.length + tree.depths[selected]
        logits = yield Segment(tree.token_ids[selected], positions, self.cache, start, allowed)
        self.next_slot = start + num
        return self.mask_vocab(logits)

    def room(self) -> int:
        return self.cache.capacity - self.next_slot

    def mask_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[k, draft vocab] -> the same with ids past vocab_limit at -inf. Out of place:
        the runner's logits are inference tensors."""
        if logits.shape[1] > self.vocab_limit:
            return logits.masked_fill(self.outside_target[: logits.shape[1]], float("-inf"))
        return logits

    def commit(self, tree: Tree, path: torch.Tensor) -> None:
        """Keep the accepted path's draft KV (the expanded nodes form a prefix of the path)."""
        slots = tree.draft_slots[path]
        self.cache.commit(slots[slots >= 0])

    def adopt(self, tree: Tree) -> Tree:
        """A tree grown in earlier steps (a seed, rooted at the last committed token, its root expanded):
        its expanded nodes' KV moves to the slots right after the committed prefix, in node order (the
        root at cache.length, where a fresh root would be). Returns the tree with those slots."""
        expanded = (tree.draft_slots >= 0).nonzero().squeeze(1)  # [k] ascending, the root first
        start = self.cache.length
        slots = torch.arange(start, start + expanded.shape[0], device=expanded.device)
        self.cache.move(tree.draft_slots[expanded], start)
        draft_slots = tree.draft_slots.clone()
        draft_slots[expanded] = slots
        self.next_slot = start + expanded.shape[0]
        return dataclasses.replace(tree, draft_slots=draft_slots)


def draft_log_probs(
    logits: torch.Tensor, params: SamplingParams, greedy_temperature: float = 1.0, sampled_scale: float = 1.0
) -> torch.Tensor:
    """The draft's scoring distribution, biased like the target: at the request's temperature times
    `sampled_scale` when sampling; at `greedy_temperature` for greedy requests, where a node is accepted
    only if it is the target's argmax (verification is exact for any tree, so this only shapes the tree)."""
    logits = apply_logit_bias(logits, params.logit_bias)
    temperature = greedy_temperature if params.greedy else params.temperature * sampled_scale
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(dim=-1)


def restrict(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[k, draft vocab] logits or log-probs -> the same at -inf where `allowed` ([k, vocab] bool) is
    False; ids past `allowed`'s width are forbidden. Out of place."""
    width = scores.shape[1]
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    return scores.masked_fill(~allowed[:, :width], float("-inf"))


def renormalise(log_probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[k, vocab] log-probs conditioned on `allowed` ([k, vocab] bool). A row with nothing allowed
    becomes NaN, which proposes no children (add_best_children keeps finite scores only)."""
    return restrict(log_probs, allowed).log_softmax(dim=-1)


def root_tree(root_id: int, root_slot: int, device: torch.device) -> Tree:
    tree = Tree.single(root_id, device)
    tree.draft_slots[0] = root_slot
    return tree


def grow_tree(
    drafter: Drafter,
    root_id: int,
    pending_ids: list[int],
    params: SamplingParams,
    spec: SpeculationConfig,
    limits: GrowLimits,
    mask: MaskFn | None = None,
    seed: Tree | None = None,
    seeded_forwards: int = 0,
) -> Growth:
    """SpecExec: best-first expansion of the K best unexpanded leaves per draft forward, each
    proposing its top-w children; keep the `budget` best nodes by cumulative draft log-prob. With
    `mask`, children it forbids are never proposed. With a `seed` (a tree already grown under this
    root while the target scored the last one, engine.speculation.overlap) growth goes on from it for
    the forwards a fresh tree would get less those the extension spent on it, at least `seeded_forwards`."""
    expand = scored_expand(drafter, params, spec)
    if seed is not None and not pending_ids:
        tree = reoffer(drafter.adopt(trim(seed, limits.budget + 1, limits.max_depth)), spec, limits)
        # the forwards a fresh tree gets, less those its extension already spent (a long pass: few)
        forwards = max(seeded_forwards, limits.max_depth - 1 - seed.extension_forwards)
        return (yield from best_first_search(tree, tree.draft_slots >= 0, expand, spec, limits, drafter.room, mask,
                                             forwards))
    root_logits = yield from drafter.catch_up(pending_ids, root_id)
    tree = root_tree(root_id, drafter.cache.length, root_logits.device)
    root_log_probs = draft_log_probs(
        root_logits, params, spec.greedy_tree_temperature, spec.sampled_tree_temperature_scale
    )
    return (yield from search_from_root(tree, root_log_probs, expand, spec, limits, drafter.room, mask))


def scored_expand(drafter: Drafter, params: SamplingParams, spec: SpeculationConfig) -> ExpandFn:
    """expand(tree, selected) for best-first search: the drafter's forward, as draft_log_probs."""

    def expand(tree: Tree, selected: torch.Tensor) -> Generator[Segment, torch.Tensor, torch.Tensor]:
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
) -> Growth:
    """The search over a root-only tree whose root's draft log-probs ([1, vocab]) are known: its
    children, then up to max_depth - 1 more draft forwards."""
    if mask is not None:
        root_log_probs = renormalise(root_log_probs, mask(tree, tree.parents.new_zeros(1)))
    tree, expanded = add_best_children(tree, tree.draft_slots >= 0, tree.parents.new_zeros(1),
                                       *propose(root_log_probs, spec.max_children), spec.decay, limits.budget)
    return (yield from best_first_search(tree, expanded, expand, spec, limits, room, mask, limits.max_depth - 1))


def best_first_search(
    tree: Tree,
    expanded: torch.Tensor,
    expand: ExpandFn,
    spec: SpeculationConfig,
    limits: GrowLimits,
    room: Callable[[], int],
    mask: MaskFn | None,
    max_forwards: int,
    stop: Callable[[], bool] | None = None,
) -> Growth:
    """Best-first growth of `tree` (expanded: [n] bool) for at most `max_forwards` draft forwards, or
    until `stop()` says so between forwards. expand(tree, selected [k]) yields its forward and returns
    [k, vocab] draft log-probs; mask: every expanded node's log-probs are conditioned on what it allows."""
    num_forwards = 0
    for num_forwards in range(max_forwards):  # noqa: B007  # the count is read after the loop
        if stop is not None and stop():
            break
        selected = select_leaves(tree, expanded, spec.max_expand, limits, room())
        if selected.numel() == 0:
            break
        expanded[selected] = True
        log_probs = yield from expand(tree, selected)
        if mask is not None:
            log_probs = renormalise(log_probs, mask(tree, selected))
        tree, expanded = add_best_children(tree, expanded, selected, *propose(log_probs, spec.max_children),
                                           spec.decay, limits.budget)
    else:
        num_forwards = max_forwards
    tree.extension_forwards = num_forwards if stop is not None else 0
    return tree


def select_leaves(
    tree: Tree, expanded: torch.Tensor, max_expand: int, limits: GrowLimits, room: int
) -> torch.Tensor:
    """The best unexpanded nodes whose children could still enter the top `budget` (tree is
    sorted by score, so index order is score order)."""
    candidates = ~expanded & ~limits.stop_mask[tree.token_ids] & (tree.depths < limits.max_depth)
    if tree.num_nodes == limits.budget + 1:
        candidates &= tree.scores > tree.scores[-1]  # a child scores <= its parent; ties go to old nodes
    return candidates.nonzero().squeeze(1)[: min(max_expand, room)]


def propose(log_probs: torch.Tensor, max_children: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, vocab] log-probs -> the top-w children of each row: ([k, w] log-probs, [k, w] token ids)."""
    return log_probs.topk(min(max_children, log_probs.shape[1]), dim=-1)


def reoffer(tree: Tree, spec: SpeculationConfig, limits: GrowLimits) -> Tree:
    """Offer again the children every expanded node proposed (tree.child_lp / child_ids) that are not in
    the tree, e.g. dropped when it belonged to a larger tree; keeps the best budget + 1. No forward."""
    if tree.child_lp is None:
        return tree
    selected = ((tree.draft_slots >= 0) & (tree.depths < limits.max_depth)).nonzero().squeeze(1)
    expanded = tree.draft_slots >= 0
    return add_best_children(tree, expanded, selected, tree.child_lp[selected], tree.child_ids[selected],
                             spec.decay, limits.budget, skip_present=True)[0]


def child_keys(parents: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """One int64 per (parent node, token) pair."""
    return parents * (1 << 32) + token_ids


def add_best_children(
    tree: Tree,
    expanded: torch.Tensor,
    selected: torch.Tensor,
    child_lp: torch.Tensor,
    child_ids: torch.Tensor,
    decay: float,
    budget: int,
    skip_present: bool = False,
) -> tuple[Tree, torch.Tensor]:
    """Add the proposed children (child_lp, child_ids: [k, w]) of the `selected` nodes ([k]); keep the
    best budget + 1 nodes (root included). The proposals are kept in tree.child_lp / child_ids.
    skip_present: proposals already in the tree are not added again (siblings stay distinct)."""
    num_nodes, width = tree.num_nodes, child_lp.shape[1]
    stored_lp = tree.child_lp if tree.child_lp is not None else child_lp.new_full((num_nodes, width), float("-inf"))
    stored_ids = tree.child_ids if tree.child_ids is not None else child_ids.new_zeros((num_nodes, width))
    stored_lp, stored_ids = stored_lp.clone(), stored_ids.clone()
    stored_lp[selected], stored_ids[selected] = child_lp, child_ids
    if skip_present:
        present = torch.isin(child_keys(selected[:, None], child_ids), child_keys(tree.parents[1:], tree.token_ids[1:]))
        child_lp = child_lp.masked_fill(present, float("-inf"))
    child_scores = tree.scores[selected, None] + child_lp + math.log(decay)  # [k, w]
    flat_scores, flat_idx = child_scores.flatten().topk(min(child_scores.numel(), budget))
    finite = flat_scores > float("-inf")
    flat_scores, flat_idx = flat_scores[finite], flat_idx[finite]
    child_parents = selected[flat_idx // width]
    child_ids = child_ids.flatten()[flat_idx]

    scores = torch.cat([tree.scores, flat_scores])
    # Stable sort: a parent (lower index, score >= child's) always precedes its children, so
    # every prefix of `order` is closed under ancestors.
    order = torch.sort(scores, descending=True, stable=True).indices[: budget + 1]
    ancestors = append_nodes(tree.ancestors, child_parents)[order][:, order]
    new_index = torch.full_like(scores, -1, dtype=torch.long)
    new_index[order] = torch.arange(order.shape[0], device=order.device)
    all_parents = torch.cat([tree.parents, child_parents])[order]
    parents = torch.where(all_parents >= 0, new_index[all_parents.clamp(min=0)], all_parents)
    num_new = child_ids.shape[0]
    new_tree = Tree(
        token_ids=torch.cat([tree.token_ids, child_ids])[order],
        parents=parents,
        depths=torch.cat([tree.depths, tree.depths[child_parents] + 1])[order],
        scores=scores[order],
        ancestors=ancestors,
        draft_slots=torch.cat([tree.draft_slots, tree.draft_slots.new_full((num_new,), -1)])[order],
        child_lp=torch.cat([stored_lp, stored_lp.new_full((num_new, width), float("-inf"))])[order],
        child_ids=torch.cat([stored_ids, stored_ids.new_zeros((num_new, width))])[order],
    )
    return new_tree, torch.cat([expanded, expanded.new_zeros(num_new)])[order]


def grow_sampled_tree(
    drafter: Drafter,
    root_id: int,
    pending_ids: list[int],
    params: SamplingParams,
    limits: GrowLimits,
    generator: torch.Generator,
    mask: MaskFn | None = None,
) -> Growth:
    """SpecInfer baseline: `num_chains` children of the root drawn i.i.d. from the draft's processed
    distribution (top ones when greedy), each continued as a sampled chain; about sqrt(budget)
    chains of about sqrt(budget) tokens, capped at max_depth. With `mask`, the draft distribution at
    each node is conditioned on the tokens it allows (tree.draft_probs is that distribution)."""
    depth = max(1, min(limits.max_depth, round(math.sqrt(limits.budget))))
    num_chains = max(1, limits.budget // depth)
    draft_params = SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        logit_bias=params.logit_bias,
    )
    root_logits = yield from drafter.catch_up(pending_ids, root_id)
    tree = root_tree(root_id, drafter.cache.length, root_logits.device)
    frontier = torch.zeros(1, dtype=torch.long, device=root_logits.device)
    if mask is not None:
        root_logits = restrict(root_logits, mask(tree, frontier))
    probs = process_logits(root_logits, draft_params).softmax(dim=-1)
    tree.draft_probs = probs
    for level in range(depth):
        draws = num_chains if level == 0 else 1
        if params.greedy:
            child_ids = probs.topk(draws, dim=-1).indices  # [f, draws] distinct, as greedy needs
        else:
            child_ids = torch.multinomial(probs, draws, replacement=True, generator=generator)
        child_parents = frontier.repeat_interleave(draws)
        child_ids = child_ids.flatten()
        if mask is not None:  # greedy top-k may pick tokens of probability 0: the grammar forbids them
            rows = torch.arange(frontier.shape[0], device=probs.device).repeat_interleave(draws)
            possible = probs[rows, child_ids] > 0
            child_parents, child_ids = child_parents[possible], child_ids[possible]
        first_new = tree.num_nodes
        tree = append_children(tree, child_parents, child_ids, probs.shape[1])
        frontier = torch.arange(first_new, tree.num_nodes, device=probs.device)
        frontier = frontier[~limits.stop_mask[tree.token_ids[frontier]]]
        if level == depth - 1 or frontier.numel() == 0 or drafter.room() < frontier.numel():
            break
        logits = yield from drafter.expand(tree, frontier)
        if mask is not None:
            logits = restrict(logits, mask(tree, frontier))
        probs = process_logits(logits, draft_params).softmax(dim=-1)
        tree.draft_probs[frontier] = probs
    return tree


def append_children(tree: Tree, parents: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> Tree:
    num_new = parents.shape[0]
    draft_probs = tree.draft_probs
    if draft_probs is not None:
        draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(num_new, vocab_size)])
    return Tree(
        token_ids=torch.cat([tree.token_ids, token_ids]),
        parents=torch.cat([tree.parents, parents]),
        depths=torch.cat([tree.depths, tree.depths[parents] + 1]),
        scores=torch.cat([tree.scores, tree.scores.new_zeros(num_new)]),
        ancestors=append_nodes(tree.ancestors, parents),
        draft_slots=torch.cat([tree.draft_slots, tree.draft_slots.new_full((num_new,), -1)]),
        draft_probs=draft_probs,
    )


def run_growths(growths: list[tuple[DecoderRunner | None, Growth]]) -> list[Tree | Exception]:
    """Advance every (runner, growth) in lockstep; returns their trees. Each round, the forwards the
    growths ask for run as one draft pass per runner, one segment each over its own cache (dense work
    shared, attention per segment). A growth that asks for none (runner may then be None) just returns.
    A growth that raises ends with its exception in its place (a device fault is raised: the engine's);
    the others go on. A failing draft pass raises."""
    trees: list[Tree | Exception | None] = [None] * len(growths)
    asks: dict[int, Segment] = {}

    def advance(index: int, logits: torch.Tensor | None) -> None:
        try:
            asks[index] = growths[index][1].send(logits)  # type: ignore[arg-type]  # None starts it
        except StopIteration as done:
            trees[index] = done.value
        except Exception as exc:
            trees[index] = request_error(exc)

    for index in range(len(growths)):
        advance(index, None)
    while asks:
        pending = sorted(asks)
        for runner in {id(growths[i][0]): growths[i][0] for i in pending}.values():
            assert runner is not None, "a growth asked for a draft forward without a runner"
            mine = [i for i in pending if growths[i][0] is runner]
            outputs = runner.forward_groups([[asks.pop(i) for i in mine]])[0]
            for index, logits in zip(mine, outputs, strict=True):
                advance(index, logits)
    assert all(tree is not None for tree in trees)
    return trees  # type: ignore[return-value]


def run_growth(runner: DecoderRunner | None, growth: Growth) -> Tree:
    tree = run_growths([(runner, growth)])[0]
    if isinstance(tree, Exception):
        raise tree
    return tree
