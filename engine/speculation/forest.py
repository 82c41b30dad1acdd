"""Several SpecExec trees as one search state (a forest): every running request's SearchTree in padded
[S, N] tensors, so a round of best-first growth is one selection, one set of draft inputs and one
add-children for all of them (engine.speculation.forest_growth) instead of one each. On a GPU each of a
round's small ops is then launched once, not once per stream; on the host it is one op over S rows.

Row s holds tree s's nodes first, in index order (= score order, parents before children) exactly as its
SearchTree would, then padding up to N = the largest budget + 1 columns. A padding entry has score -inf
(a real node's score is finite) and nothing else of it is read. A node is expanded iff it has a draft slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.speculation.search_tree import SearchTree

NEG_INF = float("-inf")


@dataclass
class Forest:
    token_ids: torch.Tensor  # [S, N] long
    parents: torch.Tensor  # [S, N] long, -1 at the roots
    depths: torch.Tensor  # [S, N] long
    scores: torch.Tensor  # [S, N] float, non-increasing along a row; -inf exactly at padding
    paths: torch.Tensor  # [S, N, D] long, as SearchTree.paths
    draft_slots: torch.Tensor  # [S, N] long, -1 where never expanded (the draft has not run the node)
    child_lp: torch.Tensor  # [S, N, w] float, the top-w children each expanded node proposed (-inf elsewhere)
    child_ids: torch.Tensor  # [S, N, w] long

    @classmethod
    def of(cls, trees: list[SearchTree], num_nodes: int, width: int) -> Forest:
        """The trees (each of at most num_nodes nodes, its expanded ones with draft slots) padded to
        num_nodes columns; `width` (w) columns of proposals (a tree without any gets -inf)."""
        assert all(tree.num_nodes <= num_nodes for tree in trees), "a tree larger than the forest's rows"
        columns = max(tree.paths.shape[1] for tree in trees)

        def padded(values: list[torch.Tensor], fill: float | int) -> torch.Tensor:
            return torch.stack([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, num_nodes - v.shape[0]),
                                                        value=fill) for v in values])

        def proposals(tree: SearchTree) -> tuple[torch.Tensor, torch.Tensor]:
            if tree.child_lp is None or tree.child_ids is None:
                return (tree.scores.new_full((tree.num_nodes, width), NEG_INF),
                        tree.token_ids.new_zeros((tree.num_nodes, width)))
            return tree.child_lp, tree.child_ids

        lps, ids = zip(*(proposals(tree) for tree in trees), strict=True)
        return cls(
            token_ids=padded([t.token_ids for t in trees], 0),
            parents=padded([t.parents for t in trees], -1),
            depths=padded([t.depths for t in trees], 0),
            scores=padded([t.scores for t in trees], NEG_INF),
            paths=padded([torch.nn.functional.pad(t.paths, (0, columns - t.paths.shape[1]), value=-1) for t in trees], -1),
            draft_slots=padded([t.draft_slots for t in trees], -1),
            child_lp=padded(list(lps), NEG_INF),
            child_ids=padded(list(ids), 0),
        )

    def trees(self) -> list[SearchTree]:
        """Each row's tree (views of the forest's rows, cut to its real nodes). One host sync."""
        sizes = (self.scores > NEG_INF).sum(1).tolist()
        return [SearchTree(self.token_ids[s, :n], self.parents[s, :n], self.depths[s, :n], self.scores[s, :n],
                           self.paths[s, :n], self.draft_slots[s, :n], self.draft_slots[s, :n] >= 0,
                           self.child_lp[s, :n], self.child_ids[s, :n])
                for s, n in enumerate(sizes)]


def select_leaves(forest: Forest, limits: torch.Tensor | int, budgets: torch.Tensor, max_depths: torch.Tensor,
                  go_masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the first limits[s] ([S, 1] long, or one int for all) unexpanded nodes that may still have
    children in the tree: not a stop token (go_masks[s]: [S, vocab] bool, False at stop tokens), shallower than
    max_depths[s] ([S, 1]), and, in a full tree (budgets[s] + 1 nodes; budgets: [S, 1] long, < N), scoring
    above its last (a child scores <= its parent). Per row exactly specexec_growth.select_leaves.
    Returns the selection [S, N] bool and each node's rank among its row's candidates ([S, N] long, from 1)."""
    cut = forest.scores.gather(1, budgets)  # [S, 1]: a full tree's last score; -inf (padding) otherwise
    candidates = (forest.draft_slots < 0) & go_masks.gather(1, forest.token_ids) & (forest.depths < max_depths) \
        & (forest.scores > cut)
    rank = candidates.cumsum(1)
    return candidates & (rank <= limits), rank


def selected_nodes(selection: torch.Tensor, rank: torch.Tensor, width: int) -> torch.Tensor:
    """A selection [S, N] bool (rank: select_leaves') -> [S, width] node indices, each row's selected nodes in
    index order, then 0 (the root: a valid index whose entries the caller ignores). width >= each row's count."""
    num_trees, num_nodes = selection.shape
    column = torch.where(selection, rank - 1, width)  # the unselected land in a spare column
    nodes = torch.arange(num_nodes, device=selection.device).expand(num_trees, num_nodes)
    return rank.new_zeros((num_trees, width + 1)).scatter_(1, column, nodes)[:, :width]


def assign_slots(forest: Forest, selection: torch.Tensor, rank: torch.Tensor, next_slots: torch.Tensor) -> None:
    """Give the selected nodes draft slots next_slots[s] ([S, 1] long) onwards in index order, as
    Drafter.expand does for one tree (which marks them expanded). In place."""
    forest.draft_slots = torch.where(selection, rank + (next_slots - 1), forest.draft_slots)


