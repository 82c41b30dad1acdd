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


def grown_tree(seed: int, rounds: int, budget: int) -> SearchTree:
    """A tree grown the way searches grow them (add_best_children over random proposals: each round the three
    best unexpanded nodes), every expanded node with a draft slot."""
    gen = torch.Generator().manual_seed(seed)
    search = SearchTree.of(Tree(token_ids=torch.tensor([1]), parents=torch.tensor([-1]), depths=torch.tensor([0]),
                                scores=torch.tensor([0.0]), ancestors=torch.ones(1, 1, dtype=torch.bool),
                                draft_slots=torch.tensor([-1])), max_depth=rounds + 1)
    for _ in range(rounds):
        selected = (~search.expanded).nonzero().squeeze(1)[:3]
        search.expanded[selected] = True
        search.draft_slots[selected] = selected + 100
        child_lp = torch.log_softmax(torch.randn(selected.shape[0], 5, generator=gen) * 2, dim=-1)
        child_ids = torch.stack([torch.randperm(88, generator=gen)[:5] + 2 for _ in range(selected.shape[0])])
        search = add_best_children(search, selected, child_lp, child_ids, decay=1.0, budget=budget, skip_present=True)
    return search


def best_path_anchor_scores(search: SearchTree) -> tuple[list[int], dict[tuple[int, ...], float]]:
    """By hand: the most likely path (each node's highest-scoring child, the lower index on a tie) and each
    node's score less its deepest ancestor-or-self on that path, keyed by the node's token path."""
    parents, scores, tokens = search.parents.tolist(), search.scores.tolist(), search.token_ids.tolist()
    children: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(parents[node], []).append(node)
    best = [0]
    while best[-1] in children:
        best.append(max(children[best[-1]], key=lambda c: (scores[c], -c)))
    out = {}
    for node in range(len(parents)):
        path = path_of(parents, node)
        anchor = max((a for a in path if a in best), key=path.index)
        out[tuple(tokens[a] for a in path)] = scores[node] - scores[anchor]
    return best, out


def test_scores_conditioned_on_the_best_path_are_relative_to_where_each_node_leaves_it() -> None:
    for seed in range(12):
        search = grown_tree(seed, rounds=6, budget=40)
        best, expected = best_path_anchor_scores(search)
        cond = search.conditioned_on_best_path()
        parents, tokens = cond.parents.tolist(), cond.token_ids.tolist()
        got = {tuple(tokens[a] for a in path_of(parents, node)): float(cond.scores[node]) for node in range(cond.num_nodes)}
        assert got.keys() == expected.keys() and all(abs(got[k] - expected[k]) < 1e-5 for k in got)
        assert all(abs(got[tuple(search.token_ids[a].item() for a in best[: i + 1])]) < 1e-6 for i in range(len(best)))
        assert (cond.scores[1:] <= cond.scores[:-1]).all()  # index order is score order
        assert all(0 <= parent < node for node, parent in enumerate(parents) if node > 0)  # parents first
        for node in range(cond.num_nodes):
            path = path_of(parents, node)
            assert cond.paths[node, : len(path)].tolist() == path and (cond.paths[node, len(path):] == -1).all()
        # each node's slot and expanded flag travel with it
        slots = {tuple(search.token_ids[a].item() for a in path_of(search.parents.tolist(), n)): int(search.draft_slots[n])
                 for n in range(search.num_nodes)}
        assert all(slots[tuple(tokens[a] for a in path_of(parents, n))] == int(cond.draft_slots[n]) for n in range(cond.num_nodes))
        assert torch.equal(cond.expanded, cond.draft_slots >= 0)


