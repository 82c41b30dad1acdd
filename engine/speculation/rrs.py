"""Recursive rejection sampling (RRS) over a tree whose children were drawn without replacement.

At a node v the draft's proposal distribution is q (tree.proposals: v's top-w draft tokens,
renormalised) and the target's is p (processed logits at v). v's children c_1..c_k are the first k
draws of one draw without replacement from q. Step i: accept c_i with probability
min(1, p_i(c_i) / q_i(c_i)); on rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i without
c_i, renormalised. If none is accepted the node's token is drawn from p_{k+1}. Each step emits exactly
p_i given that it is reached, so the node emits exactly p (docs/design.md, "RRS trees").

Vectorised like sample-and-match: every node's outcome is computed at once (the residual changes only
on the node's w proposal tokens; off them it is p scaled, so per node only p on its row, the mass off
it and one draw off it are needed), then the walk from the root follows the accepted children. One
host sync: the accepted path.
"""

from __future__ import annotations

import torch

from engine.speculation.sampling import NodeLogits, block_rows, blocks
from engine.speculation.tree import Proposals, Tree
from engine.speculation.verify import Verdict

TINY = 1e-30


def target_on_rows(
    logits: torch.Tensor | NodeLogits, proposals: Proposals, generator: torch.Generator, rows_per_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per node, from its processed target distribution p: p at its proposal tokens ([n, w], 0 where
    q is 0), p's mass off them ([n]), and one draw from p restricted to the tokens off them ([n]; any
    token where that mass is 0). Fresh Exp(1) noise per node from `generator`; block by block."""
    num_nodes, width = proposals.token_ids.shape
    device = proposals.token_ids.device
    on_row = torch.zeros(num_nodes, width, device=device)
    off_mass = torch.zeros(num_nodes, device=device)
    off_token = torch.zeros(num_nodes, dtype=torch.long, device=device)
    live = proposals.probs > 0  # [n, w] the row's proposal tokens (distinct within a row)
    for rows in blocks(num_nodes, rows_per_block):
        probs = logits[rows].float().softmax(dim=-1)  # [rows, vocab]
        # a row's entries of q = 0 may name ids past the target's vocabulary (a padded draft): read as 0
        ids = proposals.token_ids[rows].clamp(max=probs.shape[1] - 1)
        on_row[rows] = probs.gather(1, ids) * live[rows]
        on_tokens = torch.zeros_like(probs).scatter_add_(1, ids, live[rows].float()) > 0  # [rows, vocab]
        probs.masked_fill_(on_tokens, 0.0)  # the row's live tokens (distinct) to 0
        off_mass[rows] = probs.sum(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        off_token[rows] = probs.div_(noise).argmax(dim=-1)
        del probs, noise
    return on_row, off_mass, off_token


def rejection_steps(
    on_row: torch.Tensor, off_mass: torch.Tensor, q: torch.Tensor, num_children: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every node's recursive rejection sampling, all nodes at once, one loop step per child rank.

    on_row: [n, w] p at the row's tokens; off_mass: [n]; q: [n, w] proposal probabilities in draw
    order; num_children: [n] (a node's children are its first num_children row entries). Returns
    (accept [n, w]: P(accept child i | children before it rejected), 0 past the children; and the
    residual after every child is rejected: unnormalised on the row [n, w] and off it [n])."""
    residual, off = on_row.clone(), off_mass.clone()
    removed = torch.zeros_like(off)  # q mass of the children rejected so far
    accept = torch.zeros_like(q)
    columns = torch.arange(q.shape[1], device=q.device)
    for rank in range(int(num_children.max()) if num_children.numel() else 0):
        active = rank < num_children  # [n]
        total = (residual.sum(dim=-1) + off).clamp(min=TINY)  # [n] p_i's normaliser
        q_now = (q / (1.0 - removed).clamp(min=TINY)[:, None]).masked_fill(columns[None, :] < rank, 0.0)
        ratio = residual[:, rank] / total / q_now[:, rank].clamp(min=TINY)
        accept[:, rank] = torch.where(active, ratio.clamp(max=1.0), 0.0)
        residual = torch.where(active[:, None], (residual / total[:, None] - q_now).clamp(min=0.0), residual)
        off = torch.where(active, off / total, off)
        removed = torch.where(active, removed + q[:, rank], removed)
    return accept, residual, off


def bonus_tokens(
    proposals: Proposals, residual: torch.Tensor, off: torch.Tensor, off_token: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """[n] a draw from each node's residual after all its children are rejected: on its row by an
    exponential race over `residual`, off it `off_token`, chosen by their masses."""
    noise = torch.empty_like(residual).exponential_(generator=generator)
    row_pick = (residual / noise).argmax(dim=-1)  # [n]
    row_token = proposals.token_ids.gather(1, row_pick[:, None]).squeeze(1)
    row_mass = residual.sum(dim=-1)
    coin = torch.rand(off.shape, generator=generator, device=off.device)
    return torch.where(coin * (row_mass + off) < off, off_token, row_token)


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
    on_row, off_mass, off_token = target_on_rows(logits, proposals, generator, rows_per_block)
    accept, residual, off = rejection_steps(on_row, off_mass, proposals.probs, num_children(tree))
    bonus = bonus_tokens(proposals, residual, off, off_token, generator)  # [n]
    coins = torch.rand(accept.shape, generator=generator, device=accept.device)
    accepted_here = coins < accept  # [n, w] (False past the children: accept is 0 there)
    first = torch.where(accepted_here.any(dim=-1), accepted_here.float().argmax(dim=-1), -1)  # [n] rank or -1
    matches = first[tree.parents.clamp(min=0)] == proposals.ranks  # [n]
    matches[0] = True
    on_path = ~(tree.ancestors & ~matches[None, :]).any(dim=1)  # [n]
    path = on_path.nonzero().squeeze(1)  # ascending index == ascending depth along one chain (host sync)
    return Verdict(path=path, bonus_id=bonus[path[-1]], node_log_probs=child_log_probs(tree, accept))
