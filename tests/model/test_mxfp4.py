"""GPT-OSS as OpenAI publishes it: a tiny GPT-OSS written in the hub's MXFP4 layout by the tests' own
quantizer (tests/helpers/mxfp4_checkpoints.py: FP4 e2m1 codes, one power-of-two e8m0 scale per block of 32,
the other tensors in bf16), loaded with its experts dequantized (engine.model.mxfp4).

- the expert weights the engine holds, resident (transformers' loader) and streamed from RAM (the engine's
  own reader, float32 and bfloat16), are exactly transformers' `Mxfp4Config(dequantize=True)` load's and
  the test's own dequantization of its own codes;
- greedy SpecExec output, resident and streamed from RAM, equals transformers' `generate` on that
  dequantized model alone (16 new tokens, the near-tie rule of test_families);
- the disk source is refused before any weights load, in one line, by the load, `serve`'s preflight and
  the plan;
- the plans count the loaded (dequantized) bytes: host_plan's header arithmetic and config_shapes' from
  config.json equal the loaded layers' bytes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, config_shapes, host_plan, pair_plan, preflight
from engine.offload.layout import ALIGN, layer_tensors, layout_of
from engine.offload.loader import load_offloaded_target
from engine.offload.ring import LayerStreamer
from engine.runtime import Engine
from engine.types import ConfigError, Request, SamplingParams
from tests.helpers.mxfp4_checkpoints import expert_weights, write_mxfp4
from tests.helpers.tiny_models import make_tiny_pair

NUM_LAYERS = 3
NEW_TOKENS = 16
TIE_GAP = 1e-4
PROMPT = [5, 17, 42, 9, 77, 130, 64, 3, 200, 31, 8, 99]  # past the sliding window (5)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    target, draft = make_tiny_pair(root, arch="gpt_oss", draft="noisy", seed=7, layers=NUM_LAYERS)
    return {"fp32": target, "draft": draft, "mxfp4": write_mxfp4(target, root / "mxfp4")}


@pytest.fixture(scope="module")
def dequantized(folders) -> torch.nn.Module:
    """transformers' own load of the MXFP4 checkpoint, experts dequantized to float32."""
    return AutoModelForCausalLM.from_pretrained(str(folders["mxfp4"]), dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def offload_config(folders, source: str, **fields) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=str(folders["mxfp4"]), draft=str(folders["draft"])),
                        speculation=SpeculationConfig(budget=16), limits=LimitsConfig(max_context=64),
                        offload=OffloadConfig(enabled=source != "resident", source="ram" if source == "resident" else source,
                                              resident_layers=1, **fields))


def experts_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.layers.{idx}.mlp.experts.{proj}": getattr(layer.mlp.experts, proj)
            for idx, layer in enumerate(model.model.layers) for proj in ("gate_up_proj", "down_proj")}


def test_the_checkpoint_is_in_the_hub_layout(folders):
    config = json.loads((folders["mxfp4"] / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    want = expert_weights(folders["mxfp4"])
    assert len(want) == 2 * NUM_LAYERS
    assert want["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 256)  # [E, hidden, 2 x intermediate]
    assert want["model.layers.0.mlp.experts.down_proj"].shape == (4, 128, 64)  # [E, intermediate, hidden]


def test_the_experts_are_transformers_dequantized_weights(folders, dequantized):
    want = expert_weights(folders["mxfp4"])  # the test's own codes, dequantized by the test
    for name, tensor in experts_of(dequantized).items():
        assert torch.equal(tensor, want[name]), f"transformers: {name}"
    resident = checkpoint.load_model(str(folders["mxfp4"]), torch.float32)
    for name, tensor in experts_of(resident).items():
        assert torch.equal(tensor, want[name]), f"resident: {name}"
    for dtype in (torch.float32, torch.bfloat16):  # every layer but one read into the RAM store
        model, streamer = load_offloaded_target(offload_config(folders, "ram"), dtype, CPU)
        try:
            assert isinstance(streamer, LayerStreamer) and len(streamer.streamed) == NUM_LAYERS - 1
            for name, tensor in experts_of(model).items():
                assert tensor.dtype == dtype and torch.equal(tensor, want[name].to(dtype)), f"RAM store, {dtype}: {name}"
        finally:
            streamer.close()


def reference(model: torch.nn.Module) -> tuple[list[int], torch.Tensor]:
    """transformers' generate on the dequantized target alone: greedy tokens and each step's top-2 logit gap."""
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
    return out.sequences[0, len(PROMPT):].tolist(), top2[:, 0] - top2[:, 1]


@pytest.mark.parametrize("mode", ["resident", "ram"])
def test_greedy_speculation_equals_the_dequantized_model_alone(folders, dequantized, mode):
    want, gaps = reference(dequantized)
    engine = Engine.load(offload_config(folders, mode))
    try:
        assert isinstance(engine.pair.target.layers, LayerStreamer) == (mode != "resident")
        got, passes = [], 0
        for delta in engine.generate(Request("t", PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                         ignore_eos=True))):
            got.extend(delta.token_ids)
            passes = delta.totals.target_passes if delta.totals else passes
    finally:
        engine.close()
    first = next((pos for pos, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None or gaps[first] < TIE_GAP, f"{mode}: {got} != {want} at {first}"
    assert passes < NEW_TOKENS  # the draft was accepted: speculation ran


def test_the_disk_source_is_refused_before_any_weights_load(folders, monkeypatch):
    config = offload_config(folders, "disk")

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr("engine.model.pair.load_offloaded_target", must_not_load)
    monkeypatch.setattr(checkpoint, "load_model", must_not_load)
    for check in (Engine.load, preflight.check_pair, lambda c: pair_plan.plan_pair(c, 24 * 10**9)):
        with pytest.raises(ConfigError) as refused:
            check(config)
        message = str(refused.value)
        assert "\n" not in message and "offload.source" in message and "MXFP4" in message
        assert "--offload-source ram" in message


def test_the_plans_count_the_dequantized_bytes(folders):
    model = checkpoint.load_model(str(folders["mxfp4"]), torch.float32)
    counted = host_plan.checkpoint_bytes(str(folders["mxfp4"]), torch.float32)
    assert counted.layers == tuple(layout_of(layer).nbytes for layer in model.model.layers)
    outer = [model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight]
    assert counted.outer == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in outer)
    assert not counted.disk_streamable
    plain = host_plan.checkpoint_bytes(str(folders["fp32"]), torch.float32)  # the float32 checkpoint it came from
    assert dataclasses.replace(plain, disk_streamable=False) == counted
    config = json.loads((folders["mxfp4"] / "config.json").read_text())
    from_config = config_shapes.weight_bytes(config, 4)
    assert from_config.layers == tuple(sum(t.numel() * t.element_size() for t in layer_tensors(layer).values())
                                       for layer in model.model.layers)
    assert from_config.largest_matrix == 0  # nothing is dequantized per call
