"""Overlap: the draft keeps growing while the target scores the step's trees.

    trees = grow every tree (serial; a seeded tree needs few draft forwards)
    extensions = each tree's growth set up (host syncs here, before the pass is queued)
    pass = BackgroundPass(target pass over the trees)      # another thread; CUDA: the target stream
    extensions = go on growing each tree, best-first, until the pass is done   # CUDA: the draft stream
    logits = pass.result(); verify each tree
    commit: the accepted path's draft KV (from the extension, which expanded more of it), and the
            extension's subtree under (last accepted node, bonus token) becomes the next step's seed

A streamed target's pass is copy-bound, so the draft's work fits in its shadow. Trees are proposals
and verification decides, so the output is what it is without overlap (tests compare both).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from engine.config import SpeculationConfig
from engine.offload.device import PassStreams
from engine.speculation.drafter import Drafter, GrowLimits, MaskFn
from engine.speculation.search_tree import SearchTree
from engine.speculation.specexec_growth import Search, best_first_search, reoffer, scored_expand
from engine.speculation.tree import Tree
from engine.types import SamplingParams

T = TypeVar("T")

SEEDED_FORWARDS = 2  # draft forwards a seeded tree gets before its pass (the rest grows during it)


class BackgroundPass(Generic[T]):
    """Runs `work` (the target pass) in a thread of its own, on the target stream of `streams`; `done`
    is polled between draft forwards: true once the pass has finished (CUDA: an event recorded after
    it on its stream has completed, not merely once it is queued)."""

    def __init__(self, work: Callable[[], T], streams: PassStreams):
        self._streams = streams
        self._queued = threading.Event()  # the thread has returned (its work queued, CPU: done)
        self._end: torch.cuda.Event | None = None
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="target-pass", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            with self._streams.on_target():
                try:
                    self._result = work()
                finally:
                    self._end = self._streams.target_done_event()
        except BaseException as exc:  # handed to result()'s caller
            self._error = exc
        finally:
            self._queued.set()

    def done(self) -> bool:
        """Whether the pass has finished (no host sync: an event query)."""
        return self._queued.is_set() and (self._end is None or self._end.query())

    def result(self) -> T:
        """The pass's outputs once its thread has returned (the caller's stream must still wait for
        the target stream: PassStreams.join). Raises what the pass raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def extension(
    drafter: Drafter,
    tree: Tree,
    params: SamplingParams,
    spec: SpeculationConfig,
    limits: GrowLimits,
    mask: MaskFn | None,
    stop: Callable[[], bool],
) -> Search:
    """The step's SpecExec tree grown on, best-first, within `limits` (SpeculationConfig.extension_budget
    nodes, nodes to depth limits.max_depth and as many draft forwards) and the draft cache's room, until
    `stop()` (the pass is done). Works on a copy: the scored tree is left as it is. Returns a SearchTree (its extension_forwards counted): it may hold many times the
    budget, so no ancestor matrix is built for it; its subtree under the step's outcome seeds the next tree."""
    expand = scored_expand(drafter, params, spec)
    return best_first_search(extension_start(drafter, tree, spec, limits), expand, spec, limits, drafter.room, mask,
                             limits.max_depth, stop)


def extension_start(drafter: Drafter, tree: Tree, spec: SpeculationConfig, limits: GrowLimits) -> SearchTree:
    """The scored tree as an extension's search state: a copy where the trees grow (its own draft slots),
    scored as if its most likely path were accepted (SearchTree.conditioned_on_best_path: the next step's
    root is most likely a child of that path's leaf, and a seed is worth what it holds under it; by global
    scores the deep subtree there ranks below every shallow sibling), its dropped proposals offered again
    within `limits`. Host syncs here: before the pass is queued."""
    search = SearchTree.of(tree.to(drafter.tree_device), limits.max_depth)
    return reoffer(search.conditioned_on_best_path(), spec, limits)


def path_nodes(tree: SearchTree, token_ids: list[int]) -> tuple[list[int], list[int]]:
    """The nodes along `token_ids` below the root, root first, as far as the tree holds them, and
    their draft slots. One host sync."""
    num_nodes = tree.num_nodes
    host = torch.cat([tree.token_ids, tree.parents, tree.draft_slots]).tolist()
    tokens, parents, slots = host[:num_nodes], host[num_nodes : 2 * num_nodes], host[2 * num_nodes :]
    child_of = {(parents[node], tokens[node]): node for node in range(1, num_nodes)}
    nodes = [0]
    for token in token_ids:
        node = child_of.get((nodes[-1], token))
        if node is None:
            break
        nodes.append(node)
    return nodes, [slots[node] for node in nodes]


def commit_draft(drafter: Drafter, tree: Tree, path: torch.Tensor, grown: SearchTree | None,
                 new_ids: list[int]) -> SearchTree | None:
    """Keep the accepted path's draft KV and return the next step's seed (None: grow afresh).

    path: [m] the accepted nodes of `tree` (the scored one); new_ids: the accepted tokens below the root,
    then the bonus token. With an extension `grown` that holds the whole path, its slots are kept (it
    expanded more of the path), and the subtree under the bonus token's node, if grown and expanded,
    is the seed: its KV sits above every slot the commit writes (children are expanded after parents)."""
    if grown is not None:
        nodes, slots = path_nodes(grown, new_ids)
        num_accepted = len(new_ids)  # the root and the accepted nodes below it
        if len(nodes) >= num_accepted:
            drafter.cache.commit(torch.tensor([s for s in slots[:num_accepted] if s >= 0], device=path.device))
            if len(nodes) == num_accepted + 1 and slots[-1] >= 0:
                return grown.subtree(nodes[-1], len(nodes) - 1)
            return None
    drafter.commit(tree, path)
    return None
