"""One engine step over several sequences: grow every tree (in lockstep: one draft pass per round for
all of them; SpecExec trees as one forest, engine.speculation.forest_growth), score every tree in ONE
target pass, verify each.

The pass is `DecoderRunner.forward_groups`: joining sequences' prompt slices come first (one group
per chunk, causal), then one group holding every tree (each over its own cache, slots and positions,
masked to its prefix and its own ancestors), so a streamed target loads each layer once per step
however many sequences run. With `PassStreams` the pass runs in a thread of its own while the draft
grows the trees on (engine.speculation.overlap). Verification and commit are per sequence, with its
own generator; an error in one sequence's tree or verification fails that sequence alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.faults import request_error
from engine.model.runner import DecoderRunner, Segment, prefill_groups
from engine.offload.device import PassStreams, PhaseClock
from engine.speculation.drafter import run_growths
from engine.speculation.overlap import BackgroundPass
from engine.speculation.search_tree import SearchTree
from engine.speculation.step import (
    PREFILL_CHUNK,
    SequenceState,
    StepContext,
    can_extend,
    commit_step,
    extends_in_forest,
    extension_forest,
    extension_growth,
    forest_growth,
    in_forest,
    prefill,
    step_depth,
    tree_growth,
)
from engine.speculation.tree import Tree, prefix_tree_mask
from engine.types import StepStats

# a sequence's outcome of a step: its new tokens and stats; None while it only prefilled; or its error
ItemResult = tuple[list[int], StepStats] | None | Exception


@dataclass
class BatchResult:
    """A step's outcome per sequence (in the items' order) and its pass as a whole."""

    results: list[ItemResult]
    pass_tokens: int  # prompt slices and tree nodes the target pass scored
    draft_seconds: float  # growing the trees before the pass
    target_seconds: float  # the pass (the draft's extensions ran beside it)
    overlap_seconds: float  # the draft's extensions, within target_seconds
    step_seconds: float
    extension_forwards: int = 0  # draft passes the extensions ran beside the target pass
    draft_forwards: int = 0  # draft passes that grew the trees before the pass
    seeded_trees: int = 0  # trees that grew on from the last pass's extension (overlap), not afresh


@dataclass
class Extended:
    """Draft passes of a step's growths and their time: before the target pass, or beside it (overlap)."""

    forwards: int = 0  # draft passes (of the growth before the pass, or of the extensions beside it)
    seconds: float = 0.0  # extensions: host time from the pass's start until they stopped
    seeded: int = 0  # the growth before the pass: trees with a seed to grow on

    def count(self) -> None:
        self.forwards += 1


@dataclass
class BatchItem:
    """One running sequence in a step; `prefill_ids` go to the target cache before its tree (a slice of
    a joining sequence's prompt after the cached prefix, the root excluded). Without `decode` the
    sequence only prefills this step (more of its prompt follows): no tree."""

    ctx: StepContext
    seq: SequenceState
    prefill_ids: list[int]
    draft_prefill_ids: list[int]
    decode: bool = True


def tree_segment(ctx: StepContext, tree: Tree) -> Segment:
    """The tree's nodes at slots cache.length + i, positions cache.length + depth; each sees the
    committed prefix and its own ancestors."""
    start = ctx.target_cache.length
    mask = prefix_tree_mask(tree.ancestors, start)
    return Segment(tree.token_ids, start + tree.depths, ctx.target_cache, start, mask)


def pass_groups(items: list[BatchItem], trees: list[Tree | None]) -> list[list[Segment]]:
    """Prompt slices (advancing their caches' lengths), then every tree as one group (if any)."""
    groups: list[list[Segment]] = []
    for item in items:
        if item.prefill_ids:
            cache = item.ctx.target_cache
            ids = torch.tensor(item.prefill_ids, device=cache.device)
            groups += prefill_groups(ids, cache, cache.length, PREFILL_CHUNK)
            cache.length += len(item.prefill_ids)
    segments = [tree_segment(item.ctx, tree) for item, tree in zip(items, trees, strict=True) if tree is not None]
    return groups + [segments] if segments else groups


