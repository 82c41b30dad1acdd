"""Qwen3.5 as published: a multimodal checkpoint (Qwen3_5ForConditionalGeneration, its language model under
model.language_model.*, a vision tower beside it) runs as its language model, resident and streamed, and
equals the published model's own greedy generate on text; the plans read its text_config and leave the
vision tower out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import config_shapes, host_plan
from engine.runtime import Engine
from engine.types import SamplingParams
from tests.helpers.tiny_models import build_tokenizer, save_checkpoint, tiny_config

PROMPT = [5, 17, 42, 9, 77, 130, 64, 3, 200, 31, 8, 99]
NEW_TOKENS = 12
LAYERS = 4


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, list[int]]:
    """A tiny multimodal Qwen3.5 checkpoint (sharded, as the hub's) and its own greedy continuation."""
    tokenizer = build_tokenizer()
    text = tiny_config("qwen3_5_text", len(tokenizer), layers=LAYERS, eos_token_id=tokenizer.eos_token_id)
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                          num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    folder = save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("qwen3_5-published") / "model", "100KB")
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return folder, out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("mode", ["resident", "disk", pytest.param("ram", marks=pytest.mark.slow)])
def test_a_published_qwen3_5_checkpoint_runs_as_its_language_model(published, mode):
    folder, want = published
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    offload = OffloadConfig() if mode == "resident" else OffloadConfig(enabled=True, source=mode, resident_layers=1)
    with Engine.load(EngineConfig(model=ModelConfig(target=str(folder), draft=str(folder)),
                                  speculation=SpeculationConfig(budget=8), offload=offload,
                                  limits=LimitsConfig(max_context=64))) as engine:
        assert type(engine.pair.target.hf_layers[0]).__name__ == "Qwen3_5DecoderLayer"
        got = engine.generate_ids(PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert got == want


def test_the_plans_read_its_language_model(published):
    folder, _ = published
    config, _ = config_shapes.read_model_config(str(folder))
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    shape = config_shapes.shape_from_config(config, 4)
    assert (shape.num_layers, shape.num_linear_layers) == (LAYERS, LAYERS - 1)
    counted = host_plan.checkpoint_bytes(str(folder), torch.float32)
    assert len(counted.layers) == LAYERS and all(counted.layers)  # model.language_model.layers.* are layers
    weights = config_shapes.weight_bytes(config, 4)
    assert counted.outer < 1.05 * weights.outer  # the vision tower is not counted as loaded
