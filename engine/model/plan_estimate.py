"""What `specexec plan` estimates beside the device plan, from config.json shapes: tokens/s and host RAM.

    speed = estimate_speed(result, link_gbps=None, tokens_per_pass=None)  # None: the assumed defaults
    host = host_ram(result)

Speed: a streamed pass is copy-bound (docs/bench/gpu.md: an H100's streamed pass took 1.00-1.06x
max(copy, compute) from 1 to 2048 tree tokens, and a 70B layer computes in a fraction of its copy), so
target passes per second are about link bandwidth / bytes streamed per pass, and tokens/s about tokens per
pass times that. It leaves out the draft's time (overlapped with the pass on CUDA), the compute of a pass
slower than its copy, and the real pair's acceptance: an estimate, said so wherever it is printed, with the
bandwidth and the tokens per pass it assumed.

Host RAM: the load's peak as engine.model.host_plan counts it before a real load (a RAM-streamed target's
pinned layer store, a GPTQ target loaded whole first, the draft on the host before it moves), from the
shapes instead of safetensors headers, plus the same margin.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.config import SELF_DRAFT, OffloadConfig
from engine.model import config_shapes, gptq, host_plan
from engine.model.pair_plan import GB, PairPlan
from engine.offload.build import plan_resident

# bytes per second the streamed layers arrive at, by offload source (assumed; --link-gbps overrides)
LINK_GBPS = {"ram": 25.0, "disk": 3.5}
LINK_WHY = {
    "ram": "assumed, PCIe 4.0 x16 pinned host-to-device as CUDA's bandwidthTest reports it (an H100 on PCIe 5 "
           "measured 52-55, docs/bench/gpu.md; --link-gbps)",
    "disk": "assumed, a PCIe 3.0 x4 NVMe SSD's sequential read (this project's CPU machine measured 1.7-1.9; "
            "--link-gbps)",
}
# tokens per target pass of a 70B target with a 7B draft in the SpecExec paper (Svirschevski et al., 2024):
# 13.46 at budget 256 (Llama-2-70B GPTQ, RTX 4090) and about 20 at budget 2048 (fp16, A100); other budgets
# on the line through them in log2(budget), clipped to [1, 20]
PAPER_ANCHORS = ((256, 13.46), (2048, 20.0))


def assumed_tokens_per_pass(budget: int, method: str) -> float:
    if method == "autoregressive":
        return 1.0
    (low_budget, low), (high_budget, high) = PAPER_ANCHORS
    slope = (high - low) / math.log2(high_budget / low_budget)
    return min(high, max(1.0, low + slope * math.log2(budget / low_budget)))


@dataclass(frozen=True)
class SpeedEstimate:
    streamed_bytes: int  # per target pass
    streamed_layers: int
    link_gbps: float
    link_why: str  # where the bandwidth came from
    tokens_per_pass: float
    tokens_why: str

    @property
    def pass_seconds(self) -> float:
        return self.streamed_bytes / (self.link_gbps * GB)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_pass / self.pass_seconds

    def describe(self) -> str:
        """Two lines: the estimate, then what it assumed."""
        return (f"speed estimate (arithmetic, not measured): about {self.tokens_per_second:.2f} tokens/s "
                f"({1 / self.pass_seconds:.2f} without speculation), an upper bound: {self.streamed_bytes / GB:.2f} GB "
                f"streamed per target pass ({self.streamed_layers} layers) at {self.link_gbps:g} GB/s = "
                f"{self.pass_seconds:.2f} s per pass, x {self.tokens_per_pass:.1f} tokens per pass; draft time and "
                f"compute beyond the copy not counted\n  {self.link_gbps:g} GB/s: {self.link_why}; "
                f"{self.tokens_per_pass:.1f} tokens per pass: {self.tokens_why}")


def estimate_speed(result: PairPlan, link_gbps: float | None = None,
                   tokens_per_pass: float | None = None) -> SpeedEstimate | None:
    """tokens/s of `result`'s plan (module doc); None when no layer streams (the pass is compute-bound: the
    link says nothing of its time)."""
    config = result.config
    streamed_layers = result.num_layers - result.resident_layers
    if not config.offload.enabled or streamed_layers <= 0:
        return None
    source = config.offload.source
    link_why = "given (--link-gbps)" if link_gbps is not None else LINK_WHY[source]
    budget = result.inputs.budget
    if tokens_per_pass is not None:
        tokens_why = "given (--tokens-per-pass)"
    elif config.speculation.method == "autoregressive":
        tokens_why = "autoregressive"
    else:
        tokens_why = (f"assumed for budget {budget}, from the SpecExec paper's 70B targets with 7B drafts (13.5 at "
                      "budget 256, about 20 at 2048; --tokens-per-pass)")
    return SpeedEstimate(sum(streamed_layer_bytes(result)), streamed_layers, link_gbps or LINK_GBPS[source], link_why,
                         tokens_per_pass or assumed_tokens_per_pass(budget, config.speculation.method), tokens_why)


def resident_offload(result: PairPlan) -> OffloadConfig:
    """The plan's offload settings with its resident layers fixed (as sized, whatever --gpu-memory asked)."""
    return dataclasses.replace(result.config.offload, resident_layers=result.resident_layers, gpu_memory=None)


def streamed_layer_bytes(result: PairPlan) -> list[int]:
    """Bytes of each target layer that streams in every pass (layers may differ: engine.model.config_shapes)."""
    layers = result.weights[0].layers
    resident = set(plan_resident(list(layers), resident_offload(result)))
    return [nbytes for idx, nbytes in enumerate(layers) if idx not in resident]


def host_ram(result: PairPlan) -> tuple[int, list[tuple[str, int]]]:
    """(bytes with the margin, the items) of host memory the load of `result`'s pair holds at its peak."""
    config = result.config
    target, draft = result.weights
    checkpoint = host_plan.CheckpointBytes(tuple(target.layers), target.outer)
    target_cfg, _ = config_shapes.read_model_config(config.model.target)
    streaming = config.offload.enabled and gptq.streams_as_plain(target_cfg)
    on_host = draft.total if draft and config.model.draft != SELF_DRAFT else 0  # a self-draft is made on the device
    items = host_plan.host_items(resident_offload(result), False, checkpoint, on_host, streaming)
    need = sum(nbytes for _, nbytes in items)
    return need + host_plan.margin_for(need), items
