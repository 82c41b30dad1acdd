"""What shapes a request's RRS trees: an estimate of each would-be child's acceptance, learned from
verified trees of earlier steps only, and never looking at the token a child would be, which is what
keeps RRS exact (docs/design.md, "RRS trees").

A node's score estimates the log-probability that the walk reaches it: its parent's score plus
log beta(rank, pi), where rank is the child's index in the parent's draw without replacement and pi
the rank-th largest draft probability at the parent (both known before the child is drawn). beta is
the mean, over earlier steps' trees, of P(the walk accepts that child first | it reached the parent)
in the (rank, pi) cell, which verification computes exactly at every node (rrs.child_log_probs),
each weighted by the probability that the walk reaches the parent.
Before a cell has data it is pi itself: the draft's own path probability, as SpecExec scores nodes.
A request starts from the evidence of earlier requests with its sampling settings (ShapeBook): every
tree in it was verified before the request's current step began.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.speculation.tree import Tree
from engine.speculation.verify import path_probabilities
from engine.types import SamplingParams

# 1-based rank r falls in the first bucket whose edge is >= r: ranks 1, 2, 3, 4, 5-6, 7-8, ... 49+
RANK_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
# -log(pi) falls in the first bucket whose edge is >= it
NLL_EDGES = (0.05, 0.15, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
PRIOR_WEIGHT = 0.25  # pseudo-observations of the prior (pi) per cell
MEMORY = 0.9  # each step's weight on the evidence so far (older steps fade)
# the book's weight on its evidence per tree any request adds (about the last hundred trees count).
# A request's own first trees learn from a handful of observations per cell; from the book, T = 1,
# budget 256 went from level with SpecInfer to ahead on both pairs (docs/bench/acceptance.md, "Shape book")
BOOK_MEMORY = 0.99
BOOK_SETTINGS = 64  # sampling settings the book keeps evidence for (the least recently used dropped)


@dataclass
class Evidence:
    """Per (rank, pi) cell: the weighted sum of observed acceptances and the sum of weights."""

    sums: torch.Tensor  # [ranks, nlls]
    counts: torch.Tensor  # [ranks, nlls]

    @classmethod
    def empty(cls, device: torch.device) -> Evidence:
        zeros = torch.zeros(len(RANK_EDGES) + 1, len(NLL_EDGES) + 1, device=device)
        return cls(sums=zeros, counts=zeros.clone())

    def copy(self) -> Evidence:
        return Evidence(sums=self.sums.clone(), counts=self.counts.clone())

    def add(self, memory: float, cells: torch.Tensor, weights: torch.Tensor, accepted: torch.Tensor) -> None:
        """Fade what is there by `memory`, then add each observation ([m] flat cell, weight, acceptance)."""
        self.sums.mul_(memory).view(-1).index_add_(0, cells, weights * accepted)
        self.counts.mul_(memory).view(-1).index_add_(0, cells, weights)


class TreeShape:
    """One request's acceptance model (state between its steps)."""

    def __init__(self, device: torch.device, decay: float = 1.0, book: Evidence | None = None):
        """book: the evidence of earlier requests with the same settings: the request starts from a
        copy, and adds its own trees to it."""
        self.log_decay = math.log(decay)
        self.rank_edges = torch.tensor(RANK_EDGES, device=device)
        self.nll_edges = torch.tensor(NLL_EDGES, device=device)
        self.own = book.copy() if book is not None else Evidence.empty(device)
        self.book = book

    def cells(self, ranks: torch.Tensor, pis: torch.Tensor) -> torch.Tensor:
        """0-based ranks and pi (same shape, any) -> each (rank, pi) cell's flat index in Evidence."""
        rank_cell = torch.bucketize(ranks + 1, self.rank_edges)
        nll_cell = torch.bucketize(-pis.clamp(min=1e-30).log(), self.nll_edges)
        return rank_cell * (len(NLL_EDGES) + 1) + nll_cell

    def child_scores(self, scores: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
        """scores: [k] nodes' scores; ranked: [k, w] their draft probabilities sorted descending.
        Returns [k, w]: the score each node's child of rank i would get, non-increasing in i (so the
        children a threshold admits are a prefix of the draw), -inf where pi is 0."""
        cells = self.cells(torch.arange(ranked.shape[1], device=ranked.device).expand_as(ranked), ranked)
        sums, counts = self.own.sums.view(-1)[cells], self.own.counts.view(-1)[cells]
        beta = (sums + PRIOR_WEIGHT * ranked) / (counts + PRIOR_WEIGHT)
        child = scores[:, None] + beta.clamp(min=1e-30).log() + self.log_decay
        child = child.cummin(dim=-1).values
        return child.masked_fill(ranked <= 0, float("-inf"))

    def observe(self, tree: Tree, node_log_probs: torch.Tensor) -> None:
        """Learn from a verified tree: each child's exact P(accepted first | parent reached)
        (node_log_probs, rrs.child_log_probs), weighted by the probability that the walk reaches its
        parent."""
        proposals = tree.proposals
        assert proposals is not None
        if tree.num_nodes > 1:
            reach = path_probabilities(tree, node_log_probs)  # [n] P(the walk reaches the node)
            self.learn(proposals.ranks[1:], proposals.pis[1:], reach[tree.parents[1:]], node_log_probs[1:].exp())

    def learn(self, ranks: torch.Tensor, pis: torch.Tensor, parent_reach: torch.Tensor, accepted: torch.Tensor) -> None:
        """Children ([m] each: rank in the parent's draw, pi, P(the walk reaches the parent), P(accepted
        first | parent reached)) into their (rank, pi) cells, weighted by parent_reach: what matters is
        a child's acceptance where its parent is reached. Into the book too."""
        cells = self.cells(ranks, pis)
        self.own.add(MEMORY, cells, parent_reach, accepted)
        if self.book is not None:
            self.book.add(BOOK_MEMORY, cells, parent_reach, accepted)


class ShapeBook:
    """The engine's acceptance evidence across requests, per sampling setting (what shapes q and p:
    temperature, top_p, top_k, min_p, and whether penalties, logit_bias or a grammar reshape them).
    Trees enter it after their verification, so a tree grown from it depends on earlier steps only,
    as with a request's own evidence. A seeded request's trees, so its text, depend on the book too
    (README, "Seeds")."""

    def __init__(self, device: torch.device, decay: float = 1.0):
        self.device = device
        self.decay = decay
        self.settings: OrderedDict[tuple, Evidence] = OrderedDict()

    def shape(self, params: SamplingParams, constrained: bool) -> TreeShape:
        """A new request's TreeShape; constrained: it has a grammar."""
        reshaped = constrained or params.uses_penalties or bool(params.logit_bias)
        key = (params.temperature, params.top_p, params.top_k, params.min_p, reshaped)
        book = self.settings.pop(key, None) or Evidence.empty(self.device)
        self.settings[key] = book  # most recently used last
        while len(self.settings) > BOOK_SETTINGS:
            self.settings.popitem(last=False)
        return TreeShape(self.device, self.decay, book)
