"""Tree verification: SpecExec sample-and-match, and SpecInfer multi-step speculative sampling.

Both are lossless for any tree: every emitted token is an exact draw from the target's
(processed) conditional distribution given the tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.spec.sampling import sample_tokens
from engine.spec.tree import Tree


@dataclass
class Verdict:
    path: torch.Tensor  # [m] node indices root..last accepted, in depth order
    bonus_id: torch.Tensor  # [] long, the target's token after the last accepted node
    logits: torch.Tensor  # [n, vocab] the processed target logits it was judged on (--budget auto's curve)


def verify_tree(tree: Tree, logits: torch.Tensor, greedy: bool, generator: torch.Generator) -> Verdict:
    """Sample-and-match. logits: [n, vocab] processed target logits at every node.

    Draw t[v] at every node; walk from the root to the child whose token is t[current].
    Siblings are distinct, so the walk is unique; accepted nodes are those whose whole path matches."""
    drawn = sample_tokens(logits, greedy, generator)  # [n]
    parents = tree.parents.clamp(min=0)
    matches = tree.token_ids == drawn[parents]  # [n]
    matches[0] = True
    accepted = ~(tree.ancestors & ~matches[None, :]).any(dim=1)  # [n]
    # ascending index == ascending depth along one chain; a host sync: the path length sizes the commit
    path = accepted.nonzero().squeeze(1)
    return Verdict(path=path, bonus_id=drawn[path[-1]], logits=logits)


def path_probabilities(tree: Tree, logits: torch.Tensor) -> torch.Tensor:
    """[n]: the target's probability of each node's path from the root (root: 1)."""
    if tree.num_nodes == 1:
        return torch.ones(1, device=logits.device)
    parents = tree.parents.clamp(min=0)
    # log p(token | parent's path) for the n entries needed, without an [n, vocab] log-softmax
    node_lp = logits[parents, tree.token_ids] - torch.logsumexp(logits, dim=-1)[parents]  # [n]
    node_lp[0] = 0.0
    node_lp = torch.nan_to_num(node_lp, neginf=-1e4)
    path_lp = tree.ancestors.float() @ node_lp  # [n]
    return path_lp.exp()


def children_lists(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def verify_specinfer(tree: Tree, logits: torch.Tensor, generator: torch.Generator) -> Verdict:
    """Multi-step speculative sampling over a tree whose children were drawn i.i.d. from the
    draft distribution at their parent (tree.draft_probs). Visits children in sampling order:
    accept x with prob min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0))."""
    assert tree.draft_probs is not None, "SpecInfer verification needs the draft distributions"
    probs = logits.softmax(dim=-1)  # [n, vocab]
    parents = tree.parents.tolist()
    tokens = tree.token_ids.tolist()
    children = children_lists(parents)
    current, path = 0, [0]
    target = probs[0]
    while True:
        draft = tree.draft_probs[current]
        next_node = None
        for child in children[current]:
            token = tokens[child]
            ratio = target[token] / draft[token].clamp(min=1e-30)
            coin = torch.rand((), generator=generator, device=probs.device)
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
        target = probs[current]
    bonus = torch.multinomial(target, 1, generator=generator)[0]
    return Verdict(path=torch.tensor(path, device=probs.device), bonus_id=bonus, logits=logits)
