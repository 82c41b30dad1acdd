"""Recursive rejection sampling (RRS) over a tree whose children were drawn without replacement.

At a node v the draft's proposal distribution is q (tree.proposals: v's top-w draft tokens,
renormalised) and the target's is p (processed logits at v). v's children c_1..c_k are the first k
draws of one draw without replacement from q. Step i: accept c_i with probability
min(1, p_i(c_i) / q_i(c_i)); on rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i without
c_i, renormalised. If none is accepted the node's token is drawn from p_{k+1}. Each step emits exactly
p_i given that it is reached, so the node emits exactly p (docs/design.md, "RRS trees").

Vectorised like sample-and-match: every node's acceptance probabilities are computed at once (the
residual changes only on the node's w proposal tokens; off them it is p scaled, so per node only p
on its row and the mass off it are needed), then the walk from the root follows the accepted
children, and the bonus token is drawn from the last node's residual. Host syncs: the children
counts, the accepted path, the last node's row.
"""

from __future__ import annotations

import torch

from engine.speculation.sampling import NodeLogits, block_rows, blocks
from engine.speculation.tree import Proposals, Tree
from engine.speculation.verify import Verdict

TINY = 1e-30


def target_on_rows(
    logits: torch.Tensor | NodeLogits, proposals: Proposals, rows_per_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node, from its processed target distribution p: p at its proposal tokens ([n, w], 0 where
    q is 0) and p's mass off them ([n]). Block by block."""
    num_nodes, width = proposals.token_ids.shape
    device = proposals.token_ids.device
    on_row = torch.zeros(num_nodes, width, device=device)
    off_mass = torch.zeros(num_nodes, device=device)
    live = proposals.probs > 0  # [n, w] the row's proposal tokens (distinct within a row)
    for rows in blocks(num_nodes, rows_per_block):
        probs = logits[rows].float().softmax(dim=-1)  # [rows, vocab]
        # a row's entries of q = 0 may name ids past the target's vocabulary (a padded draft): read as 0
        ids = proposals.token_ids[rows].clamp(max=probs.shape[1] - 1)
        on_row[rows] = probs.gather(1, ids) * live[rows]
        off_mass[rows] = (1.0 - on_row[rows].sum(dim=-1)).clamp(min=0.0)
        del probs
    return on_row, off_mass


def rejection_steps(
    on_row: torch.Tensor, off_mass: torch.Tensor, q: torch.Tensor, num_children: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every node's recursive rejection sampling, all nodes at once, one loop step per child rank
    over the nodes with that many children (work: the tree's size times w).

    on_row: [n, w] p at the row's tokens; off_mass: [n]; q: [n, w] proposal probabilities in draw
    order; num_children: [n] (a node's children are its first num_children row entries). Returns
    (accept [n, w]: P(accept child i | children before it rejected), 0 past the children; and the
    residual after every child is rejected: unnormalised on the row [n, w] and off it [n])."""
    residual, off = on_row.clone(), off_mass.clone()
    accept = torch.zeros_like(q)
    removed = torch.zeros_like(off)  # q mass of the children rejected so far
    by_children = num_children.argsort(descending=True)  # nodes with more children first
    with_more = torch.bincount(num_children, minlength=1).flip(0).cumsum(0).flip(0).tolist()  # host sync
    for rank in range(1, len(with_more)):
        nodes = by_children[: with_more[rank]]  # the nodes with more than `rank - 1` children
        col = rank - 1
        res, out, gone = residual[nodes], off[nodes], removed[nodes]
        total = (res.sum(dim=-1) + out).clamp(min=TINY)  # p_i's normaliser
        q_now = q[nodes] / (1.0 - gone).clamp(min=TINY)[:, None]
        q_now[:, :col] = 0.0  # the children drawn before
        accept[nodes, col] = (res[:, col] / total / q_now[:, col].clamp(min=TINY)).clamp(max=1.0)
        residual[nodes] = (res / total[:, None] - q_now).clamp(min=0.0)
        off[nodes] = out / total
        removed[nodes] = gone + q[nodes, col]
    return accept, residual, off


def bonus_token(
    logits: torch.Tensor | NodeLogits, proposals: Proposals, node: torch.Tensor, residual: torch.Tensor,
    off: torch.Tensor, generator: torch.Generator,
) -> torch.Tensor:
    """[] a draw from `node`'s residual after all its children are rejected: on its row by an
    exponential race over residual[node], off it from p restricted to the tokens off the row, chosen
    by their masses. One host sync (the node's row of logits)."""
    index = int(node)
    probs = logits[index : index + 1].float().softmax(dim=-1)[0]  # [vocab]
    live = proposals.probs[index] > 0
    ids = proposals.token_ids[index].clamp(max=probs.shape[0] - 1)
    probs[ids[live]] = 0.0  # p off the row
    noise = torch.empty_like(probs).exponential_(generator=generator)
    off_token = (probs / noise).argmax()
    row_noise = torch.empty_like(residual[index]).exponential_(generator=generator)
    row_token = proposals.token_ids[index, (residual[index] / row_noise).argmax()]
    row_mass = residual[index].sum()
    coin = torch.rand((), generator=generator, device=residual.device)
    return torch.where(coin * (row_mass + off[index]) < off[index], off_token, row_token)


def child_log_probs(tree: Tree, accept: torch.Tensor) -> torch.Tensor:
    """[n] log P(the walk moves from each node's parent to it | it reached the parent): accept[parent,
    rank] times the rejections of the earlier siblings; root 0. accept: [n, w]."""
    proposals = tree.proposals
    assert proposals is not None
    rejected = torch.log1p(-accept).cumsum(dim=-1)  # [n, w] log P(children 0..i all rejected)
    before = torch.nn.functional.pad(rejected[:, :-1], (1, 0))  # [n, w] log P(children before i rejected)
    log_first = accept.log() + before  # [n, w] log P(child i is the first accepted); -inf past the children
    parents = tree.parents.clamp(min=0)
    node_lp = log_first[parents, proposals.ranks]
    node_lp[0] = 0.0
    return node_lp


def num_children(tree: Tree) -> torch.Tensor:
    """[n] children per node."""
    counts = torch.zeros(tree.num_nodes, dtype=torch.long, device=tree.parents.device)
    return counts.index_add_(0, tree.parents[1:], torch.ones_like(tree.parents[1:]))


def verify_rrs(
    tree: Tree,
    logits: torch.Tensor | NodeLogits,
    generator: torch.Generator,
    rows_per_block: int | None = None,
) -> Verdict:
    """Recursive rejection sampling at every node of an RRS tree (tree.proposals), then the walk from
    the root along accepted children; the bonus token is the last node's residual draw. Fresh random
    numbers from `generator` for every node. node_log_probs: each node's log P(accepted | parent
    reached), so path_probabilities gives every node's probability of being accepted (the tree's
    expected acceptance). One host sync."""
    proposals = tree.proposals
    assert proposals is not None, "RRS verification needs the draft's proposals"
    rows_per_block = rows_per_block or block_rows(logits.shape[1])
    on_row, off_mass = target_on_rows(logits, proposals, rows_per_block)
    accept, residual, off = rejection_steps(on_row, off_mass, proposals.probs, num_children(tree))
    coins = torch.rand(accept.shape, generator=generator, device=accept.device)
    accepted_here = coins < accept  # [n, w] (False past the children: accept is 0 there)
    first = torch.where(accepted_here.any(dim=-1), accepted_here.float().argmax(dim=-1), -1)  # [n] rank or -1
    matches = first[tree.parents.clamp(min=0)] == proposals.ranks  # [n]
    matches[0] = True
    on_path = ~(tree.ancestors & ~matches[None, :]).any(dim=1)  # [n]
    path = on_path.nonzero().squeeze(1)  # ascending index == ascending depth along one chain (host sync)
    bonus = bonus_token(logits, proposals, path[-1], residual, off, generator)
    return Verdict(path=path, bonus_id=bonus, node_log_probs=child_log_probs(tree, accept))
