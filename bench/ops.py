"""Counting the tensor ops a piece of host code runs (each one a kernel launch on a GPU)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that make a view: no kernel runs
VIEWS = frozenset({"view", "unsqueeze", "expand", "slice", "select", "alias", "lift_fresh", "t", "permute", "squeeze",
                   "as_strided", "_unsafe_view", "detach", "split", "split_with_sizes", "unbind"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while inside and `on` (views too unless `kernels_only`)."""

    def __init__(self, kernels_only: bool = False) -> None:
        super().__init__()
        self.kernels_only = kernels_only
        self.count, self.on = 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not (self.kernels_only and func.__name__.split(".")[0] in VIEWS):
            self.count += 1
        return func(*args, **(kwargs or {}))
