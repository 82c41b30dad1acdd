"""What every section of one run shares."""

from __future__ import annotations

import math
import time
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
    deadline: float | None = None  # time.perf_counter() by which the run should end (--seconds); None: no limit
    steps_only: bool = False  # full shape: only the warm-up and the step rows (--steps-only)

    def time_left(self) -> float:
        """Seconds until the deadline (inf without one)."""
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    def built(self) -> Checkpoints:
        if self.checkpoints is None:
            raise RuntimeError("no checkpoints to measure: the build section failed")
        return self.checkpoints