def draft_inputs(forest: Forest, nodes: torch.Tensor, committed: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selected nodes' draft forward inputs ([S, K] `nodes`, slots assigned; committed: [S, 1] each draft
    cache's committed length): token ids [S, K], positions [S, K] and masks [S, K, width] (what each row
    sees: its committed prefix and the expanded nodes on its path, as SearchTree.draft_mask). Tree s uses
    its first k_s rows and its first (its first slot + k_s) columns."""
    num_trees, num_selected = nodes.shape
    rows = torch.arange(num_trees, device=nodes.device)[:, None]
    ids = forest.token_ids.gather(1, nodes)
    positions = forest.depths.gather(1, nodes) + committed
    path = forest.paths[rows, nodes]  # [S, K, D]
    slots = forest.draft_slots[rows[:, :, None], path.clamp(min=0)]  # [S, K, D]; column 0 is the root's
    seen = torch.where((path >= 0) & (slots >= 0), slots, slots[:, :, :1])
    allowed = (torch.arange(width, device=nodes.device) < committed[:, :, None]).repeat(1, num_selected, 1)
    return ids, positions, allowed.scatter_(2, seen, True)


def add_best_children(forest: Forest, nodes: torch.Tensor, valid: torch.Tensor | None, child_lp: torch.Tensor,
                      child_ids: torch.Tensor, decay: float, budgets: torch.Tensor | None) -> Forest:
    """Add the proposed children (child_lp, child_ids: [S, K, w]) of `nodes` ([S, K]; entries where `valid`
    is False are none; None: all are); keep each row's best budgets[s] + 1 nodes ([S, 1] long; None: N, the
    same for every row). Per row as search_tree.add_best_children (the same nodes in the same order, but for
    ties at a row's cut-off when the budgets differ). The proposals are kept in child_lp / child_ids."""
    num_trees, num_nodes = forest.scores.shape
    width = child_lp.shape[2]
    rows = torch.arange(num_trees, device=nodes.device)[:, None]
    child_scores = forest.scores.gather(1, nodes)[:, :, None] + child_lp  # [S, K, w]
    if decay != 1.0:
        child_scores = child_scores + math.log(decay)
    # the proposals, kept per expanded node (invalid entries go to a spare row)
    if valid is None:
        store_at = nodes[:, :, None].expand(-1, -1, width)
        stored_lp, stored_ids = forest.child_lp.scatter(1, store_at, child_lp), forest.child_ids.scatter(1, store_at, child_ids)
    else:
        child_scores = child_scores.masked_fill(~valid[:, :, None], NEG_INF)
        store_at = torch.where(valid, nodes, num_nodes)[:, :, None].expand(-1, -1, width)
        stored_lp = torch.nn.functional.pad(forest.child_lp, (0, 0, 0, 1)).scatter_(1, store_at, child_lp)[:, :num_nodes]
        stored_ids = torch.nn.functional.pad(forest.child_ids, (0, 0, 0, 1)).scatter_(1, store_at, child_ids)[:, :num_nodes]
    # each row's best N - 1 children (no more can be kept)
    child_scores, flat = child_scores.flatten(1).topk(min(num_selected_children(child_lp), num_nodes - 1), dim=1)
    parents = nodes.gather(1, flat // width)  # [S, B]
    new_ids = child_ids.flatten(1).gather(1, flat)
    depths = forest.depths.gather(1, parents) + 1
    new_nodes = torch.arange(num_nodes, num_nodes + parents.shape[1], device=nodes.device).expand_as(parents)
    paths = forest.paths[rows, parents].scatter_(2, depths[:, :, None], new_nodes[:, :, None])  # [S, B, D]

    scores = torch.cat([forest.scores, child_scores], 1)  # [S, N + B]
    # stable: a parent (lower index, score >= its children's) precedes them, so each kept prefix is closed
    # under ancestors; ties go to old nodes
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_nodes]  # [S, N]
    kept_scores = scores.gather(1, order)
    if budgets is not None:  # past a row's budget + 1: padding
        kept_scores = kept_scores.masked_fill(torch.arange(num_nodes, device=nodes.device) > budgets, NEG_INF)
    new_index = torch.full_like(scores, -1, dtype=torch.long).scatter_(
        1, order, torch.arange(num_nodes, device=nodes.device).expand(num_trees, num_nodes))

    def kept(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        values = torch.cat([old, new], 1)
        return values.gather(1, order.view(*order.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:]))

    def renumbered(refs: torch.Tensor) -> torch.Tensor:  # padding's references may be anything
        return torch.where(refs >= 0, new_index.gather(1, refs.clamp(min=0).flatten(1)).view_as(refs), refs)

    no_children = child_lp.new_full((num_trees, parents.shape[1], width), NEG_INF)
    return Forest(
        token_ids=kept(forest.token_ids, new_ids),
        parents=renumbered(kept(forest.parents, parents)),
        depths=kept(forest.depths, depths),
        scores=kept_scores,
        paths=renumbered(kept(forest.paths, paths)),
        draft_slots=kept(forest.draft_slots, torch.full_like(parents, -1)),
        child_lp=kept(stored_lp, no_children),
        child_ids=kept(stored_ids, torch.zeros_like(no_children, dtype=torch.long)),
    )


def num_selected_children(child_lp: torch.Tensor) -> int:
    """K * w: the proposals of one round in a row."""
    return child_lp.shape[1] * child_lp.shape[2]
