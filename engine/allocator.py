"""The CUDA caching allocator's settings, chosen before CUDA starts (no torch import here: `specexec`
sets them before parsing loads any model library).

Expandable segments: the allocator maps pages into one growing segment per stream and pool instead of a
new cudaMalloc per size, so memory freed by one allocation fits the next of another size. Overlap runs the
target pass, the draft and the trees on three streams, each caching its own blocks; with the default
segments a 23 GB cap ran out at 17.4 GB allocated and 21.4 GB reserved (H200, issue 38's full shape,
budget 1024, four streams, 8x extensions), the 4 GB between them split into pieces too small for the
pass's 0.5 GB logits. vLLM turned it on by default for the same reason (fragmentation at graph capture).
A user's own PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF is left as it is."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either (the second from 2.9)
EXPANDABLE = "expandable_segments:True"


def prefer_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn expandable segments on for this process unless the user configured the allocator or CUDA has
    already started (its allocator read its settings then). Returns whether it set them."""
    if any(name in environ for name in ALLOC_CONF_VARS):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    return True
