"""Unit tests on hand-built inputs: tree growth, masks, cache commit, logits processing."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.config import SpeculationConfig
from engine.model.kv_cache import KVCache
from engine.speculation.sampling import process_logits
from engine.speculation.tree import Tree, append_nodes, causal_mask, path_token_counts, prefix_tree_mask
from engine.speculation.verify import verify_tree
from engine.types import SamplingParams
from tests.helpers.bigram import bigram_tree

VOCAB = 5


def bigram_best_first(
    table: torch.Tensor, budget: int, spec: SpeculationConfig, stop: torch.Tensor, temperature: float = 1.0
) -> Tree:
    """grow_tree's search loop with a bigram draft in place of a model forward."""
    return bigram_tree(table, 0, SamplingParams(temperature=temperature), spec, budget, stop)


def node_paths(tree: Tree) -> list[tuple[int, ...]]:
    paths = []
    for node in range(tree.num_nodes):
        ids = tree.ancestors[node].nonzero().squeeze(1)
        paths.append(tuple(tree.token_ids[ids[1:]].tolist()))
    return paths


def brute_force_top(
    table: torch.Tensor, budget: int, max_depth: int, stop: set[int], temperature: float = 1.0
) -> set[tuple[int, ...]]:
    log_probs = (table / temperature).log_softmax(-1)
    scored = []
    for depth in range(1, max_depth + 1):
        for seq in itertools.product(range(VOCAB), repeat=depth):
            if any(t in stop for t in seq[:-1]):
                continue  # stop tokens are never expanded
            prev, score = 0, 0.0
            for token in seq:
                score += float(log_probs[prev, token])
                prev = token
            scored.append((score, seq))
    scored.sort(reverse=True)
    return {seq for _, seq in scored[:budget]}


