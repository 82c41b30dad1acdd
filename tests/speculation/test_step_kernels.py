"""A step enters SDPA's kernels once for all its passes (engine.speculation.batch.run_batch): the draft's and
the target's passes inside it find the flags set and enter nothing (engine.model.attention.sdpa_backends).
On a CPU under the default flags there is nothing to enter at all; pinned kernels (as a GPU check pins
them, and as every CUDA pass reads the flags) show the once-per-step entry."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

import engine.model.attention as attention
from engine.config import EngineConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine, load_pair
from engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_tiny_pair


def test_a_step_enters_the_sdpa_kernels_once(tmp_path, monkeypatch):
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=11)
    config = EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)), speculation=SpeculationConfig(budget=16))
    engine = Engine(load_pair(config), config)
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    entered: list[list[SDPBackend]] = []
    sdpa_kernel = attention.sdpa_kernel
    monkeypatch.setattr(attention, "sdpa_kernel", lambda backends: entered.append(list(backends)) or sdpa_kernel(backends))
    engine.generate_ids(prompt, params)
    assert entered == []  # CPU, default flags
    for runner in (engine.pair.target, engine.pair.draft):
        runner.attention_backends = [SDPBackend.MATH]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        deltas = list(engine.generate(Request("r", prompt, params)))
    kernels = {event.name for event in profile.events() if event.name.startswith("aten::_scaled_dot_product")}
    assert kernels == {"aten::_scaled_dot_product_attention_math"}, kernels  # every pass under the step's flags
    assert len(deltas) > 2 and entered == [[SDPBackend.MATH]] * len(deltas)  # once a step, not once a pass
