"""A bigram draft (a fixed logits table) driving the engine's real tree builders: the best-first
search loop (SpecExec), the sampled-chains builder (SpecInfer) and RRS trees' growth."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import torch

from engine.config import SpeculationConfig
from engine.model.runner import Segment
from engine.speculation.drafter import GrowLimits, MaskFn, root_tree, run_growth
from engine.speculation.rrs_growth import grow_rrs_tree
from engine.speculation.rrs_shape import TreeShape
from engine.speculation.specexec_growth import draft_log_probs, search_from_root
from engine.speculation.specinfer_growth import grow_sampled_tree
from engine.speculation.tree import Tree
from engine.types import SamplingParams


def bigram_tree(
    table: torch.Tensor,
    root: int,
    params: SamplingParams,
    spec: SpeculationConfig,
    budget: int,
    stop_mask: torch.Tensor,
    mask: MaskFn | None = None,
) -> Tree:
    """table: [vocab, vocab] draft logits given the previous token; mask: a grammar's draft masks."""
    limits = GrowLimits(budget=budget, max_depth=spec.max_depth, stop_mask=stop_mask)

    def expand(tree: Tree, selected: torch.Tensor) -> Iterator[Segment]:
        return draft_log_probs(table[tree.token_ids[selected]], params, spec.greedy_tree_temperature)
        yield  # a growth step that needs no draft forward

    tree = root_tree(root, 0, torch.device("cpu"))
    root_log_probs = draft_log_probs(table[[root]], params, spec.greedy_tree_temperature)
    return run_growth(None, search_from_root(tree, root_log_probs, expand, spec, limits, lambda: 10**6, mask)).tree()


class BigramDrafter:
    """Stands in for engine.speculation.drafter.Drafter: the draft's logits for a node are the table's row for
    the node's own token; its cache has unlimited room."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.cache = SimpleNamespace(length=0)

    def catch_up(self, pending_ids: list[int], root_id: int) -> Iterator[Segment]:
        return self.table[[root_id]].clone()
        yield  # like Drafter's, a generator; it needs no draft forward

    def expand(self, tree: Tree, selected: torch.Tensor) -> Iterator[Segment]:
        tree.draft_slots[selected] = 1  # expanded, as Drafter.expand marks them (its slots are never read here)
        return self.table[tree.token_ids[selected]].clone()
        yield

    def room(self) -> int:
        return 10**6


def bigram_sampled_tree(
    table: torch.Tensor,
    root: int,
    params: SamplingParams,
    budget: int,
    max_depth: int,
    stop_mask: torch.Tensor,
    generator: torch.Generator,
    mask: MaskFn | None = None,
) -> Tree:
    """The SpecInfer tree the engine builds (grow_sampled_tree) over the bigram draft."""
    limits = GrowLimits(budget=budget, max_depth=max_depth, stop_mask=stop_mask)
    return run_growth(None, grow_sampled_tree(BigramDrafter(table), root, [], params, limits, generator, mask))


def bigram_rrs_tree(
    table: torch.Tensor,
    root: int,
    params: SamplingParams,
    spec: SpeculationConfig,
    budget: int,
    stop_mask: torch.Tensor,
    generator: torch.Generator,
    shape: TreeShape,
    mask: MaskFn | None = None,
) -> Tree:
    """The RRS tree the engine grows (grow_rrs_tree) over the bigram draft, shaped by `shape`."""
    limits = GrowLimits(budget=budget, max_depth=spec.max_depth, stop_mask=stop_mask)
    growth = grow_rrs_tree(BigramDrafter(table), root, [], params, spec.max_expand, spec.max_children, limits,
                           shape, generator, mask)
    return run_growth(None, growth)
