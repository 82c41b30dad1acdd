"""RRS trees: best-first growth whose children are drawn without replacement from the draft.

At every expanded node the draft's processed distribution, cut to its top PROPOSAL_WIDTH tokens and
renormalised (q), is drawn without replacement once (Gumbel top-k): the node's row of
tree.proposals. The first max_children draws of a row are candidate children, scored by rrs_shape.TreeShape.child_scores from its rank and the
rank-th largest q of the row, never from the drawn token, so scores fall along a row and from a
parent to its children.

Candidates are ordered by score, ties by creation (a parent before its children, a row in rank
order). Each draft forward expands the best unexpanded candidates among the first budget + 1 (the
root included), at most max_expand; the step's tree is the first budget + 1 after the last forward.
Whether a candidate x is in the tree depends only on the candidates ordered before it, and which of
those exist and when they were expanded never depends on anything ordered after x, such as x's own
token or its subtree: so a node's children are a prefix of its row whose length does not depend on
the tokens drawn for it, which is what recursive rejection sampling (engine.speculation.rrs) needs
to be exact (docs/design.md, "RRS trees").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.speculation.drafter import Drafter, GrowLimits, Growth, MaskFn, restrict
from engine.speculation.rrs_shape import TreeShape
from engine.speculation.sampling import process_logits
from engine.speculation.tree import Proposals, Tree, renumbered, renumbering
from engine.types import SamplingParams

# q's support per node: the draft's top tokens kept (the rest of its mass dropped, q renormalised).
# Acceptance falls with the mass dropped: on the built-in pair at T = 1, budget 64, rows of 32 tokens
# gave 2.8 tokens per pass and rows of 1024 gave 3.7 (docs/bench/acceptance.md)
PROPOSAL_WIDTH = 1024
# candidate children per row: its first CHILDREN draws (the engine's; SpecExec's max_children is 32).
# Same pair, T = 1, budget 64: 32 gave 3.1 tokens per pass, 128 and 1024 gave 3.7 (the same trees)
CHILDREN = 128


def draft_sampling(params: SamplingParams) -> SamplingParams:
    """The request's distribution-shaping parameters for the draft (its penalties are left out: any
    q keeps RRS exact, as long as q is what the children were drawn from)."""
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          min_p=params.min_p, logit_bias=params.logit_bias)


def draw_proposals(
    logits: torch.Tensor, params: SamplingParams, width: int, children: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[k, vocab] draft logits -> (token ids [k, w], their q [k, w], the m = `children` largest q of
    each row, descending [k, m]). q is the processed distribution cut to its top w tokens,
    renormalised. The first m entries of a row are the first draws of one draw without replacement
    from q, in order (tokens of probability 0 last: never children); the rest of the row, the tokens
    not drawn, in any order. A row where nothing is allowed gives q = 0 everywhere."""
    probs = process_logits(logits, params).softmax(dim=-1).nan_to_num(0.0)  # [k, vocab]
    # the top w in any order: a sorted top-k of a quarter of a small vocabulary costs twice as much
    q, top_ids = probs.topk(min(width, probs.shape[1]), dim=-1, sorted=False)  # [k, w]
    q = q / q.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    gumbel = -torch.empty_like(q).exponential_(generator=generator).clamp(min=1e-30).log()
    keys = torch.where(q > 0, q.log() + gumbel, float("-inf"))
    num_rows, row_width = keys.shape
    first = keys.topk(min(children, row_width), dim=-1).indices  # [k, m] the draws, in order
    taken = torch.zeros_like(keys, dtype=torch.bool).scatter_(1, first, True)
    rest = (~taken).nonzero()[:, 1].view(num_rows, row_width - first.shape[1])  # row-major: each row's own
    order = torch.cat([first, rest], dim=1)
    ranked = q.topk(first.shape[1], dim=-1).values  # [k, m] descending
    return top_ids.gather(1, order), q.gather(1, order), ranked


