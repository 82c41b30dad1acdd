"""RRS trees: best-first growth whose children are drawn without replacement from the draft.

At every expanded node the draft's processed distribution, cut to its top w tokens and renormalised
(q), is drawn without replacement once (Gumbel top-k): the node's row of tree.proposals. A node's
children are always a prefix of its row, and whether its i-th draw becomes a child is decided from
scores that never depend on that draw's token (rrs_shape.TreeShape.child_scores: the rank i and the
i-th largest probability of q), and a child once in is never removed. That is what keeps
recursive rejection sampling (engine.speculation.rrs) exact; docs/design.md, "RRS trees".

Each draft forward expands the best unexpanded nodes (at most max_expand, any depth); after it, the
children of the nodes it expanded whose scores reach the request's threshold enter the tree, best
first, while the budget lasts. Nodes are kept in score order (index order), parents before children.
"""

from __future__ import annotations

import torch

from engine.speculation.draft import Drafter, GrowLimits, Growth, MaskFn, restrict, root_tree
from engine.speculation.rrs_shape import TreeShape
from engine.speculation.sampling import process_logits
from engine.speculation.tree import Proposals, Tree, append_nodes
from engine.types import SamplingParams


def draft_sampling(params: SamplingParams) -> SamplingParams:
    """The request's distribution-shaping parameters for the draft (its penalties are left out: any
    q keeps RRS exact, as long as q is what the children were drawn from)."""
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          min_p=params.min_p, logit_bias=params.logit_bias)


def draw_proposals(
    logits: torch.Tensor, params: SamplingParams, width: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[k, vocab] draft logits -> (token ids [k, w] in the order of one draw without replacement from
    q, their q [k, w], q sorted descending [k, w]). q is the processed distribution cut to its top w
    tokens, renormalised; tokens of probability 0 come last (and are never children). A row where
    nothing is allowed gives q = 0 everywhere."""
    probs = process_logits(logits, params).softmax(dim=-1).nan_to_num(0.0)  # [k, vocab]
    ranked, top_ids = probs.topk(min(width, probs.shape[1]), dim=-1)  # [k, w] descending
    ranked = ranked / ranked.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    gumbel = -torch.empty_like(ranked).exponential_(generator=generator).clamp(min=1e-30).log()
    keys = torch.where(ranked > 0, ranked.log() + gumbel, float("-inf"))
    order = keys.argsort(dim=-1, descending=True)
    return top_ids.gather(1, order), ranked.gather(1, order), ranked


def grow_rrs_tree(
    drafter: Drafter,
    root_id: int,
    pending_ids: list[int],
    params: SamplingParams,
    max_expand: int,
    width: int,
    limits: GrowLimits,
    shape: TreeShape,
    generator: torch.Generator,
    mask: MaskFn | None = None,
) -> Growth:
    """The step's RRS tree (draft.Growth): up to limits.budget nodes below the root, at most
    limits.max_depth draft forwards (the root's catch-up included). With `mask`, q at every node is
    conditioned on the tokens it allows."""
    draft_params = draft_sampling(params)
    threshold = shape.threshold_for(limits.budget)
    logits = yield from drafter.catch_up(pending_ids, root_id)
    tree = root_tree(root_id, drafter.cache.length, logits.device)
    tree.proposals = Proposals(
        token_ids=torch.zeros(1, width, dtype=torch.long, device=logits.device),
        probs=torch.zeros(1, width, device=logits.device),
        ranks=torch.zeros(1, dtype=torch.long, device=logits.device),
    )
    selected = tree.parents.new_zeros(1)
    shape.filled = False
    for forward in range(limits.max_depth):
        if mask is not None:
            logits = restrict(logits, mask(tree, selected))
        ids, probs, ranked = draw_proposals(logits, draft_params, width, generator)
        tree.proposals.token_ids[selected], tree.proposals.probs[selected] = ids, probs
        tree = add_children(tree, selected, shape.child_scores(tree.scores[selected], ranked), threshold,
                            limits.budget)
        if forward == limits.max_depth - 1:
            break
        if tree.num_nodes > limits.budget:
            shape.filled = bool(expandable(tree, limits, threshold).numel())
            break
        selected = expandable(tree, limits, threshold)[: min(max_expand, drafter.room())]
        if selected.numel() == 0:
            break
        logits = yield from drafter.expand(tree, selected)
    return tree


def expandable(tree: Tree, limits: GrowLimits, threshold: torch.Tensor) -> torch.Tensor:
    """Unexpanded nodes whose children could still enter, best first (index order is score order)."""
    candidates = (tree.draft_slots < 0) & ~limits.stop_mask[tree.token_ids] & (tree.depths < limits.max_depth)
    candidates &= tree.scores >= threshold  # a child scores at most its parent
    return candidates.nonzero().squeeze(1)


def add_children(
    tree: Tree, selected: torch.Tensor, child_scores: torch.Tensor, threshold: torch.Tensor, budget: int
) -> Tree:
    """The children of `selected` ([k] nodes, proposals drawn) whose scores (child_scores: [k, w],
    non-increasing along w) reach `threshold`, at most the room left in the budget, best scores
    first; each node's children are a prefix of its row. Returns the tree re-sorted by score."""
    width = child_scores.shape[1]
    room = budget + 1 - tree.num_nodes
    admitted = child_scores.masked_fill(child_scores < threshold, float("-inf")).flatten()
    if room <= 0:
        return tree
    values, picks = admitted.topk(min(room, admitted.numel()))
    picks = picks[values > float("-inf")]  # host sync: the number of new nodes
    counts = torch.zeros(selected.shape[0], dtype=torch.long, device=selected.device)
    counts.index_add_(0, picks // width, torch.ones_like(picks))
    # ties at the cut may pick a later rank of a row: take each row's first `counts` ranks instead
    rows, ranks = (torch.arange(width, device=selected.device)[None, :] < counts[:, None]).nonzero(as_tuple=True)
    parents = selected[rows]
    return append_children(tree, parents, ranks, child_scores[rows, ranks])


def append_children(tree: Tree, parents: torch.Tensor, ranks: torch.Tensor, scores: torch.Tensor) -> Tree:
    """Add the rank-th drawn token of each parent ([m] each) with its score; re-sort every node by score
    (stable: a parent, scoring at least as much, stays before its children)."""
    proposals = tree.proposals
    assert proposals is not None
    num_new, width = parents.shape[0], proposals.token_ids.shape[1]
    all_scores = torch.cat([tree.scores, scores])
    order = torch.sort(all_scores, descending=True, stable=True).indices
    new_index = torch.empty_like(order)
    new_index[order] = torch.arange(order.shape[0], device=order.device)
    all_parents = torch.cat([tree.parents, parents])[order]
    return Tree(
        token_ids=torch.cat([tree.token_ids, proposals.token_ids[parents, ranks]])[order],
        parents=torch.where(all_parents >= 0, new_index[all_parents.clamp(min=0)], all_parents),
        depths=torch.cat([tree.depths, tree.depths[parents] + 1])[order],
        scores=all_scores[order],
        ancestors=append_nodes(tree.ancestors, parents)[order][:, order],
        draft_slots=torch.cat([tree.draft_slots, tree.draft_slots.new_full((num_new,), -1)])[order],
        proposals=Proposals(
            token_ids=torch.cat([proposals.token_ids, proposals.token_ids.new_zeros(num_new, width)])[order],
            probs=torch.cat([proposals.probs, proposals.probs.new_zeros(num_new, width)])[order],
            ranks=torch.cat([proposals.ranks, ranks])[order],
        ),
    )
