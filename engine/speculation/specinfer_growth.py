"""SpecInfer trees (the baseline): sampled chains from the draft's processed distribution, verified
by token-level rejection sampling (engine.speculation.verify)."""

from __future__ import annotations

import math

import torch

from engine.speculation.drafter import Drafter, GrowLimits, Growth, MaskFn, restrict, root_tree
from engine.speculation.sampling import process_logits
from engine.speculation.tree import Tree, append_nodes
from engine.types import SamplingParams


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
