"""Hand-built trees for tests: a parent list -> the ancestor matrix and depths, independently of engine.speculation.tree."""

from __future__ import annotations

import torch


def ancestors_and_depths(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestors [n, n] bool, each node its own ancestor; depths [n] long) of a tree given as each
    node's parent index (-1 for the root; parents precede their children)."""
    num_nodes = len(parents)
    ancestors = torch.eye(num_nodes, dtype=torch.bool)
    depths = torch.zeros(num_nodes, dtype=torch.long)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
            depths[node] = depths[parent] + 1
    return ancestors, depths


def path_of(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
