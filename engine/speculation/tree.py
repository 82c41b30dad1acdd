"""Token trees as flat tensors. Node 0 is the root; every parent index is below its children's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class Proposals:
    """RRS trees (engine.speculation.rrs_growth): at every expanded node, the draft's proposal
    distribution q (its processed distribution cut to its top w tokens, renormalised) in the order of
    one draw without replacement (Gumbel top-k). A node's children are a prefix of its row."""

    token_ids: torch.Tensor  # [n, w] long, in draw order; rows of unexpanded nodes: 0
    probs: torch.Tensor  # [n, w] float, q of token_ids; 0 where q is 0 and at unexpanded nodes
    ranks: torch.Tensor  # [n] long, each node's index in its parent's row (root: 0)
    pis: torch.Tensor  # [n] float, the rank-th largest q of the parent's row (root: 1)


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
    # SpecExec trees: the top-w children each expanded node proposed (kept or not), so a re-rooted
    # subtree can offer them again. [n, w] draft log-probs (-inf at unexpanded nodes) and token ids.
    child_lp: torch.Tensor | None = None
    child_ids: torch.Tensor | None = None
    extension_forwards: int = 0  # draft forwards an extension spent growing this tree during a pass (overlap)
    proposals: Proposals | None = None  # RRS trees: the draft's proposals at every expanded node
    predicted: int = 0  # nodes grafted from a predicted output, the last ones (engine.speculation.prediction)

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

    def to(self, device: torch.device) -> Tree:
        """The tree with every tensor on `device` (the same tensors where they are there already)."""
        moved = {field.name: value.to(device) for field in dataclasses.fields(self)
                 if isinstance(value := getattr(self, field.name), torch.Tensor)}
        if self.proposals is not None:
            moved["proposals"] = Proposals(*(getattr(self.proposals, field.name).to(device)
                                             for field in dataclasses.fields(Proposals)))
        return dataclasses.replace(self, **moved)

    def draft_mask(self, selected: torch.Tensor, committed: int, width: int) -> torch.Tensor:
        """[k, width] bool: what each of `selected` ([k], its draft slot assigned) sees in the draft cache:
        the committed slots [0, committed) and the slots of the expanded nodes on its path (itself included)."""
        allowed = torch.zeros(selected.shape[0], width, dtype=torch.bool, device=selected.device)
        allowed[:, :committed] = True
        has_slot = self.draft_slots >= 0
        allowed[:, self.draft_slots[has_slot]] = self.ancestors[selected][:, has_slot]
        return allowed


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


def child_index(tree: Tree) -> dict[tuple[int, int], int]:
    """(parent, token) -> node, for every node but the root (siblings are distinct). One host sync."""
    num_nodes = tree.num_nodes
    host = torch.cat([tree.token_ids, tree.parents]).tolist()
    return {(host[num_nodes + node], host[node]): node for node in range(1, num_nodes)}


def spelled_path(tree: Tree, token_ids: list[int]) -> list[int]:
    """The root, then the nodes spelling the longest prefix of `token_ids` below it (indices increase)."""
    child_of = child_index(tree)
    path = [0]
    for token in token_ids:
        node = child_of.get((path[-1], token))
        if node is None:
            break
        path.append(node)
    return path


def find_node(tree: Tree, token_ids: list[int]) -> int | None:
    """The node whose path below the root is `token_ids`, or None. One host sync."""
    path = spelled_path(tree, token_ids)
    return path[-1] if len(path) == len(token_ids) + 1 else None


def renumbering(kept: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """[num_nodes] long: each node's index among `kept` ([m], in their new order), -1 for nodes not kept."""
    new_index = torch.full((num_nodes,), -1, dtype=torch.long, device=kept.device)
    new_index[kept] = torch.arange(kept.shape[0], device=kept.device)
    return new_index


def renumbered(node_refs: torch.Tensor, new_index: torch.Tensor) -> torch.Tensor:
    """Node indices (any shape; -1: none) through `renumbering`'s map; -1 stays -1."""
    return torch.where(node_refs >= 0, new_index[node_refs.clamp(min=0)], node_refs)


def keep_nodes(tree: Tree, nodes: torch.Tensor) -> Tree:
    """The tree restricted to `nodes` ([m] ascending indices, closed under ancestors, the root first)."""
    return Tree(
        token_ids=tree.token_ids[nodes],
        parents=renumbered(tree.parents[nodes], renumbering(nodes, tree.num_nodes)),
        depths=tree.depths[nodes],
        scores=tree.scores[nodes],
        ancestors=tree.ancestors[nodes][:, nodes],
        draft_slots=tree.draft_slots[nodes],
        child_lp=None if tree.child_lp is None else tree.child_lp[nodes],
        child_ids=None if tree.child_ids is None else tree.child_ids[nodes],
        extension_forwards=tree.extension_forwards,
    )
