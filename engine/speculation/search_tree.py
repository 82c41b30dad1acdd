"""A SpecExec tree while best-first search grows it (engine.speculation.specexec_growth).

It holds Tree's fields with one difference: each node's path is a row of node indices (`paths`, [n, D])
instead of a row of the [n, n] ancestor matrix. Every forward re-sorts the tree by score (index order is
score order, parents first), and re-indexing paths costs O(n * D) where the ancestor matrix cost O(n^2):
at budget 1024 that was most of a draft forward's bookkeeping. A search starts from a Tree
(`SearchTree.of`) and ends as one (`tree()`, its ancestor matrix built once); an overlap extension stays a
SearchTree (it may hold many times the budget), and its subtree under the step's outcome seeds the next search.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from engine.speculation.tree import Tree, renumbered, renumbering


@dataclass
class SearchTree:
    token_ids: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 at the root
    depths: torch.Tensor  # [n] long, 0 at the root
    scores: torch.Tensor  # [n] float, cumulative draft log-prob (+ log decay per level); non-increasing in index
    paths: torch.Tensor  # [n, D] long: paths[i, d] is the node at depth d on i's path (i at depths[i]), -1 deeper
    draft_slots: torch.Tensor  # [n] long, the node's draft KV slot, -1 if never expanded
    expanded: torch.Tensor  # [n] bool, the draft ran the node (or it is selected for the next forward)
    child_lp: torch.Tensor | None = None  # [n, w] the top-w children each expanded node proposed (-inf elsewhere)
    child_ids: torch.Tensor | None = None  # [n, w] their token ids
    extension_forwards: int = 0  # draft forwards an extension spent growing it beside a pass (overlap)

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds (an extension's, made on the draft stream, is handed to the main
        stream with PassStreams.hand_over)."""
        fields = (self.token_ids, self.parents, self.depths, self.scores, self.paths, self.draft_slots, self.expanded,
                  self.child_lp, self.child_ids)
        return [t for t in fields if t is not None]

    @classmethod
    def of(cls, tree: Tree, max_depth: int) -> SearchTree:
        """The tree as a search state whose nodes may reach depth `max_depth` (D = max_depth + 1, or more if
        the tree is deeper already: one host sync then). Nodes with a draft slot count as expanded; the
        draft slots are a copy (the search assigns slots in place)."""
        num_nodes = tree.num_nodes
        if num_nodes > 1:
            max_depth = max(max_depth, int(tree.depths.max()))
        columns = max_depth + 1
        # every ancestor j of i lands at column depths[j]; the other pairs in a spare last column
        cols = torch.where(tree.ancestors, tree.depths[None, :], columns)  # [n, n]
        nodes = torch.arange(num_nodes, device=cols.device).expand(num_nodes, num_nodes)
        paths = torch.full((num_nodes, columns + 1), -1, dtype=torch.long, device=cols.device)
        paths = paths.scatter_(1, cols, nodes)[:, :columns].contiguous()
        return cls(tree.token_ids, tree.parents, tree.depths, tree.scores, paths, tree.draft_slots.clone(),
                   tree.draft_slots >= 0, tree.child_lp, tree.child_ids)

    def tree(self) -> Tree:
        """The grown tree, its [n, n] ancestor matrix built from the paths (-1 entries point at the root,
        every node's ancestor anyway)."""
        num_nodes = self.num_nodes
        ancestors = torch.zeros(num_nodes, num_nodes, dtype=torch.bool, device=self.paths.device)
        ancestors.scatter_(1, self.paths.clamp(min=0), True)
        return Tree(token_ids=self.token_ids, parents=self.parents, depths=self.depths, scores=self.scores,
                    ancestors=ancestors, draft_slots=self.draft_slots, child_lp=self.child_lp,
                    child_ids=self.child_ids, extension_forwards=self.extension_forwards)

    def widened(self, max_depth: int) -> SearchTree:
        """The same tree with paths of at least max_depth + 1 columns (nodes may reach depth max_depth)."""
        missing = max_depth + 1 - self.paths.shape[1]
        if missing <= 0:
            return self
        return dataclasses.replace(self, paths=torch.nn.functional.pad(self.paths, (0, missing), value=-1))

    def keep(self, nodes: torch.Tensor) -> SearchTree:
        """The tree restricted to `nodes` ([m] indices, closed under ancestors, the root first; in their order:
        ascending, or any order with parents before children)."""
        new_index = renumbering(nodes, self.num_nodes)
        return SearchTree(
            token_ids=self.token_ids[nodes],
            parents=renumbered(self.parents[nodes], new_index),
            depths=self.depths[nodes],
            scores=self.scores[nodes],
            paths=renumbered(self.paths[nodes], new_index),
            draft_slots=self.draft_slots[nodes],
            expanded=self.expanded[nodes],
            child_lp=None if self.child_lp is None else self.child_lp[nodes],
            child_ids=None if self.child_ids is None else self.child_ids[nodes],
            extension_forwards=self.extension_forwards,
        )

    def subtree(self, node: int, depth: int) -> SearchTree:
        """The subtree under `node` (at `depth`), re-rooted there: depths, scores and paths relative to it
        (index order, hence score order and parents before children, is kept)."""
        sub = self.keep((self.paths[:, depth] == node).nonzero().squeeze(1))  # node and its descendants
        sub.parents[0] = -1
        paths = torch.nn.functional.pad(sub.paths[:, depth:], (0, depth), value=-1)  # dropped ancestors: -1 anyway
        return dataclasses.replace(sub, depths=sub.depths - depth, scores=sub.scores - sub.scores[0], paths=paths)

    def conditioned_on_best_path(self) -> SearchTree:
        """The tree re-scored as if its most likely path (from the root, each node's best child, to a leaf) were
        accepted: a node's score less that of its deepest ancestor on the path (itself if on it), so the path
        scores 0 and the subtree under its leaf ranks as a fresh tree rooted there. Re-sorted (index order stays
        score order, parents before children: a child scores at most its parent). Any subtree that holds no
        path node keeps its scores relative to its own root (SearchTree.subtree)."""
        num_nodes = self.num_nodes
        nodes = torch.arange(num_nodes, device=self.parents.device)
        # a node's best child is its first in index (score) order
        best_child = torch.full((num_nodes,), num_nodes, dtype=torch.long, device=nodes.device)
        best_child.scatter_reduce_(0, self.parents[1:], nodes[1:], reduce="amin")
        is_best = torch.ones(num_nodes, dtype=torch.bool, device=nodes.device)
        is_best[1:] = best_child[self.parents[1:]] == nodes[1:]
        # on the path: every node of its own path is its parent's best child; those nodes are a prefix of a path
        on_path = (is_best[self.paths.clamp(min=0)] | (self.paths < 0)).all(dim=1)  # [n]
        path_depth = (on_path[self.paths.clamp(min=0)] & (self.paths >= 0)).sum(dim=1) - 1  # [n], >= 0 (the root)
        anchor = self.paths.gather(1, path_depth[:, None]).squeeze(1)  # [n] the deepest path node above each
        scores = self.scores - self.scores[anchor]
        order = torch.sort(scores, descending=True, stable=True).indices
        return dataclasses.replace(self, scores=scores).keep(order)

    def trim(self, max_nodes: int, max_depth: int) -> SearchTree:
        """The first `max_nodes` nodes no deeper than `max_depth` (an index prefix of an ancestor-closed set
        stays closed under ancestors)."""
        shallow = (self.depths <= max_depth).nonzero().squeeze(1)[:max_nodes]
        return self if shallow.shape[0] == self.num_nodes else self.keep(shallow)

    def draft_mask(self, selected: torch.Tensor, committed: int, width: int) -> torch.Tensor:
        """[k, width] bool: what each of `selected` ([k], its draft slot assigned) sees in the draft cache:
        the committed slots [0, committed) and the slots of the expanded nodes on its path (itself included).
        Path entries without a slot point at the root's slot, which every node sees."""
        allowed = torch.zeros(selected.shape[0], width, dtype=torch.bool, device=selected.device)
        allowed[:, :committed] = True
        path = self.paths[selected]  # [k, D]
        slots = self.draft_slots[path.clamp(min=0)]  # [k, D]; column 0 is the root's
        return allowed.scatter_(1, torch.where((path >= 0) & (slots >= 0), slots, slots[:, :1]), True)


