"""Predicted outputs (OpenAI's `prediction`): text the caller expects much of the answer to repeat (a file
being edited), grafted into each SpecExec tree as a chain below the root.

Where the answer stands in the prediction is read from the committed tokens: a token the prediction has
where it stands moves it on; any other places it again, at the nearest occurrence (at or after where it
stood, else the last) of the answer's last MATCH tokens, or fewer down to MIN_MATCH, in the prediction. The chain is the prediction from there:
existing tree nodes that spell its start are followed, the rest is appended as unexpanded nodes after every
other node (score -inf, so index order stays score order and parents precede children), the tree first cut
so that it stays within its budget. Verification is exact for any tree (greedy and sample-and-match), so
the output is the target's whatever the prediction says; a good prediction only makes the accepted path
longer. Chains are never expanded by the draft (the drafter keeps expanded nodes a prefix of every path):
a grafted tree does not grow during its pass (overlap).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from engine.speculation.tree import Tree, keep_nodes, spelled_path

MATCH = 8  # answer tokens matched against the prediction to find the answer's place in it
MIN_MATCH = 2  # fewer matching tokens than this (once the answer has them) place nothing
SHARE = 2  # a chain takes at most budget // SHARE of a tree's nodes


@dataclass
class Prediction:
    token_ids: list[int]
    position: int = 0  # index in token_ids of the answer's next token (len(token_ids): past its end)
    accepted: int = 0  # answer tokens that followed the prediction where it stood

    def __post_init__(self) -> None:
        # (a run of MIN_MATCH..MATCH tokens) -> the indices just past its occurrences, ascending
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for size in range(MIN_MATCH, MATCH + 1):
            for end in range(size, len(self.token_ids) + 1):
                self.ends.setdefault(tuple(self.token_ids[end - size : end]), []).append(end)

    def chain(self, length: int) -> list[int]:
        return self.token_ids[self.position : self.position + length]

    def advance(self, answer: list[int], new_ids: list[int]) -> None:
        """After a step appended `new_ids` to the answer (`answer`: the generated tokens, new_ids last; only
        its last MATCH + len(new_ids) are read): a token the prediction has where it stands moves it on;
        another places it again (`find`)."""
        start = len(answer) - len(new_ids)
        for j, token in enumerate(new_ids):
            if self.position < len(self.token_ids) and self.token_ids[self.position] == token:
                self.position += 1
                self.accepted += 1
            else:
                self.position = self.find(answer[: start + j + 1])

    def find(self, answer: list[int]) -> int:
        """The index just past an occurrence of the answer's longest tail of MATCH down to MIN_MATCH tokens:
        the first at or after where the prediction stood, else the last; len(token_ids) when none."""
        for size in range(min(MATCH, len(answer)), MIN_MATCH - 1, -1):
            ends = self.ends.get(tuple(answer[-size:]))
            if ends:
                at = bisect.bisect_left(ends, self.position)
                return ends[at] if at < len(ends) else ends[-1]
        return len(self.token_ids)


def graft_chain(tree: Tree, chain: list[int], max_nodes: int) -> Tree:
    """`tree` (score-ordered, parents first) with `chain` spelled below its root: its nodes on the chain kept,
    the rest of the chain appended as unexpanded nodes scored -inf, the tree first cut to its first nodes so
    that it ends with at most max_nodes (the chain's new nodes counted in tree.predicted). One host sync."""
    num_nodes = tree.num_nodes
    path = spelled_path(tree, chain)  # the chain's existing nodes (increasing indices: parents precede children)
    keep = max_nodes - (len(chain) - (len(path) - 1))
    while True:  # nodes past `keep` are cut, the chain's among them; what is cut of it is appended again
        on_chain = sum(1 for node in path if node < keep)
        new_keep = max_nodes - (len(chain) - (on_chain - 1))
        if new_keep == keep:
            break
        keep = new_keep
    anchor, rest = path[on_chain - 1], chain[on_chain - 1 :]
    if not rest:
        return tree
    if keep < num_nodes:
        tree = keep_nodes(tree, torch.arange(keep, device=tree.token_ids.device))
    return append_chain(tree, anchor, rest)


def append_chain(tree: Tree, anchor: int, tokens: list[int]) -> Tree:
    """`tokens` as a chain of new unexpanded nodes below node `anchor`, after every node."""
    device, num_nodes, num_new = tree.token_ids.device, tree.num_nodes, len(tokens)
    new = torch.arange(num_nodes, num_nodes + num_new, device=device)  # [m] the chain's indices
    parents = torch.cat([torch.tensor([anchor], device=device), new[:-1]])
    lower = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()  # a chain: each sees those before
    ancestors = torch.cat([tree.ancestors[anchor].expand(num_new, num_nodes), lower], dim=1)  # [m, n + m]
    width = 0 if tree.child_lp is None else tree.child_lp.shape[1]
    return Tree(
        token_ids=torch.cat([tree.token_ids, torch.tensor(tokens, device=device)]),
        parents=torch.cat([tree.parents, parents]),
        depths=torch.cat([tree.depths, tree.depths[anchor] + torch.arange(1, num_new + 1, device=device)]),
        scores=torch.cat([tree.scores, tree.scores.new_full((num_new,), float("-inf"))]),
        ancestors=torch.cat([torch.nn.functional.pad(tree.ancestors, (0, num_new)), ancestors]),
        draft_slots=torch.cat([tree.draft_slots, tree.draft_slots.new_full((num_new,), -1)]),
        child_lp=None if tree.child_lp is None else torch.cat(
            [tree.child_lp, tree.child_lp.new_full((num_new, width), float("-inf"))]),
        child_ids=None if tree.child_ids is None else torch.cat(
            [tree.child_ids, tree.child_ids.new_zeros((num_new, width))]),
        extension_forwards=tree.extension_forwards,
        predicted=tree.predicted + num_new,
    )