def grow_trees(items: list[BatchItem], forwards: Extended) -> list[Tree | None | Exception]:
    """Each item's draft prefill slice, then its tree (None while it only prefills), grown in lockstep:
    SpecExec trees without a grammar as one forest per draft runner when there are two or more
    (step.in_forest), the others one growth each. If a forest's growth fails, its trees grow again one
    growth each, so that only the failing request fails. `forwards` counts the draft passes of the growth."""
    outcomes: list[Tree | None | Exception] = [None] * len(items)
    planned: list[Planned] = []
    foresting = []  # items whose trees may grow in a forest
    for index, item in enumerate(items):
        ctx, seq = item.ctx, item.seq
        try:
            if item.draft_prefill_ids:
                prefill(ctx.drafter.runner, ctx.drafter.cache, item.draft_prefill_ids)
            forwards.seeded += item.decode and ctx.seed is not None
            if item.decode and in_forest(ctx, seq, step_depth(ctx, seq)):
                foresting.append(index)
            elif item.decode:
                planned.append(own_growth(items, index))
        except Exception as exc:
            outcomes[index] = request_error(exc)
    for members in by_runner(items, foresting):  # a lone tree grows on its own (fewer ops so)
        parts = [(items[i].ctx, items[i].seq, step_depth(items[i].ctx, items[i].seq)) for i in members]
        planned.append((members, items[members[0]].ctx.drafter.runner, forest_growth(parts)) if len(members) > 1
                       else own_growth(items, members[0]))
    failed = grow_into(outcomes, planned, forwards)
    grow_into(outcomes, [own_growth(items, index) for index in failed], forwards)
    return outcomes


# the items a growth grows the trees of, their draft runner, and the growth: one tree's (a Growth, an extension's
# Search), or a forest's (returning a list of them)
Planned = tuple[list[int], DecoderRunner, Generator[Any, Any, Any]]


def by_runner(items: list[BatchItem], indices: list[int]) -> list[list[int]]:
    """`indices` grouped by their items' draft runner (a forest's trees share one), in order."""
    groups: dict[int, list[int]] = {}
    for index in indices:
        groups.setdefault(id(items[index].ctx.drafter.runner), []).append(index)
    return list(groups.values())


def own_growth(items: list[BatchItem], index: int) -> Planned:
    ctx, seq = items[index].ctx, items[index].seq
    return [index], ctx.drafter.runner, tree_growth(ctx, seq, step_depth(ctx, seq))


def grow_into(outcomes: list[Any], planned: list[Planned], forwards: Extended) -> list[int]:
    """Run the planned growths in lockstep, each tree (or a tree's error) into its item's outcome; returns the
    items of the forests whose growth failed, their outcomes not set."""
    failed = []
    for (members, _, _), grown in zip(planned, run_growths([(r, g) for _, r, g in planned], forwards.count),
                                      strict=True):
        if isinstance(grown, Exception) and len(members) > 1:
            failed += members
            continue
        for index, tree in zip(members, grown if isinstance(grown, list) else [grown], strict=True):
            outcomes[index] = tree
    return failed


def score_trees(
    target: DecoderRunner, items: list[BatchItem], trees: list[Tree | None], streams: PassStreams | None
) -> tuple[list[torch.Tensor | None], list[SearchTree | None], Extended]:
    """ONE target pass over every item's prompt slice and tree: each tree's [n_i, vocab] logits (None
    without a tree). With `streams`, the draft grows each SpecExec tree on while the pass runs (a
    thread of its own; CUDA: the target and draft streams): those extensions, and what they cost."""
    groups = pass_groups(items, trees)
    grown: list[SearchTree | None] = [None] * len(items)
    extendable = [index for index, (item, tree) in enumerate(zip(items, trees, strict=True))
                  if streams is not None and tree is not None and can_extend(item.ctx, tree)]
    extended = Extended()
    if not extendable:
        outputs = target.forward_groups(groups) if groups else []
    else:
        assert streams is not None
        background: BackgroundPass | None = None
        streams.begin()
        with streams.on_draft():  # set up before the pass is queued: the extensions' first host syncs wait for
            # the draft alone; on the draft stream, as everything they allocate (PassStreams: tensors crossing streams)
            planned = extension_growths(items, trees, extendable, lambda: background is not None and background.done())
        begin = time.perf_counter()
        try:
            background = BackgroundPass(lambda: target.forward_groups(groups), streams)
            with streams.on_draft():
                outcomes: list[SearchTree | Exception | None] = [None] * len(items)
                grow_into(outcomes, planned, extended)  # a failed forest: no extensions
        finally:
            extended.seconds = time.perf_counter() - begin
            try:
                outputs = background.result() if background is not None else []  # the pass ended, or raises
            finally:
                streams.join()
        grown = [None if isinstance(outcome, Exception) else outcome for outcome in outcomes]  # only proposals
        streams.hand_over([part for group in outputs for part in group if part is not None]
                          + [t for tree in grown if tree is not None for t in tree.tensors()])
    tree_logits = iter(outputs[-1] if any(tree is not None for tree in trees) else [])
    return [next(tree_logits) if tree is not None else None for tree in trees], grown, extended