def child_keys(parents: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """One int64 per (parent node, token) pair."""
    return parents * (1 << 32) + token_ids


def add_best_children(
    tree: SearchTree,
    selected: torch.Tensor,
    child_lp: torch.Tensor,
    child_ids: torch.Tensor,
    decay: float,
    budget: int,
    skip_present: bool = False,
) -> SearchTree:
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
    num_new = child_ids.shape[0]
    child_depths = tree.depths[child_parents] + 1
    new_nodes = torch.arange(num_nodes, num_nodes + num_new, device=child_ids.device)
    child_paths = tree.paths[child_parents].scatter_(1, child_depths[:, None], new_nodes[:, None])  # [m, D]

    scores = torch.cat([tree.scores, flat_scores])
    # Stable sort: a parent (lower index, score >= child's) always precedes its children, so
    # every prefix of `order` is closed under ancestors.
    order = torch.sort(scores, descending=True, stable=True).indices[: budget + 1]
    new_index = renumbering(order, scores.shape[0])
    return SearchTree(
        token_ids=torch.cat([tree.token_ids, child_ids])[order],
        parents=renumbered(torch.cat([tree.parents, child_parents])[order], new_index),
        depths=torch.cat([tree.depths, child_depths])[order],
        scores=scores[order],
        paths=renumbered(torch.cat([tree.paths, child_paths])[order], new_index),
        draft_slots=torch.cat([tree.draft_slots, tree.draft_slots.new_full((num_new,), -1)])[order],
        expanded=torch.cat([tree.expanded, tree.expanded.new_zeros(num_new)])[order],
        child_lp=torch.cat([stored_lp, stored_lp.new_full((num_new, width), float("-inf"))])[order],
        child_ids=torch.cat([stored_ids, stored_ids.new_zeros((num_new, width))])[order],
        extension_forwards=tree.extension_forwards,
    )
