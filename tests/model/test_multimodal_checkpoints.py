"""Gemma 3, Mistral Small 3.x and Ministral 3 as published: multimodal checkpoints (a vision tower and a
projector beside the text decoder) run as their language model, resident and streamed, and equal the
published model's own greedy generate on text; in either tensor layout (`language_model.model.*`, as
transformers writes these models and as the first releases were published, or `model.language_model.*`);
the plans read the text model and leave the vision tower out; the processor's chat template is used."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, Gemma3Config, Mistral3Config

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, config_shapes, host_plan
from engine.runtime import Engine
from engine.types import SamplingParams
from tests.helpers.tiny_models import build_tokenizer, save_checkpoint, tiny_config

PROMPT = [5, 17, 42, 9, 77, 130, 64, 3, 200, 31, 8, 99]
NEW_TOKENS = 12
LAYERS = 3
TEXT_LAYER = {"gemma3": "Gemma3DecoderLayer", "mistral": "MistralDecoderLayer", "ministral3": "Ministral3DecoderLayer"}
PIXTRAL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
               image_size=28, patch_size=14)


def composite(family: str, vocab_size: int, eos: int):
    """A tiny image-text model of `family`'s text decoder, as the hub publishes it: Gemma 3 ties its head to the
    embeddings (small weights, or the tied head repeats the last token), Mistral's do not (spiky weights)."""
    text = tiny_config(family, vocab_size, layers=LAYERS, eos_token_id=eos).to_dict()
    if family == "gemma3":
        text["initializer_range"] = 0.02
        return Gemma3Config(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                                 num_attention_heads=2, image_size=28, patch_size=14),
                            mm_tokens_per_image=4, initializer_range=0.02, tie_word_embeddings=True)
    return Mistral3Config(text_config=text, vision_config=PIXTRAL, spatial_merge_size=1, initializer_range=1.0,
                          tie_word_embeddings=False)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """family -> (checkpoint folder, its own greedy continuation of PROMPT)."""
    cache: dict[str, tuple[Path, list[int]]] = {}

    def get(family: str) -> tuple[Path, list[int]]:
        if family not in cache:
            tokenizer = build_tokenizer()
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_config(composite(family, len(tokenizer), tokenizer.eos_token_id))
            folder = save_checkpoint(model.eval(), tokenizer, tmp_path_factory.mktemp(family) / "model", "100KB")
            with torch.no_grad():
                out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            cache[family] = folder, out[0, len(PROMPT):].tolist()
        return cache[family]

    return get


def relaid(folder: Path, tmp_path: Path) -> Path:
    """The same checkpoint with its tensors under transformers 5's layout (model.language_model.*, lm_head.*)."""
    copy = tmp_path / "relaid"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    renamed = {}
    for name, shard in index["weight_map"].items():
        new = name.replace("language_model.model.", "model.language_model.", 1).replace("language_model.lm_head.", "lm_head.", 1)
        new = new if new.startswith(("model.", "lm_head.")) else "model." + new
        renamed[new] = shard
    for shard in set(index["weight_map"].values()):
        tensors = load_file(copy / shard)
        save_file({new: tensors[old] for old, new in zip(index["weight_map"], renamed, strict=True) if index["weight_map"][old] == shard},
                  copy / shard, metadata={"format": "pt"})
    index["weight_map"] = renamed
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    return copy


def run(folder: Path, mode: str) -> tuple[str, list[int]]:
    offload = OffloadConfig() if mode == "resident" else OffloadConfig(enabled=True, source=mode, resident_layers=1)
    with Engine.load(EngineConfig(model=ModelConfig(target=str(folder), draft=str(folder)),
                                  speculation=SpeculationConfig(budget=8), offload=offload,
                                  limits=LimitsConfig(max_context=64))) as engine:
        layer = type(engine.pair.target.hf_layers[0]).__name__
        got = engine.generate_ids(PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return layer, got


CASES = [("gemma3", "resident"), ("gemma3", "disk"), pytest.param("gemma3", "ram", marks=pytest.mark.slow),
         ("mistral", "resident"), ("mistral", "ram"), ("ministral3", "resident"), ("ministral3", "disk")]


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_a_published_multimodal_checkpoint_runs_as_its_language_model(published, family, mode):
    folder, want = published(family)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"][0].endswith("ForConditionalGeneration")
    names = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    assert any(name.startswith("vision_tower.") for name in names)  # the tower is there, and left unread
    assert any(name.startswith("language_model.model.layers.") for name in names)
    assert len(set(want)) > 1  # a continuation that tells models apart
    layer, got = run(folder, mode)
    assert layer == TEXT_LAYER[family]
    assert got == want


@pytest.mark.parametrize("mode", ["resident", "disk"])
def test_either_tensor_layout(published, tmp_path, mode):
    folder, want = published("gemma3")
    copy = relaid(folder, tmp_path)
    names = set(json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"])
    assert any(name.startswith("model.language_model.layers.") for name in names)
    assert run(copy, mode) == (TEXT_LAYER["gemma3"], want)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_the_plans_read_its_language_model(published, family):
    folder, _ = published(family)
    config, _ = config_shapes.read_model_config(str(folder))
    assert config["architectures"] == [{"gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}[family]]
    shape = config_shapes.shape_from_config(config, 4)
    assert shape.num_layers == LAYERS
    counted = host_plan.checkpoint_bytes(str(folder), torch.float32)
    assert len(counted.layers) == LAYERS and all(counted.layers)  # language_model.model.layers.* are layers
    weights = config_shapes.weight_bytes(config, 4)
    assert counted.outer < 1.05 * weights.outer  # the vision tower and projector are not counted as loaded


def test_the_processors_chat_template_is_used(published, tmp_path):
    folder, _ = published("mistral")
    copy = tmp_path / "with-processor-template"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja",):
        (copy / name).unlink(missing_ok=True)
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert checkpoint.load_tokenizer(str(copy)).chat_template == template
