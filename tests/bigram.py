"""A bigram draft (a fixed logits table) driving the engine's real best-first search loop."""

from __future__ import annotations

import torch

from engine.config import SpeculationConfig
from engine.draft import GrowLimits, best_first_search, draft_log_probs, root_tree
from engine.tree import Tree
from engine.types import SamplingParams


def bigram_tree(
    table: torch.Tensor,
    root: int,
    params: SamplingParams,
    spec: SpeculationConfig,
    budget: int,
    stop_mask: torch.Tensor,
) -> Tree:
    """table: [vocab, vocab] draft logits given the previous token."""
    limits = GrowLimits(budget=budget, max_depth=spec.max_depth, stop_mask=stop_mask)

    def expand(tree: Tree, selected: torch.Tensor) -> torch.Tensor:
        return draft_log_probs(table[tree.token_ids[selected]], params, spec.greedy_tree_temperature)

    tree = root_tree(root, 0, torch.device("cpu"))
    root_log_probs = draft_log_probs(table[[root]], params, spec.greedy_tree_temperature)
    return best_first_search(tree, root_log_probs, expand, spec, limits, lambda: 10**6)
