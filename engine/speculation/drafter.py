"""The draft model with its KV cache, and how tree growths drive it.

The draft KV cache holds the committed prefix plus one slot per node the draft expanded.
Unexpanded nodes (and committed tokens the draft never saw) are caught up by the next step's
first draft forward.

A growth is a generator (`Growth`): it yields each draft forward it needs as a Segment over its own
cache, is sent that forward's [rows, vocab] logits, and returns the tree. It runs no model itself,
so the growths of every request in a step advance in lockstep and share one draft pass per round
(`run_growths`). The growths: specexec_growth (best-first), specinfer_growth (sampled chains),
rrs_growth (best-first, children drawn without replacement).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.model.faults import request_error
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner, Segment
from engine.speculation.tree import Tree, causal_mask

if TYPE_CHECKING:
    from engine.speculation.search_tree import SearchTree

# mask(tree, nodes [k]) -> [k, vocab] bool: the tokens a grammar allows after each node (structured output);
# it reads the tree's token_ids and parents (a Tree, or a SearchTree while best-first search grows it)
MaskFn = Callable[["Tree | SearchTree", torch.Tensor], torch.Tensor]
# a tree's growth: yields each draft forward (one Segment), is sent its [rows, vocab] logits, returns the tree
Growth = Generator[Segment, torch.Tensor, Tree]
T = TypeVar("T")


@dataclass
class GrowLimits:
    budget: int  # draft tokens in the tree (root excluded)
    max_depth: int  # deepest node depth, and cap on draft forwards
    stop_mask: torch.Tensor  # [draft vocab] bool: EOS / stop token ids, never expanded

class Drafter:
    """The draft model with its cache, restricted to the target's vocabulary and its own embedding.

    It drafts only ids below both (an id past its embedding could not be fed back to it). Ids the
    target emits past the draft's embedding (a target vocabulary padded further than the draft's)
    are fed to the draft as its runner's fallback_input_id: the draft only proposes, so exactness
    does not depend on what it sees.

    SpecExec trees grow on `tree_device` (the cache's device, or the host with --host-trees: a tree's
    bookkeeping is many small ops, cheaper on the host than launched on a GPU); a forward's inputs go to the
    cache's device, and its caller brings the log-probs' top children back (specexec_growth.propose)."""

    def __init__(self, runner: DecoderRunner, cache: KVCache, target_vocab_size: int,
                 tree_device: torch.device | None = None):
        self.runner = runner
        self.cache = cache
        self.tree_device = cache.device if tree_device is None else tree_device
        self.vocab_limit = min(target_vocab_size, runner.vocab_size, runner.num_embeddings)
        # [draft vocab] bool: ids past the target's vocabulary or the draft's embedding, never drafted
        self.outside_target = torch.arange(runner.vocab_size, device=cache.device) >= self.vocab_limit
        self.next_slot = 0

    def catch_up(self, pending_ids: list[int], root_id: int) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        """Feed committed tokens the draft has not seen, then the root (one forward). Commits the
        pending ones. Returns the root's draft logits [1, vocab]; the root's KV lands at slot cache.length."""
        device = self.cache.device
        ids = torch.tensor([*pending_ids, root_id], device=device)
        start = self.cache.length
        positions = torch.arange(start, start + ids.shape[0], device=device)
        mask = causal_mask(ids.shape[0], start, device)
        last = torch.tensor([ids.shape[0] - 1], device=device)
        logits = yield Segment(ids, positions, self.cache, start, mask, last)
        self.cache.length = start + len(pending_ids)
        self.next_slot = self.cache.length + 1
        return self.mask_vocab(logits)

    def expand(self, tree: Tree | SearchTree, selected: torch.Tensor) -> Generator[Segment, torch.Tensor, torch.Tensor]:
        """One forward of `selected` nodes ([k]) under the tree mask (each sees the committed prefix and
        the expanded nodes of its own path). Returns [k, vocab]."""
        num = selected.shape[0]
        start = self.next_slot
        tree.draft_slots[selected] = torch.arange(start, start + num, device=selected.device)
        allowed = tree.draft_mask(selected, self.cache.length, start + num)
        positions = self.cache.length + tree.depths[selected]
        device = self.cache.device  # the tree's own, or the host's (tree_device)
        logits = yield Segment(tree.token_ids[selected].to(device), positions.to(device), self.cache, start,
                               allowed.to(device))
        self.next_slot = start + num
        return self.mask_vocab(logits)

    def room(self) -> int:
        return self.cache.room(self.next_slot)

    def mask_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[k, draft vocab] -> the same with ids past vocab_limit at -inf. Out of place:
        the runner's logits are inference tensors."""
        if logits.shape[1] > self.vocab_limit:
            return logits.masked_fill(self.outside_target[: logits.shape[1]], float("-inf"))
        return logits

    def commit(self, tree: Tree, path: torch.Tensor) -> None:
        """Keep the accepted path's draft KV (the expanded nodes form a prefix of the path)."""
        slots = tree.draft_slots[path]
        self.cache.commit(slots[slots >= 0])

    def adopt(self, tree: SearchTree) -> SearchTree:
        """A tree grown in earlier steps (a seed, rooted at the last committed token, its root expanded):
        its expanded nodes' KV moves to the slots right after the committed prefix, in node order (the
        root at cache.length, where a fresh root would be). Returns the tree with those slots."""
        expanded = (tree.draft_slots >= 0).nonzero().squeeze(1)  # [k] ascending, the root first
        start = self.cache.length
        slots = torch.arange(start, start + expanded.shape[0], device=expanded.device)
        self.cache.move(tree.draft_slots[expanded].to(self.cache.device), start)
        draft_slots = tree.draft_slots.clone()
        draft_slots[expanded] = slots
        self.next_slot = start + expanded.shape[0]
        return dataclasses.replace(tree, draft_slots=draft_slots)

