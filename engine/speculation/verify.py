"""Tree verification: SpecExec sample-and-match, and SpecInfer multi-step speculative sampling.

Both are lossless for any tree: every emitted token is an exact draw from the target's
(processed) conditional distribution given the tokens before it.

Logits come as a processed [n, vocab] tensor or as NodeLogits (processed on demand); either way
they are read in blocks of rows (`logits[a:b]`), and nothing of size [n, vocab] is made here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.speculation.sampling import NodeLogits, block_rows, blocks, sample_tokens
from engine.speculation.tree import Tree

Logits = torch.Tensor | NodeLogits  # [n, vocab] processed target logits; `logits[a:b]` is [b - a, vocab]


@dataclass
class Verdict:
    path: torch.Tensor  # [m] node indices root..last accepted, in depth order
    bonus_id: torch.Tensor  # [] long, the target's token after the last accepted node
    # [n] log P(verification accepts the node | it accepts its parent), root 0 (budget auto): under
    # sample-and-match the target's log p(node's token | parent's path); RRS trees: rrs.child_log_probs
    node_log_probs: torch.Tensor | None = None


def add_child_log_probs(tree: Tree, block: torch.Tensor, rows: slice, node_lp: torch.Tensor) -> torch.Tensor:
    """node_lp: [n]; returns it with log p(token | parent's path) set at the nodes whose parent is in
    `rows`. block: [rows, vocab] processed logits of those rows. No host sync."""
    lse = torch.logsumexp(block, dim=-1)  # [rows]
    local = tree.parents - rows.start  # [n] each node's parent, as a row of the block
    inside = (local >= 0) & (local < block.shape[0])
    local = local.clamp(0, block.shape[0] - 1)
    return torch.where(inside, block[local, tree.token_ids] - lse[local], node_lp)


def node_log_probs(tree: Tree, logits: Logits, rows_per_block: int) -> torch.Tensor:
    """[n] log p(node's token | parent's path) under the processed logits; root 0."""
    node_lp = torch.zeros(tree.num_nodes, device=tree.token_ids.device)
    for rows in blocks(tree.num_nodes, rows_per_block):
        node_lp = add_child_log_probs(tree, logits[rows], rows, node_lp)
    return node_lp


def draw_tokens(
    tree: Tree,
    logits: Logits,
    greedy: bool,
    generator: torch.Generator,
    rows_per_block: int,
    with_log_probs: bool,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n] one token per node (sample_tokens block by block, in row order; with `noise`, [depths, vocab],
    a node at depth d races with row d), and with_log_probs: node_log_probs from the same blocks."""
    drawn = torch.empty(tree.num_nodes, dtype=torch.long, device=tree.token_ids.device)
    node_lp = torch.zeros(tree.num_nodes, device=tree.token_ids.device) if with_log_probs else None
    for rows in blocks(tree.num_nodes, rows_per_block):
        block = logits[rows]  # [rows, vocab]
        block_noise = None if noise is None or greedy else noise[tree.depths[rows]]  # [rows, vocab]
        drawn[rows] = sample_tokens(block, greedy, generator, block_noise)
        if node_lp is not None:
            node_lp = add_child_log_probs(tree, block, rows, node_lp)
        del block  # freed before the next block is made
    return drawn, node_lp


def verify_tree(
    tree: Tree,
    logits: Logits,
    greedy: bool,
    generator: torch.Generator,
    rows_per_block: int | None = None,
    with_log_probs: bool = False,
    noise: torch.Tensor | None = None,
) -> Verdict:
    """Sample-and-match. Draw t[v] at every node; walk from the root to the child whose token is
    t[current]. Siblings are distinct, so the walk is unique; accepted nodes are those whose whole
    path matches. rows_per_block: None sizes blocks by LOGITS_BLOCK_BYTES. noise: [max depth + 1,
    vocab] Exp(1) rows per depth (sampling.position_noise), else fresh draws from `generator`."""
    rows_per_block = rows_per_block or block_rows(logits.shape[1])
    drawn, node_lp = draw_tokens(tree, logits, greedy, generator, rows_per_block, with_log_probs, noise)  # [n]
    parents = tree.parents.clamp(min=0)
    matches = tree.token_ids == drawn[parents]  # [n]
    matches[0] = True
    accepted = ~(tree.ancestors & ~matches[None, :]).any(dim=1)  # [n]
    # ascending index == ascending depth along one chain; a host sync: the path length sizes the commit
    path = accepted.nonzero().squeeze(1)
    return Verdict(path=path, bonus_id=drawn[path[-1]], node_log_probs=node_lp)


def path_probabilities(tree: Tree, node_lp: torch.Tensor) -> torch.Tensor:
    """[n]: the target's probability of each node's path from the root (root: 1).
    node_lp: [n] node_log_probs."""
    if tree.num_nodes == 1:
        return torch.ones(1, device=node_lp.device)
    node_lp = torch.nan_to_num(node_lp, neginf=-1e4)
    path_lp = tree.ancestors.float() @ node_lp  # [n]
    return path_lp.exp()


def children_lists(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def align_vocab(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., vocab'] -> [..., vocab_size]: cut, or pad with zero probability."""
    if probs.shape[-1] >= vocab_size:
        return probs[..., :vocab_size]
    return torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[-1]))


def verify_specinfer(
    tree: Tree,
    logits: Logits,
    generator: torch.Generator,
    rows_per_block: int | None = None,
    with_log_probs: bool = False,
) -> Verdict:
    """Multi-step speculative sampling over a tree whose children were drawn i.i.d. from the
    draft distribution at their parent (tree.draft_probs). Visits children in sampling order:
    accept x with prob min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)). Only the rows
    the walk visits are processed."""
    assert tree.draft_probs is not None, "SpecInfer verification needs the draft distributions"
    vocab_size = logits.shape[1]
    parents = tree.parents.tolist()
    tokens = tree.token_ids.tolist()
    children = children_lists(parents)
    current, path = 0, [0]
    target = logits[0:1].softmax(dim=-1)[0]  # [vocab]
    while True:
        draft = align_vocab(tree.draft_probs[current], vocab_size)  # [vocab]
        next_node = None
        for child in children[current]:
            token = tokens[child]
            ratio = target[token] / draft[token].clamp(min=1e-30)
            coin = torch.rand((), generator=generator, device=target.device)
            if bool(coin < ratio):
                next_node = child
                break
            residual = (target - draft).clamp(min=0)
            total = residual.sum()
            target = residual / total if bool(total > 0) else target
        if next_node is None:
            break
        current = next_node
        path.append(current)
        target = logits[current : current + 1].softmax(dim=-1)[0]
    bonus = torch.multinomial(target, 1, generator=generator)[0]
    node_lp = None
    if with_log_probs:
        node_lp = node_log_probs(tree, logits, rows_per_block or block_rows(vocab_size))
    return Verdict(path=torch.tensor(path, device=target.device), bonus_id=bonus, node_log_probs=node_lp)