def extension_growths(items: list[BatchItem], trees: list[Tree | None], extendable: list[int], stop: Callable[[], bool]
                      ) -> list[Planned]:
    """The extensions of the `extendable` items' trees (step.can_extend) as growths: without a grammar as one
    forest per draft runner when there are two or more (step.extends_in_forest), the others one each."""
    foresting = [index for index in extendable if extends_in_forest(items[index].ctx, items[index].seq)]
    planned: list[Planned] = [([index], items[index].ctx.drafter.runner,
                               extension_growth(items[index].ctx, items[index].seq, trees[index], stop))  # type: ignore[arg-type]
                              for index in extendable if index not in foresting]
    for members in by_runner(items, foresting):
        parts = [(items[i].ctx, items[i].seq, trees[i]) for i in members]
        planned.append((members, items[members[0]].ctx.drafter.runner,
                        extension_forest(parts, stop) if len(members) > 1  # type: ignore[arg-type]
                        else extension_growth(*parts[0], stop)))  # type: ignore[arg-type]
    return planned


def run_batch(target: DecoderRunner, items: list[BatchItem], streams: PassStreams | None = None) -> BatchResult:
    """Append each decoding sequence's step tokens (accepted path + bonus); returns them and per-sequence
    stats, None for a sequence that only prefilled, or the exception that failed that sequence alone.
    A failing target pass raises (every sequence in it fails)."""
    assert items, "a step needs a running sequence"
    device = items[0].ctx.target_cache.device
    begin = time.perf_counter()
    clock = PhaseClock(device)  # draft | target, read after the step's host syncs below
    # SDPA's kernels once for every pass of the step (the target's, in the overlap's thread too; each pass
    # then finds its flags set: attention.sdpa_backends); nothing to enter on a CPU under the default flags
    with target.attention_kernels():
        grown_before = Extended()  # the draft passes before the target pass
        outcomes = grow_trees(items, grown_before)
        clock.mark()
        live = [index for index, outcome in enumerate(outcomes) if not isinstance(outcome, Exception)]
        trees: list[Tree | None] = [outcomes[index] for index in live]  # type: ignore[misc]
        pass_items = [items[index] for index in live]
        pass_tokens = sum(len(item.prefill_ids) for item in pass_items) + sum(t.num_nodes for t in trees if t is not None)
        logits, grown, extended = score_trees(target, pass_items, trees, streams)
        clock.mark()
    results: list[ItemResult] = list(outcomes)  # type: ignore[arg-type]  # exceptions stay; the rest is set below
    for index, item, tree, part, extension in zip(live, pass_items, trees, logits, grown, strict=True):
        if tree is None:
            results[index] = None
            continue
        try:
            results[index] = commit_step(item.ctx, item.seq, tree, part, extension)
        except Exception as exc:
            results[index] = request_error(exc)
    draft_seconds, target_seconds = clock.seconds()
    step_seconds = time.perf_counter() - begin
    for index, item, tree in zip(live, pass_items, trees, strict=True):
        result = results[index]
        if tree is None or isinstance(result, Exception):
            continue
        results[index] = (result, StepStats(
            tree_size=tree.num_nodes,
            num_accepted=len(result) - 1,
            num_emitted=len(result),
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            step_seconds=step_seconds,
            batch_size=len(pass_items),
            pass_tokens=pass_tokens,
            expected_accepted=item.seq.expected_accepted,
            overlap_seconds=extended.seconds,
            extension_forwards=extended.forwards,
        ))
    return BatchResult(results, pass_tokens, draft_seconds, target_seconds, extended.seconds, step_seconds,
                       extended.forwards, grown_before.forwards, grown_before.seeded)
