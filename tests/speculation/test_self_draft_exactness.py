"""With `--draft self` the output is the target's alone: greedy token for token against transformers'
generate on the target, alone and batched, resident and streamed from RAM and disk, with overlap off
and on. With overlap on, every target layer is slowed (inside its pass, with the engine's attention
named on the target's config) so the draft's passes start and end in the middle of the target's:
a draft that shared the target's config object would switch the target's attention off mid-pass.
Every dense family, streamed with one layer shared and one copied. Sampled output with the self-draft follows the target's distribution: test_engine_sampling_exactness."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.family_configs import FAMILIES
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [90, 12]]
LENGTHS = [30, 18, 40]
MODES = {"resident": None, "ram": {"source": "ram", "resident_layers": 1}, "disk": {"source": "disk", "resident_layers": 0}}
LAYER_SECONDS = 0.004  # overlap: each target layer's share of a slow (streamed-like) pass


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(make_tiny_pair(tmp_path_factory.mktemp("self"), arch="llama", seed=11, layers=3)[0])


@pytest.fixture(scope="module")
def references(target) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    return [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]


def load(target: str, mode: str, overlap: bool, budget: int = 32) -> Engine:
    offload = MODES[mode]
    return Engine.load(EngineConfig(
        model=ModelConfig(target=target, draft="self"),
        speculation=SpeculationConfig(budget=budget, max_depth=8, overlap=overlap),
        offload=OffloadConfig(enabled=True, **offload) if offload else OffloadConfig(),
        limits=LimitsConfig(max_context=256),
    ))


def slow_layers(engine: Engine, monkeypatch) -> None:
    """Every target layer takes LAYER_SECONDS more, inside the pass."""
    runner = engine.pair.target
    run_layer = runner._run_layer

    def slow(*args, **kwargs):
        time.sleep(LAYER_SECONDS)
        return run_layer(*args, **kwargs)

    monkeypatch.setattr(runner, "_run_layer", slow)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_together(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.num_running:
        step = engine.step()
        assert not step.failures
        for delta in step.deltas:
            out[delta.request_id] += delta.token_ids
    return out


CASES = [pytest.param(mode, overlap, id=f"{mode}-overlap-{'on' if overlap else 'off'}",
                      marks=() if mode == "resident" else pytest.mark.slow)
         for mode in MODES for overlap in (False, True)]


@pytest.mark.parametrize(("mode", "overlap"), CASES)
def test_greedy_with_the_self_draft_equals_the_target_alone(target, references, mode, overlap, monkeypatch):
    engine = load(target, mode, overlap)
    try:
        if overlap:
            slow_layers(engine, monkeypatch)
        passes = []
        alone = []
        for prompt, length in zip(PROMPTS, LENGTHS, strict=True):
            deltas = list(engine.generate(Request("r", prompt, greedy(length))))
            alone.append([t for d in deltas for t in d.token_ids])
            passes.append(len(deltas))
        together = run_together(engine, [Request(f"r{i}", p, greedy(n))
                                         for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))])
        assert alone == references
        assert [together[f"r{i}"] for i in range(len(PROMPTS))] == references
        assert sum(passes) < sum(LENGTHS)  # drafts were accepted (a random tiny model's 4-bit copy agrees less
        # than a trained one's: docs/bench/self-draft.md)
    finally:
        engine.close()


MOE = ("mixtral", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text", "glm4_moe")  # experts in fused tensors: refused
# (tests/model/test_self_draft.py)


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in MOE])
def test_every_dense_family_with_the_self_draft_equals_the_target_alone(tmp_path, family, monkeypatch):
    """Streamed from RAM with one layer resident (shared) and the other copied, overlap on."""
    folder = make_tiny_pair(tmp_path, arch=family, seed=5, layers=2)[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = [reference_greedy(model, prompt, 16) for prompt in PROMPTS[:2]]
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(folder), draft="self"),
        speculation=SpeculationConfig(budget=16, max_depth=6, overlap=True),
        offload=OffloadConfig(enabled=True, resident_layers=1),
        limits=LimitsConfig(max_context=128),
    ))
    try:
        slow_layers(engine, monkeypatch)
        assert [engine.generate_ids(prompt, greedy(16)) for prompt in PROMPTS[:2]] == want
    finally:
        engine.close()