def restrict(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[k, draft vocab] logits or log-probs -> the same at -inf where `allowed` ([k, vocab] bool) is
    False; ids past `allowed`'s width are forbidden. Out of place."""
    width = scores.shape[1]
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    return scores.masked_fill(~allowed[:, :width], float("-inf"))

def renormalise(log_probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[k, vocab] log-probs conditioned on `allowed` ([k, vocab] bool). A row with nothing allowed
    becomes NaN, which proposes no children (add_best_children keeps finite scores only)."""
    return restrict(log_probs, allowed).log_softmax(dim=-1)

def root_tree(root_id: int, root_slot: int, device: torch.device) -> Tree:
    tree = Tree.single(root_id, device)
    tree.draft_slots[0] = root_slot
    return tree

def run_growths(
    growths: list[tuple[DecoderRunner | None, Generator[Any, Any, T]]], on_pass: Callable[[], None] | None = None
) -> list[T | Exception]:
    """Advance every (runner, growth) in lockstep; returns what each returns (a tree; a forest's growth: its
    trees). Each round, the forwards the growths ask for (a Segment, sent its logits; a forest's growth: a
    list of them, sent a list) run as one draft pass per runner, one segment each over its own cache (dense
    work shared, attention per segment). A growth that asks for none (runner may then be None) just returns.
    A growth that raises ends with its exception in its place (a device fault is raised: the engine's);
    the others go on. A failing draft pass raises. `on_pass` is called after each draft pass."""
    results: list[T | Exception | None] = [None] * len(growths)
    asks: dict[int, Segment | list[Segment]] = {}

    def advance(index: int, logits: torch.Tensor | list[torch.Tensor] | None) -> None:
        try:
            asks[index] = growths[index][1].send(logits)  # None starts it
        except StopIteration as done:
            results[index] = done.value
        except Exception as exc:
            results[index] = request_error(exc)

    for index in range(len(growths)):
        advance(index, None)
    while asks:
        pending = sorted(asks)
        for runner in {id(growths[i][0]): growths[i][0] for i in pending}.values():
            assert runner is not None, "a growth asked for a draft forward without a runner"
            mine = [i for i in pending if growths[i][0] is runner]
            asked = {i: asks.pop(i) for i in mine}
            segments = {i: ask if isinstance(ask, list) else [ask] for i, ask in asked.items()}
            outputs = iter(runner.forward_groups([[s for i in mine for s in segments[i]]])[0])
            if on_pass is not None:
                on_pass()
            for index in mine:
                parts = [next(outputs) for _ in segments[index]]
                advance(index, parts if isinstance(asked[index], list) else parts[0])
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]

def run_growth(runner: DecoderRunner | None, growth: Growth) -> Tree:
    tree = run_growths([(runner, growth)])[0]
    if isinstance(tree, Exception):
        raise tree
    return tree
