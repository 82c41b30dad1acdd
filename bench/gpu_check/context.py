"""What every section of one run shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.gpu_check.plan import Plan
from bench.gpu_check.report import Report


@dataclass(frozen=True)
class Checkpoints:
    target: Path
    draft: Path
    layer_bytes: int  # one target decoder layer, packed as the RAM store holds it
    target_bytes: int  # every target tensor
    seconds: float  # build time (0 when reused)
    reused: bool


@dataclass
class CheckContext:
    plan: Plan
    device: torch.device
    dtype: torch.dtype
    work_dir: Path
    report: Report
    checkpoints: Checkpoints | None = None
    facts: dict[str, float] = field(default_factory=dict)  # figures later sections reuse (copy bandwidth)

    def built(self) -> Checkpoints:
        if self.checkpoints is None:
            raise RuntimeError("no checkpoints to measure: the build section failed")
        return self.checkpoints
