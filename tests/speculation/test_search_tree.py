"""SearchTree (a SpecExec tree while it grows: paths instead of the ancestor matrix) against ancestor matrices
built from parent lists by hand (tests.helpers.trees), and its draft masks against Tree.draft_mask's."""

from __future__ import annotations

import torch

from engine.speculation.search_tree import SearchTree, add_best_children
from engine.speculation.tree import Tree
from tests.helpers.trees import ancestors_and_depths, path_of


def random_tree(seed: int, num_nodes: int) -> Tree:
    """Parents drawn below each node, scores non-increasing down every path, some nodes with draft slots."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, num_nodes)]
    ancestors, depths = ancestors_and_depths(parents)
    scores = -depths.float() - torch.rand(num_nodes, generator=gen) * 0.1
    slots = torch.where(torch.rand(num_nodes, generator=gen) < 0.5, torch.arange(num_nodes) + 20, -1)
    slots[0] = 19
    for node in range(num_nodes):  # a node with a slot has every ancestor with one (expanded before it)
        if any(slots[a] < 0 for a in path_of(parents, node)[:-1]):
            slots[node] = -1
    return Tree(token_ids=torch.randint(0, 50, (num_nodes,), generator=gen), parents=torch.tensor(parents),
                depths=depths, scores=scores, ancestors=ancestors, draft_slots=slots)


def test_a_tree_round_trips_through_its_paths() -> None:
    for seed in range(20):
        tree = random_tree(seed, 1 + 3 * seed)
        search = SearchTree.of(tree, max_depth=2)  # deeper trees widen the paths (one host sync)
        for node in range(tree.num_nodes):
            path = path_of(tree.parents.tolist(), node)
            assert search.paths[node, : len(path)].tolist() == path
            assert (search.paths[node, len(path):] == -1).all()
        back = search.tree()
        assert torch.equal(back.ancestors, tree.ancestors)
        assert torch.equal(search.expanded, tree.draft_slots >= 0)


def test_draft_masks_match_the_ancestor_matrix() -> None:
    for seed in range(20):
        tree = random_tree(100 + seed, 2 + 4 * seed)
        search = SearchTree.of(tree, max_depth=8)
        selected = torch.nonzero(tree.draft_slots >= 0).squeeze(1)[-3:]
        committed, width = 19, 20 + tree.num_nodes
        assert torch.equal(search.draft_mask(selected, committed, width), tree.draft_mask(selected, committed, width))


def test_added_children_keep_paths_and_order() -> None:
    """Children of a few nodes added, the tree cut to a budget: each kept node's path is its parents' chain,
    scores stay in index order, and the cut keeps every kept node's ancestors."""
    gen = torch.Generator().manual_seed(7)
    tree = random_tree(3, 12)
    search = SearchTree.of(tree, max_depth=10)
    for budget in (20, 15, 30):
        selected = torch.tensor([0, 1, int(torch.randint(2, search.num_nodes, (1,), generator=gen))]).unique()
        child_lp = -torch.rand(selected.shape[0], 4, generator=gen) * 3
        child_ids = torch.randint(0, 50, (selected.shape[0], 4), generator=gen)
        search = add_best_children(search, selected, child_lp, child_ids, decay=0.9, budget=budget)
        assert search.num_nodes <= budget + 1
        assert (search.scores[1:] <= search.scores[:-1]).all()
        parents = search.parents.tolist()
        assert all(0 <= parent < node for node, parent in enumerate(parents) if node > 0)
        expected, depths = ancestors_and_depths(parents)
        assert torch.equal(search.tree().ancestors, expected) and torch.equal(search.depths, depths)