@dataclass
class Candidates:
    """Every candidate so far, in creation order (index 0: the root). Rows: the expanded ones'."""

    token_ids: torch.Tensor  # [c] long
    parents: torch.Tensor  # [c] long, candidate index, -1 at the root
    ranks: torch.Tensor  # [c] long, index in the parent's row (root: 0)
    depths: torch.Tensor  # [c] long
    pis: torch.Tensor  # [c] float, the rank-th largest q of the parent's row (root: 1)
    scores: torch.Tensor  # [c] float, TreeShape's estimate of log P(the walk reaches it)
    rows: torch.Tensor  # [c] long, the candidate's row in row_ids/row_probs, -1 while unexpanded
    slots: torch.Tensor  # [c] long, draft KV slot, -1 while unexpanded
    row_ids: list[torch.Tensor] = field(default_factory=list)  # per forward [k, w], draw order
    row_probs: list[torch.Tensor] = field(default_factory=list)  # per forward [k, w], q of row_ids
    num_rows: int = 0

    @classmethod
    def root(cls, root_id: int, root_slot: int, device: torch.device) -> Candidates:
        one = torch.zeros(1, dtype=torch.long, device=device)
        return cls(token_ids=one + root_id, parents=one - 1, ranks=one, depths=one, pis=torch.ones(1, device=device),
                   scores=torch.zeros(1, device=device), rows=one - 1, slots=one + root_slot)

    def add_rows(
        self, expanded: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, ranked: torch.Tensor, child_scores: torch.Tensor
    ) -> None:
        """Rows drawn at candidates `expanded` ([k]; ids, probs: [k, W]); their first m draws (ranked,
        child_scores: [k, m]) with q > 0 become candidates, row by row in rank order."""
        num, width = child_scores.shape
        self.rows[expanded] = torch.arange(self.num_rows, self.num_rows + num, device=ids.device)
        self.num_rows += num
        self.row_ids.append(ids)
        self.row_probs.append(probs)
        live = (probs[:, :width] > 0).flatten()
        parents = expanded.repeat_interleave(width)[live]
        self.token_ids = torch.cat([self.token_ids, ids[:, :width].flatten()[live]])
        self.parents = torch.cat([self.parents, parents])
        self.ranks = torch.cat([self.ranks, torch.arange(width, device=ids.device).repeat(num)[live]])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.pis = torch.cat([self.pis, ranked.flatten()[live]])
        self.scores = torch.cat([self.scores, child_scores.flatten()[live]])
        self.rows = torch.cat([self.rows, self.rows.new_full((parents.shape[0],), -1)])
        self.slots = torch.cat([self.slots, self.slots.new_full((parents.shape[0],), -1)])

    def best(self, count: int) -> torch.Tensor:
        """[<= count] the first `count` candidates by score, ties by creation: a parent before its
        children, a row's draws in rank order (scores never rise along either)."""
        if self.scores.shape[0] > count:  # sort only the candidates at or above the count-th score
            # host sync (nonzero): the growth syncs for its picks right after, once per forward anyway
            near = (self.scores >= self.scores.topk(count).values[-1]).nonzero().squeeze(1)  # creation order
            return near[torch.sort(self.scores[near], descending=True, stable=True).indices[:count]]
        return torch.sort(self.scores, descending=True, stable=True).indices

    def tree(self, chosen: torch.Tensor, with_proposals: bool = False) -> Tree:
        """The tree of candidates `chosen` ([n], parents before children, closed under parents)."""
        num = chosen.shape[0]
        parents = renumbered(self.parents[chosen], renumbering(chosen, self.parents.shape[0]))
        depths = self.depths[chosen]
        ancestors = torch.eye(num, dtype=torch.bool, device=chosen.device)
        for depth in range(1, int(depths.max()) + 1 if num > 1 else 1):  # parents' rows are final first
            level = (depths == depth).nonzero().squeeze(1)
            ancestors[level] |= ancestors[parents[level]]
        tree = Tree(token_ids=self.token_ids[chosen], parents=parents, depths=depths, scores=self.scores[chosen],
                    ancestors=ancestors, draft_slots=self.slots[chosen].clone())
        if with_proposals:
            tree.proposals = self.proposals(chosen)
        return tree

    def proposals(self, chosen: torch.Tensor) -> Proposals:
        """The chosen candidates' rows ([n, W]; zeros where unexpanded) and ranks."""
        device = chosen.device
        rows = self.rows[chosen]
        expanded = rows >= 0
        width = self.row_ids[0].shape[1]
        token_ids = torch.zeros(chosen.shape[0], width, dtype=torch.long, device=device)
        probs = torch.zeros(chosen.shape[0], width, device=device)
        if self.row_ids:
            all_ids, all_probs = torch.cat(self.row_ids), torch.cat(self.row_probs)
            token_ids[expanded] = all_ids[rows[expanded]]
            probs[expanded] = all_probs[rows[expanded]]
        return Proposals(token_ids=token_ids, probs=probs, ranks=self.ranks[chosen], pis=self.pis[chosen])


def grow_rrs_tree(
    drafter: Drafter,
    root_id: int,
    pending_ids: list[int],
    params: SamplingParams,
    max_expand: int,
    max_children: int,
    limits: GrowLimits,
    shape: TreeShape,
    generator: torch.Generator,
    mask: MaskFn | None = None,
) -> Growth:
    """The step's RRS tree (draft.Growth): limits.budget nodes below the root where the candidates
    reach that many, at most limits.max_depth draft forwards (the root's catch-up included). With
    `mask`, q at every node is conditioned on the tokens it allows."""
    draft_params = draft_sampling(params)
    logits = yield from drafter.catch_up(pending_ids, root_id)
    device = logits.device
    # a fixed cap per forward that the draft cache's room always covers: room running out mid-growth
    # would make later expansions depend on how many earlier ones there were, candidates ordered
    # after a node among them (so on its token), which the exactness argument above excludes
    max_expand = min(max_expand, drafter.room() // max(limits.max_depth - 1, 1))
    pool = Candidates.root(root_id, drafter.cache.length, device)
    expanded = torch.zeros(1, dtype=torch.long, device=device)  # candidates whose rows `logits` holds
    chosen, picks = expanded, expanded  # picks: their positions in `tree`
    tree = pool.tree(chosen)
    for forward in range(limits.max_depth):
        if mask is not None:
            logits = restrict(logits, mask(tree, picks))
        ids, probs, ranked = draw_proposals(logits, draft_params, PROPOSAL_WIDTH, max_children, generator)
        pool.add_rows(expanded, ids, probs, ranked, shape.child_scores(pool.scores[expanded], ranked))
        chosen = pool.best(limits.budget + 1)
        if forward == limits.max_depth - 1:
            break
        expandable = (pool.rows[chosen] < 0) & ~limits.stop_mask[pool.token_ids[chosen]]
        expandable &= pool.depths[chosen] < limits.max_depth
        picks = expandable.nonzero().squeeze(1)[:max_expand]  # host sync
        if picks.numel() == 0:
            break
        tree = pool.tree(chosen)
        logits = yield from drafter.expand(tree, picks)
        expanded = chosen[picks]
        pool.slots[expanded] = tree.draft_slots[picks]
    return pool.tree(chosen, with_proposals=True)

