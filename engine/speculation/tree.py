"""Token trees as flat tensors. Node 0 is the root; every parent index is below its children's."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tree:
    token_ids: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 at the root
    depths: torch.Tensor  # [n] long, 0 at the root
    scores: torch.Tensor  # [n] float, draft log-prob of the path from the root (+ log decay per level)
    ancestors: torch.Tensor  # [n, n] bool, ancestors[i, j]: j is i or an ancestor of i
    draft_slots: torch.Tensor  # [n] long, the node's slot in the draft KV cache, -1 if never expanded
    draft_probs: torch.Tensor | None = None  # [n, vocab] draft distribution at expanded nodes (SpecInfer)
    allowed: torch.Tensor | None = None  # [n, ceil(vocab / 32)] int32 packed grammar masks (structured output)

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[0]

    @classmethod
    def single(cls, root_id: int, device: torch.device) -> Tree:
        return cls(
            token_ids=torch.tensor([root_id], device=device),
            parents=torch.tensor([-1], device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
            scores=torch.zeros(1, device=device),
            ancestors=torch.ones(1, 1, dtype=torch.bool, device=device),
            draft_slots=torch.full((1,), -1, dtype=torch.long, device=device),
        )


def child_ancestors(ancestors: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Ancestor rows for new children of `parents` ([m]): their parent's row plus themselves.

    ancestors: [n, n]. Returns [m, n + m]."""
    num_new = parents.shape[0]
    rows = ancestors[parents]  # [m, n]
    eye = torch.eye(num_new, dtype=torch.bool, device=ancestors.device)
    return torch.cat([rows, eye], dim=1)


def append_nodes(
    ancestors: torch.Tensor, parents: torch.Tensor
) -> torch.Tensor:
    """Grow the [n, n] ancestor matrix by children of `parents` ([m]) to [n + m, n + m]."""
    num_old = ancestors.shape[0]
    top = torch.cat(
        [ancestors, torch.zeros(num_old, parents.shape[0], dtype=torch.bool, device=ancestors.device)], dim=1
    )
    return torch.cat([top, child_ancestors(ancestors, parents)], dim=0)


def prefix_tree_mask(ancestors: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Target pass mask: every node sees the whole prefix and its own ancestors.

    Node i sits at slot prefix_len + i. Returns [n, prefix_len + n] bool."""
    num_nodes = ancestors.shape[0]
    prefix = torch.ones(num_nodes, prefix_len, dtype=torch.bool, device=ancestors.device)
    return torch.cat([prefix, ancestors], dim=1)


def causal_mask(num_tokens: int, start_slot: int, device: torch.device) -> torch.Tensor:
    """Plain causal mask for tokens at slots [start_slot, start_slot + n): [n, start_slot + n] bool."""
    cols = torch.arange(start_slot + num_tokens, device=device)
    rows = torch.arange(start_slot, start_slot + num_tokens, device=device)
    return cols[None, :] <= rows[:, None]


def path_token_counts(tree: Tree, vocab_size: int, rows: slice = slice(None)) -> torch.Tensor:
    """Counts of each token on the path of every node in `rows`, below the root (node included):
    [num_rows, vocab] float. The root is never counted: it is the sequence's last committed token,
    which the sequence's own counts hold if it was generated."""
    on_path = tree.ancestors[rows].float()  # [num_rows, n]: row i has a 1 for each node on i's path
    on_path[:, 0] = 0.0
    token_of = tree.token_ids[None, :].expand(on_path.shape[0], -1)  # [num_rows, n]: column j's token
    counts = torch.zeros(on_path.shape[0], vocab_size, device=on_path.device)
    return counts.scatter_add_(1, token_of, on_path)  # no nonzero(): no host sync
