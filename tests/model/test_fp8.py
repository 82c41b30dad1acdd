"""FP8 checkpoints (quant_method fp8), block-wise (Qwen3-*-FP8's layout) and per tensor (Mistral's FP8 releases),
written by tests/helpers/fp8_checkpoints.py with the test's own quantizer, loaded with no quantization library
(engine.model.fp8_checkpoint):

- a tiny Llama (hidden 128: blocks whole, k/v projections of 64 rows a partial block) and a tiny Qwen3 (hidden
  192: partial blocks along both dimensions, its lm_head quantized too, dequantized at load);
- per tensor ("llama-pt", "ministral3-pt"): one float32 weight_scale_inv per projection (shape [] and [1])
  and a static activation scale beside it (activation_scale, input_scale) that loads as nothing; the
  Ministral 3 one also as a Mistral3ForConditionalGeneration release (language_model.model.*);
- the loaded weights equal, bit for bit in float32, those the test dequantized itself from the files, and what
  transformers' own FP8 dequantization (Fp8Dequantize, what FineGrainedFP8Config(dequantize=True) runs) makes
  of the whole blocks;
- greedy SpecExec output, resident and streamed from RAM and from disk (the files' own FP8 bytes), equals
  transformers' generate over a plain model holding the test's weights (16 new tokens; a first difference
  at a near-tie, top-2 gap below TIE_GAP, is reported as a tie, as tests/model/test_families.py does);
- the plans count the loaded layer bytes (1 byte a weight plus float32 scales) and the dequantization scratch.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, config_shapes, fp8, host_plan, memory
from engine.model.runner import DecoderRunner
from engine.offload.layout import ALIGN, layer_tensors, layout_of
from engine.offload.ring import LayerStreamer
from engine.runtime import Engine
from engine.types import CheckpointError, Request, SamplingParams
from tests.helpers.fp8_checkpoints import (
    as_mistral3_release,
    dense_weights,
    dequantized_model,
    quantize,
    write_fp8,
)
from tests.helpers.offload_passes import assert_same_logits, run_passes, streamed_runner
from tests.helpers.tiny_models import make_tiny_pair

NUM_LAYERS = 3
NEW_TOKENS = 16
TIE_GAP = 1e-4
PROMPT = [5, 17, 42, 9, 77, 130, 64, 3, 200, 31, 8, 99]
MODELS = {"llama": 128, "qwen3": 192}  # hidden sizes: a multiple of 128, and one that is not
# per-tensor checkpoints: family, hidden size, the scales' shape and the activation scale's name
PER_TENSOR = {"llama-pt": ("llama", 128, (), "activation_scale"), "ministral3-pt": ("ministral3", 96, (1,), "input_scale")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for arch, hidden in MODELS.items():
        target, draft = make_tiny_pair(root / arch, arch=arch, draft="noisy", seed=3, layers=NUM_LAYERS, hidden=hidden)
        out[arch] = {"fp32": target, "draft": draft, "fp8": write_fp8(target, root / arch / "fp8", arch == "qwen3")}
    for name, (arch, hidden, shape, activation) in PER_TENSOR.items():
        target, draft = make_tiny_pair(root / name, arch=arch, draft="noisy", seed=5, layers=NUM_LAYERS, hidden=hidden)
        out[name] = {"fp32": target, "draft": draft,
                     "fp8": write_fp8(target, root / name / "fp8", per_tensor=(shape, activation))}
    return out


def fp8_maps(model: torch.nn.Module) -> dict[str, fp8.Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}


@pytest.mark.parametrize("arch", MODELS)
def test_loaded_weights_are_the_tests_own(checkpoints, arch) -> None:
    folder = checkpoints[arch]["fp8"]
    model = checkpoint.load_model(str(folder), torch.float32)
    want = dense_weights(folder)
    maps = fp8_maps(model)
    assert len(maps) == 7 * NUM_LAYERS
    for name, module in maps.items():
        assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale_inv.dtype == torch.float32
        assert torch.equal(module.weight_now(torch.float32), want[f"{name}.weight"]), name
    assert not torch.isnan(want["model.layers.0.mlp.down_proj.weight"]).any()
    assert type(model.lm_head) is torch.nn.Linear and torch.equal(model.lm_head.weight, want["lm_head.weight"])
    layout = layout_of(model.model.layers[0])
    assert {entry.name.rsplit(".", 1)[-1] for entry in layout.entries} >= {"weight", "weight_scale_inv"}
    fp32 = layout_of(checkpoint.load_model(str(checkpoints[arch]["fp32"]), torch.float32).model.layers[0])
    assert layout.nbytes * 3 < fp32.nbytes  # what the ring copies: 1 byte a weight, not 4 (bf16's 2: half)


def test_transformers_own_dequantization_agrees(checkpoints) -> None:
    """transformers 5.24's Fp8Dequantize (FineGrainedFP8Config(dequantize=True) runs it as it loads) on each map
    of whole blocks (or one block); it derives the block from the scale grid, so a partial block elsewhere
    (Qwen3's 192 columns in two scale columns) would be read as blocks of 96: those maps are left out."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    model = checkpoint.load_model(str(checkpoints["llama"]["fp8"]), torch.float32)
    compared = 0
    for name, module in fp8_maps(model).items():
        n, k = module.weight.shape
        if all(size % 128 == 0 or size < 128 for size in (n, k)):
            theirs = Fp8Dequantize(None)._dequantize_one(module.weight, module.weight_scale_inv, torch.float32)
            assert torch.equal(theirs, module.weight_now(torch.float32)), name
            compared += 1
    assert compared == 7 * NUM_LAYERS


@pytest.mark.parametrize("arch", PER_TENSOR)
def test_per_tensor_weights_are_the_tests_own_and_transformers(checkpoints, arch) -> None:
    """One scale per tensor multiplies (transformers' _dequantize_fp8_weight: weight.mul_(scale)); the
    activation scales are in the files but in no module."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    folder = checkpoints[arch]["fp8"]
    model = checkpoint.load_model(str(folder), torch.float32)
    want = dense_weights(folder)
    maps = fp8_maps(model)
    assert len(maps) == 7 * NUM_LAYERS
    for name, module in maps.items():
        assert module.fmt.block is None and tuple(module.weight_scale_inv.shape) == PER_TENSOR[arch][2]
        assert torch.equal(module.weight_now(torch.float32), want[f"{name}.weight"]), name
        theirs = Fp8Dequantize(None)._dequantize_one(module.weight, module.weight_scale_inv, torch.float32)
        assert torch.equal(theirs, want[f"{name}.weight"]), name
        assert torch.equal(module.weight_now(torch.bfloat16), want[f"{name}.weight"].bfloat16()), name  # rounded once
    assert not any(name.endswith(("activation_scale", "input_scale")) for name, _ in model.named_buffers())
    assert type(model.lm_head) is torch.nn.Linear and torch.equal(model.lm_head.weight, want["lm_head.weight"])


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="accelerate is not installed (transformers' FP8 loading requires it)")
def test_transformers_loads_the_llama_checkpoint_to_the_same_weights(checkpoints) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    folder = checkpoints["llama"]["fp8"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True))
    loaded = model.state_dict()
    for name, value in dense_weights(folder).items():
        assert torch.equal(loaded[name].float(), value), name


def test_dequantize_across_row_chunks_and_partial_blocks() -> None:
    """More rows than one float32 chunk, partial blocks along both dimensions; bf16 is the float32 product
    rounded once."""
    weight = torch.randn(fp8.DEQUANT_CHUNK_ROWS + 64, 200, generator=torch.Generator().manual_seed(0))
    values, scale = quantize(weight)
    fmt = fp8.Fp8Format((128, 128))
    want = values.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: weight.shape[0], :200]
    assert torch.equal(fp8.dequantize(values, scale, fmt, torch.float32), want)
    assert torch.equal(fp8.dequantize(values, scale, fmt, torch.bfloat16), want.bfloat16())


def reference(folder: Path, fp32: Path) -> tuple[list[int], torch.Tensor]:
    """transformers' generate over the test's dequantized model: greedy tokens and each step's top-2 gap."""
    model = dequantized_model(folder, fp32)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
    return out.sequences[0, len(PROMPT):].tolist(), top2[:, 0] - top2[:, 1]


@pytest.mark.parametrize("mode", ["resident", "ram", "disk"])
@pytest.mark.parametrize("arch", [*MODELS, *PER_TENSOR, "ministral3-pt-release"])
def test_greedy_speculation_equals_the_dequantized_model(checkpoints, tmp_path, arch, mode) -> None:
    paths = checkpoints[arch.removesuffix("-release")]
    want, gaps = reference(paths["fp8"], paths["fp32"])
    target = paths["fp8"] if not arch.endswith("-release") else as_mistral3_release(paths["fp8"], tmp_path / "release")
    offload = OffloadConfig() if mode == "resident" else OffloadConfig(enabled=True, source=mode, resident_layers=1)
    engine = Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(paths["draft"])),
                                      speculation=SpeculationConfig(budget=16), offload=offload,
                                      limits=LimitsConfig(max_context=64)))
    try:
        target = engine.pair.target
        assert isinstance(target.layers, LayerStreamer) == (mode != "resident")
        assert isinstance(target.hf_layers[0].mlp.down_proj, fp8.Fp8Linear)
        got, passes = [], 0
        for delta in engine.generate(Request("t", PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                         ignore_eos=True))):
            got.extend(delta.token_ids)
            passes = delta.totals.target_passes if delta.totals else passes
    finally:
        engine.close()
    first = next((pos for pos, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None or gaps[first] < TIE_GAP, f"{arch} {mode}: {got} != {want} at {first}"
    assert passes < NEW_TOKENS  # speculation ran


@pytest.mark.parametrize("source", ["ram", "disk"])
def test_streamed_logits_equal_resident(checkpoints, source) -> None:
    """Qwen3's partial blocks through the ring, the disk source reading the files' FP8 bytes as stored."""
    target = str(checkpoints["qwen3"]["fp8"])
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    runner = streamed_runner(target, source=source, resident_layers=1, ring_size=2)
    try:
        assert len(runner.layers.streamed) == NUM_LAYERS - 1
        for _ in range(2):  # the second time, the ring has wrapped into the next passes
            assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", [*MODELS, *PER_TENSOR, "ministral3-pt-release"])
def test_the_plans_count_the_loaded_bytes(checkpoints, tmp_path, arch, dtype) -> None:
    folder = checkpoints[arch.removesuffix("-release")]["fp8"]
    if arch.endswith("-release"):
        folder = as_mistral3_release(folder, tmp_path / "release")
    runner = DecoderRunner(checkpoint.load_model(str(folder), dtype))
    config = json.loads((folder / "config.json").read_text())
    if arch.endswith("-release"):
        config = {**config["text_config"], "quantization_config": config["quantization_config"]}
    counted = config_shapes.weight_bytes(config, dtype.itemsize)
    loaded = [sum(t.numel() * t.element_size() for t in layer_tensors(layer).values()) for layer in runner.hf_layers]
    assert list(counted.layers) == loaded
    outer = sum(t.numel() * t.element_size() for m in (runner.embed_tokens, runner.norm, runner.lm_head)
                for t in m.parameters())
    assert counted.outer == outer
    assert counted.dequant_scratch == memory.dequant_scratch_bytes(runner) > 0
    host = host_plan.checkpoint_bytes(str(folder), dtype)  # from the safetensors headers, each tensor ALIGN-rounded
    assert list(host.layers) == [sum(-(-t.nbytes // ALIGN) * ALIGN for t in layer_tensors(layer).values())
                                 for layer in runner.hf_layers]
    assert host.outer == sum(-(-t.nbytes // ALIGN) * ALIGN for t in (runner.embed_tokens.weight, runner.norm.weight,
                                                                    runner.lm_head.weight))


@pytest.mark.parametrize(("change", "message"), [
    ({"weight_block_size": [128]}, "only block-wise FP8"),
    ({"fmt": "e5m2"}, "only e4m3 weights"),
    ({"scale_fmt": "ue8m0"}, "float32 scales"),
    ({"modules_to_convert": ["model.embed_tokens"]}, "FP8 embeddings"),
])
def test_unsupported_fp8_variants_are_refused(checkpoints, tmp_path, change, message) -> None:
    config = json.loads((checkpoints["llama"]["fp8"] / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as refused:
        checkpoint.read_config(str(tmp_path))
    assert "\n" not in str(refused.value)


def test_fp8_moe_and_compressed_tensors_fp8_are_refused(tmp_path) -> None:
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                                                      "quantization_config": quant}))
    with pytest.raises(CheckpointError, match="FP8 MoE checkpoints"):
        checkpoint.read_config(str(tmp_path))
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": quant}))
    with pytest.raises(CheckpointError, match="float-quantized' \\(FP8 W8A8\\) is not supported"):
        checkpoint.read_config(str(tmp_path))


def test_per_output_channel_scales_are_refused(checkpoints, tmp_path) -> None:
    """A [N, 1] scale (one per output row) under weight_block_size null: not transformers' per-tensor layout."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "per-channel"
    shutil.copytree(checkpoints["llama-pt"]["fp8"], folder)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    state[name] = state[name].reshape(1, 1).expand(state[name.replace("_scale_inv", "")].shape[0], 1).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="one scale per tensor") as refused:
        checkpoint.load_model(str(folder), torch.float32)
    assert "\n" not in str(refused.value)