@pytest.mark.parametrize(("budget", "max_expand"), [(1, 1), (7, 2), (20, 3), (40, 64)])
@pytest.mark.parametrize(
    ("temperature", "tree_temperature", "scored_at"),
    [(1.0, 0.5, 1.0), (0.0, 1.0, 1.0), (0.0, 0.5, 0.5), (0.0, 0.3, 0.3), (0.7, 0.5, 0.7)],
)
def test_tree_growth_picks_the_best_nodes_and_is_closed(budget, max_expand, temperature, tree_temperature, scored_at):
    """Sampled requests rank nodes at their own temperature; greedy ones at greedy_tree_temperature."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(budget)) * 2
    stop = torch.zeros(VOCAB, dtype=torch.bool)
    stop[4] = True
    spec = SpeculationConfig(
        budget=budget, max_expand=max_expand, max_children=VOCAB, max_depth=6, greedy_tree_temperature=tree_temperature
    )
    tree = bigram_best_first(table, budget, spec, stop, temperature)
    assert tree.num_nodes == budget + 1  # budget draft tokens + root
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
    assert (tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all()
    paths = node_paths(tree)
    assert len(set(paths)) == len(paths)  # siblings are distinct
    assert set(paths[1:]) == brute_force_top(table, budget, 6, {4}, scored_at)
    wrong = tree_temperature if temperature > 0 else 1.0  # what ignoring the rule would rank at
    if budget >= 20 and wrong != scored_at:  # small trees coincide at every temperature
        assert brute_force_top(table, budget, 6, {4}, wrong) != set(paths[1:])  # the case tells them apart
    for node, path in enumerate(paths):  # no stop token was ever expanded
        assert 4 not in path[:-1], (node, path)


def test_tree_growth_respects_width_and_depth():
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3))
    spec = SpeculationConfig(budget=50, max_expand=4, max_children=2, max_depth=3)
    tree = bigram_best_first(table, 50, spec, torch.zeros(VOCAB, dtype=torch.bool))
    assert int(tree.depths.max()) <= 3
    child_counts = torch.bincount(tree.parents[1:], minlength=tree.num_nodes)
    assert int(child_counts.max()) <= 2
    assert tree.num_nodes <= 51
    ancestors_ok = tree.ancestors == torch.stack([tree.ancestors[p] | (torch.arange(tree.num_nodes) == i)
                                                  if p >= 0 else tree.ancestors[0]
                                                  for i, p in enumerate(tree.parents.tolist())])
    assert ancestors_ok.all()


def hand_tree() -> Tree:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    ancestors = torch.ones(1, 1, dtype=torch.bool)
    for node in range(1, 6):
        ancestors = append_nodes(ancestors, parents[node : node + 1])
    return Tree(
        token_ids=torch.tensor([9, 1, 2, 3, 4, 1]),
        parents=parents,
        depths=torch.tensor([0, 1, 1, 2, 2, 2]),
        scores=torch.zeros(6),
        ancestors=ancestors,
        draft_slots=torch.full((6,), -1),
    )


def test_ancestor_mask_spans_prefix_and_tree():
    tree = hand_tree()
    mask = prefix_tree_mask(tree.ancestors, prefix_len=3)
    expected_tree = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert mask.shape == (6, 9)
    assert mask[:, :3].all()
    assert torch.equal(mask[:, 3:], expected_tree)
    assert torch.equal(causal_mask(2, 3, torch.device("cpu")), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool())


def test_path_token_counts_follow_each_path():
    tree = hand_tree()
    counts = path_token_counts(tree, 10)
    assert counts[5].tolist()[:5] == [0, 1, 1, 0, 0]  # path 2 -> 1
    assert counts[3].tolist()[:5] == [0, 1, 0, 1, 0]
    assert counts[0].sum() == 0 and counts[:, 9].sum() == 0  # the root: the sequence's counts hold it


def test_verify_walks_matching_children_greedy():
    tree = hand_tree()
    logits = torch.full((6, 10), -5.0)
    logits[0, 1] = 5  # root -> token 1 (node 1)
    logits[1, 4] = 5  # node 1 -> token 4 (node 4)
    logits[4, 7] = 5  # bonus after node 4
    logits[2, 1] = 5
    verdict = verify_tree(tree, logits, greedy=True, generator=torch.Generator())
    assert verdict.path.tolist() == [0, 1, 4]
    assert int(verdict.bonus_id) == 7


def test_kv_commit_keeps_exactly_the_accepted_rows():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=3, capacity=12, dtype=torch.float32,
                    device=torch.device("cpu"))
    cache.keys[:] = torch.arange(12.0)[None, None, :, None]
    cache.values[:] = -torch.arange(12.0)[None, None, :, None]
    cache.positions[:] = torch.arange(12) + 100
    cache.length = 4
    cache.commit(torch.tensor([4, 6, 9]))
    assert cache.length == 7
    assert cache.keys[1, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert cache.values[0, 0, :7, 2].tolist() == [0, -1, -2, -3, -4, -6, -9]
    assert cache.positions[:7].tolist() == [100, 101, 102, 103, 104, 106, 109]


def test_top_p_keeps_the_most_likely_tokens_on_flat_distributions():
    logits = torch.log(torch.tensor([[0.26, 0.25, 0.25, 0.24]]))
    out = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_top_k_min_p_bias_and_penalties():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(process_logits(logits, SamplingParams(top_k=2))).sum() == 2
    assert torch.isfinite(process_logits(logits, SamplingParams(min_p=0.2))).tolist() == [[True, True, True, False]]
    biased = process_logits(logits, SamplingParams(temperature=0.0, logit_bias={3: 100.0}))
    assert int(biased.argmax()) == 3
    counts = torch.tensor([[2.0, 0, 0, 0]])
    penalised = process_logits(logits, SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5),
                               counts)
    assert math.isclose(float(penalised[0, 0]), math.log(0.5) - 2.5, rel_tol=1e-6)
    rep = process_logits(torch.tensor([[2.0, -2.0]]), SamplingParams(temperature=0.0, repetition_penalty=2.0),
                         torch.tensor([[1.0, 1.0]]))
    assert rep.tolist() == [[1.0, -4.0]]
