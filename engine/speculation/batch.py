"""One engine step over several sequences: grow every tree (in lockstep: one draft pass per round for
all of them), score every tree in ONE target pass, verify each.

The pass is `DecoderRunner.forward_groups`: joining sequences' prompt chunks come first (one group per
chunk, causal), then one group holding every tree (each over its own cache, slots and positions,
masked to its prefix and its own ancestors), so a streamed target loads each layer once per step
however many sequences run. Verification and commit are per sequence, with its own generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model.runner import DecoderRunner, Segment, prefill_groups
from engine.offload.device import PhaseClock
from engine.speculation.draft import run_growths
from engine.speculation.step import (
    PREFILL_CHUNK,
    SequenceState,
    StepContext,
    commit_step,
    prefill,
    step_depth,
    tree_growth,
)
from engine.speculation.tree import Tree, prefix_tree_mask
from engine.types import StepStats


@dataclass
class BatchItem:
    """One running sequence in a step; `prefill_ids` go to the target cache before its tree (a
    sequence joining this step: its prompt after the cached prefix, the root excluded)."""

    ctx: StepContext
    seq: SequenceState
    prefill_ids: list[int]
    draft_prefill_ids: list[int]


def tree_segment(ctx: StepContext, tree: Tree) -> Segment:
    """The tree's nodes at slots cache.length + i, positions cache.length + depth; each sees the
    committed prefix and its own ancestors."""
    start = ctx.target_cache.length
    mask = prefix_tree_mask(tree.ancestors, start)
    return Segment(tree.token_ids, start + tree.depths, ctx.target_cache, start, mask)


def pass_groups(items: list[BatchItem], trees: list[Tree]) -> list[list[Segment]]:
    """Prompt chunks of joining sequences (advancing their caches' lengths), then all trees as one group."""
    groups: list[list[Segment]] = []
    for item in items:
        if item.prefill_ids:
            cache = item.ctx.target_cache
            ids = torch.tensor(item.prefill_ids, device=cache.device)
            groups += prefill_groups(ids, cache, cache.length, PREFILL_CHUNK)
            cache.length += len(item.prefill_ids)
    groups.append([tree_segment(item.ctx, tree) for item, tree in zip(items, trees, strict=True)])
    return groups


def score_trees(target: DecoderRunner, items: list[BatchItem], trees: list[Tree]) -> list[torch.Tensor]:
    """One target pass over every item's pending prompt and tree. Returns each tree's [n_i, vocab] logits."""
    logits = target.forward_groups(pass_groups(items, trees))[-1]
    assert all(part is not None for part in logits), "every tree row asks for logits"
    return [part for part in logits if part is not None]


def run_batch(target: DecoderRunner, items: list[BatchItem]) -> list[tuple[list[int], StepStats]]:
    """Append each sequence's step tokens (accepted path + bonus); returns them and per-sequence stats."""
    assert items, "a step needs a running sequence"
    device = items[0].ctx.target_cache.device
    begin = time.perf_counter()
    clock = PhaseClock(device)  # draft | target, read after the step's host syncs below
    growths = []
    for item in items:
        ctx, seq = item.ctx, item.seq
        if item.draft_prefill_ids:
            prefill(ctx.drafter.runner, ctx.drafter.cache, item.draft_prefill_ids)
        growths.append((ctx.drafter.runner, tree_growth(ctx, seq, step_depth(ctx, seq))))
    trees = run_growths(growths)  # the trees grow in lockstep: one draft pass per round for all
    clock.mark()
    pass_tokens = sum(len(item.prefill_ids) for item in items) + sum(tree.num_nodes for tree in trees)
    logits = score_trees(target, items, trees)
    clock.mark()
    new_ids = [commit_step(item.ctx, item.seq, tree, part) for item, tree, part in zip(items, trees, logits, strict=True)]
    draft_seconds, target_seconds = clock.seconds()
    step_seconds = time.perf_counter() - begin
    return [
        (ids, StepStats(
            tree_size=tree.num_nodes,
            num_accepted=len(ids) - 1,
            num_emitted=len(ids),
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            step_seconds=step_seconds,
            batch_size=len(items),
            pass_tokens=pass_tokens,
            expected_accepted=item.seq.expected_accepted,
        ))
        for ids, tree, item in zip(new_ids, trees, items, strict=True)
    ]