def test_a_subtree_off_the_best_path_reads_the_same_scores_conditioned_or_not() -> None:
    """A seed (the subtree under a node off the best path, as at a step's bonus token) is the same tree either way."""
    for seed in range(12):
        search = grown_tree(50 + seed, rounds=6, budget=40)
        best, _ = best_path_anchor_scores(search)
        cond = search.conditioned_on_best_path()
        off = [n for n in range(1, search.num_nodes) if n not in best]
        for node in off[:4]:
            key = [int(search.token_ids[a]) for a in path_of(search.parents.tolist(), node)]
            match = next(n for n in range(cond.num_nodes)
                         if [int(cond.token_ids[a]) for a in path_of(cond.parents.tolist(), n)] == key)
            depth = len(key) - 1
            a, b = search.subtree(node, depth), cond.subtree(match, depth)
            for field in ("token_ids", "parents", "depths", "draft_slots"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field
            assert torch.allclose(a.scores, b.scores, atol=1e-5)


def finished(growth):
    """The value a growth returns when nothing it expands needs a real forward (the fake draft's)."""
    try:
        next(growth)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the growth yielded a forward")


def test_an_extension_grows_where_the_next_root_most_likely_is() -> None:
    """A scored tree whose best path the target is likely to accept (each proposal: p = 0.8, then 0.15 and 0.05):
    the next root is then the best child of that path's leaf, and the extension's subtree under it is the next
    step's seed. Grown from scores conditioned on the best path, the seed is several times the one grown by global
    scores (where the deep subtree's scores rank below every shallow sibling's)."""
    from types import SimpleNamespace

    from engine.config import SpeculationConfig
    from engine.speculation.drafter import GrowLimits
    from engine.speculation.overlap import extension_start
    from engine.speculation.specexec_growth import best_first_search, reoffer, search_from_root

    vocab, budget = 8, 24
    proposal = torch.full((vocab,), -30.0)
    proposal[1:4] = torch.tensor([0.8, 0.15, 0.05]).log()
    spec = SpeculationConfig(max_children=3, decay=1.0)
    stop_mask = torch.zeros(vocab, dtype=torch.bool)
    slots = iter(range(1, 10_000))

    def expand(tree, selected):  # the fake draft: every node proposes the same children
        tree.draft_slots[selected] = torch.tensor([next(slots) for _ in range(selected.shape[0])])
        return proposal.expand(selected.shape[0], vocab)
        yield  # a generator that never needs a real forward

    root = Tree(token_ids=torch.tensor([1]), parents=torch.tensor([-1]), depths=torch.tensor([0]),
                scores=torch.tensor([0.0]), ancestors=torch.ones(1, 1, dtype=torch.bool), draft_slots=torch.tensor([0]))
    scored = finished(search_from_root(root, proposal[None], expand, spec, GrowLimits(budget, 32, stop_mask),
                                       lambda: 10_000)).tree()
    best, _ = best_path_anchor_scores(SearchTree.of(scored, 32))
    leaf_tokens = [int(scored.token_ids[n]) for n in best[1:]]
    limits = GrowLimits(2 * budget, 64, stop_mask)  # the extension: twice the budget (--extension-factor 2)

    def seed_size(start: SearchTree) -> int:
        grown = finished(best_first_search(start, expand, spec, limits, lambda: 10_000, None, max_forwards=8))
        tokens, parents = grown.token_ids.tolist(), grown.parents.tolist()
        node = 0
        for token in [*leaf_tokens, 1]:  # the best path, then the bonus: the leaf's best child
            node = next((c for c in range(grown.num_nodes) if parents[c] == node and tokens[c] == token), None)
            if node is None:
                return 0
        return int((grown.paths[:, len(leaf_tokens) + 1] == node).sum())

    drafter = SimpleNamespace(tree_device=torch.device("cpu"))
    conditioned = seed_size(extension_start(drafter, scored, spec, limits))  # type: ignore[arg-type]
    by_global_scores = seed_size(reoffer(SearchTree.of(scored, limits.max_depth), spec, limits))
    assert conditioned >= 8 and conditioned >= 3 * max(by_global_scores, 1), (conditioned, by_global_scores)
