import pytest
import torch

from engine.model import checkpoint

# Tiny models run fastest single-threaded, and a shared 2-core machine punishes oversubscription.
torch.set_num_threads(1)

_resolve_device = checkpoint.resolve_device


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """`device: auto` means CPU in tests not marked `cuda`, so the suite's CPU expectations (fp32,
    exact equality with a CPU reference) hold on a machine with a GPU too."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setattr(
            checkpoint, "resolve_device", lambda device: _resolve_device("cpu" if device == "auto" else device)
        )
