"""Every family runs exactly: greedy SpecExec output == transformers' generate on the target alone.

Per family: a tiny target built from transformers' config class with the hub's fields (sliding windows
shorter than the sequences here, so they bind), saved as the hub saves checkpoints (sharded safetensors
with an index), and a draft of the same family (the target plus noise); fp32, 16 new tokens after a
prompt past every window, the target resident, streamed from RAM and streamed from disk (every layer
through the ring but one resident). A first difference at a floating-point near-tie (the reference's
top-2 logit gap below TIE_GAP) is reported as a tie. Also: families transformers ships that cannot run
here are refused at load in one line saying why and which families run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import families
from engine.offload.ring import LayerStreamer
from engine.runtime import Engine
from engine.types import CheckpointError, Request, SamplingParams
from tests.helpers.family_configs import FAMILIES
from tests.helpers.tiny_models import make_tiny_pair

NEW_TOKENS = 16
NUM_LAYERS = 3
TIE_GAP = 1e-4
PROMPT = [5, 17, 42, 9, 77, 130, 64, 3, 200, 31, 8, 99]  # 12 tokens: past every window (5)
MODES = ("resident", "ram", "disk")
QUICK_STREAMED = {("gpt_oss", "disk"), ("gemma3", "ram"), ("qwen3_moe", "disk"), ("cohere2", "ram")}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict[str, tuple[str, str]] = {}

    def get(family: str) -> tuple[str, str]:
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            target, draft = make_tiny_pair(folder, arch=family, draft="noisy", seed=7, layers=NUM_LAYERS,
                                           max_shard_size="100KB")
            cache[family] = (str(target), str(draft))
        return cache[family]

    return get


def reference(target: str) -> tuple[list[int], torch.Tensor]:
    """transformers' generate on the target alone: greedy tokens and each step's top-2 logit gap."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
    return out.sequences[0, len(PROMPT):].tolist(), top2[:, 0] - top2[:, 1]


def engine_config(target: str, draft: str, mode: str) -> EngineConfig:
    offload = OffloadConfig() if mode == "resident" else OffloadConfig(enabled=True, source=mode, resident_layers=1)
    return EngineConfig(model=ModelConfig(target=target, draft=draft), speculation=SpeculationConfig(budget=16),
                        offload=offload, limits=LimitsConfig(max_context=64))


CASES = [pytest.param(family, mode, marks=() if mode == "resident" or (family, mode) in QUICK_STREAMED else pytest.mark.slow)
         for family in FAMILIES for mode in MODES]


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_greedy_speculation_equals_transformers_generate(pairs, family, mode):
    target, draft = pairs(family)
    assert len(list(Path(target).glob("*.safetensors"))) > 1 and (Path(target) / "model.safetensors.index.json").is_file()
    want, gaps = reference(target)
    engine = Engine.load(engine_config(target, draft, mode))
    try:
        assert isinstance(engine.pair.target.layers, LayerStreamer) == (mode != "resident")
        got = []
        passes = 0
        for delta in engine.generate(Request("t", PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                         ignore_eos=True))):
            got.extend(delta.token_ids)
            if delta.totals:
                passes = delta.totals.target_passes
    finally:
        engine.close()
    first = next((pos for pos, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    print(f"{family} {mode}: {NEW_TOKENS} tokens in {passes} target passes, first difference {first}")
    assert first is None or gaps[first] < TIE_GAP, f"{family} {mode}: {got} != {want} at {first}"
    assert passes < NEW_TOKENS  # the draft (the target plus noise) was accepted: speculation ran


REFUSED = [
    ("JambaForCausalLM", "linear-attention hybrid"),
    ("FalconH1ForCausalLM", "linear-attention hybrid"),
    ("DeepseekV3ForCausalLM", "multi-head latent attention"),
    ("LlavaForConditionalGeneration", "multimodal checkpoint"),
    ("BertForMaskedLM", "not supported"),
]


@pytest.mark.parametrize(("architecture", "why"), REFUSED)
def test_a_family_that_cannot_run_is_refused_at_load_in_one_line(tmp_path, architecture, why):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "x"}))
    with pytest.raises(CheckpointError) as refused:
        Engine.load(EngineConfig(model=ModelConfig(target=str(tmp_path)), speculation=SpeculationConfig(method="autoregressive")))
    message = str(refused.value)
    assert "\n" not in message and architecture in message and why in message
    assert all(family.name in message for family in families.FAMILIES)
