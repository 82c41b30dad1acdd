"""AWQ (GEMM) and compressed-tensors pack-quantized W4A16 checkpoints (symmetric and asymmetric, group
128), written in each format's real on-disk layout by tests/helpers/int4_checkpoints.py, loaded with no
quantization library (engine.model.int4_checkpoint).

- dequantize kernel (the file's own packed tensors; what a target streamed from disk runs): its
  weights are those the test dequantized itself, and greedy SpecExec output, resident and streamed
  from RAM and disk, equals a plain greedy loop over transformers' model holding those weights;
- int4 kernel (converted at load, streamed packed from RAM): its weights are the same to bf16
  rounding, and greedy SpecExec output equals the same int4 model alone; streamed logits equal
  resident ones;
- the plans' arithmetic from config.json gives the loaded bytes of both forms.
transformers itself cannot load these here (AWQ needs gptqmodel, compressed-tensors its own package;
neither is installed), hence the test's own dequantization; where compressed-tensors is installed its
own decompression (and transformers' loading of the symmetric scheme) is compared too: run on this
machine with compressed-tensors 0.20.0 put on PYTHONPATH, it agreed for both schemes.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, config_shapes, int4_formats
from engine.model.gptq_int4 import Int4Linear
from engine.model.int4_checkpoint import FilePackedLinear
from engine.model.runner import DecoderRunner
from engine.offload.layout import layer_tensors, layout_of
from engine.runtime import Engine
from engine.types import CheckpointError, SamplingParams
from tests.helpers.int4_checkpoints import (
    dense_weights,
    dequantized_model,
    unpacked,
    write_awq,
    write_compressed,
)
from tests.helpers.offload_passes import assert_same_logits, reference_greedy, run_passes, streamed_runner
from tests.helpers.tiny_models import make_tiny_pair

NUM_LAYERS = 3
FORMATS = ["awq", "ct-sym", "ct-asym"]
PROMPT = [5, 17, 42, 9, 77, 130, 64]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    target, draft = make_tiny_pair(root, arch="llama", draft="noisy", seed=3, layers=NUM_LAYERS, hidden=128)
    return {"fp32": target, "draft": draft, "awq": write_awq(target, root / "awq"),
            "ct-sym": write_compressed(target, root / "ct-sym", symmetric=True),
            "ct-asym": write_compressed(target, root / "ct-asym", symmetric=False)}


def engine_greedy(target: Path, draft: Path, kernel: str, offload: str | None) -> tuple[list[int], Engine]:
    config = EngineConfig(
        model=ModelConfig(target=str(target), draft=str(draft), gptq_kernel=kernel),
        speculation=SpeculationConfig(budget=16),
        offload=OffloadConfig(enabled=offload is not None, source=offload or "ram", resident_layers=1),
    )
    engine = Engine.load(config)
    try:
        return engine.generate_ids(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)), engine
    finally:
        engine.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_formats_are_recognised(checkpoints, fmt) -> None:
    config = json.loads((checkpoints[fmt] / "config.json").read_text())
    found = int4_formats.format_of(config)
    assert found is not None and found.group_size == 128
    assert found.method == ("awq" if fmt == "awq" else "compressed-tensors")
    assert found.symmetric == (fmt == "ct-sym")
    checkpoint.read_config(str(checkpoints[fmt]))  # no extra needed


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_weights_are_the_tests_own(checkpoints, fmt) -> None:
    model = checkpoint.load_model(str(checkpoints[fmt]), torch.float32, gptq_kernel="dequantize")
    want = dense_weights(checkpoints[fmt])
    maps = {name: m for name, m in model.named_modules() if isinstance(m, FilePackedLinear)}
    assert len(maps) == 7 * NUM_LAYERS
    for name, module in maps.items():
        assert torch.equal(module.weight_now(torch.float32), want[f"{name}.weight"]), name
    layout = layout_of(model.model.layers[0])
    names = {entry.name.rsplit(".", 1)[-1] for entry in layout.entries}
    assert names == ({"qweight", "qzeros", "scales", "weight"} if fmt == "awq" else
                     {"weight_packed", "weight_scale", "weight"} | ({"weight_zero_point"} if fmt == "ct-asym" else set()))


@pytest.mark.parametrize("offload", [None, "ram", "disk"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_on_the_dequantize_kernel_equals_the_dequantized_model(checkpoints, fmt, offload) -> None:
    """Resident, streamed from RAM, streamed from the files on disk (their own packing, read as stored)."""
    want = reference_greedy(dequantized_model(checkpoints[fmt], checkpoints["fp32"]), PROMPT, 24)
    kernel = "auto" if offload == "disk" else "dequantize"  # auto: dequantize for a target streamed from disk
    got, engine = engine_greedy(checkpoints[fmt], checkpoints["draft"], kernel, offload)
    assert isinstance(engine.pair.target.hf_layers[0].mlp.down_proj, FilePackedLinear)
    assert got == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_int4_weights_are_the_dequantized_weights(checkpoints, fmt) -> None:
    """The kernel computes (q - 8) x scale + scale x (8 - zero) with both terms in bf16: each weight is
    the test's own within bf16 rounding of the terms, 2^-8 of |w| + 16 |scale|."""
    model = checkpoint.load_model(str(checkpoints[fmt]), torch.float32, gptq_kernel="int4")
    want = dense_weights(checkpoints[fmt])
    scales = {name: s.repeat_interleave(128, 1) for name, (_, _, s) in unpacked(checkpoints[fmt])[0].items()}
    maps = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(maps) == 7 * NUM_LAYERS
    for name, module in maps.items():
        got = module(torch.eye(module.in_features)).T  # [out, in]: the weight
        weight = want[f"{name}.weight"]
        assert bool(((got - weight).abs() <= 2**-8 * (weight.abs() + 16 * scales[name].abs())).all()), name
    layout = layout_of(model.model.layers[0])
    assert {entry.name.rsplit(".", 1)[-1] for entry in layout.entries} == {"packed", "scales_and_zeros", "weight"}
    fp32 = layout_of(checkpoint.load_model(str(checkpoints["fp32"]), torch.float32).model.layers[0])
    assert layout.nbytes * 4 < fp32.nbytes  # what the planner and the ring count: packed bytes


@pytest.mark.parametrize("offload", [None, "ram"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_on_the_int4_kernel_equals_the_target_alone(checkpoints, fmt, offload) -> None:
    """auto is int4 on this CPU; the reference is the same int4 model alone (transformers' generate)."""
    alone = checkpoint.load_model(str(checkpoints[fmt]), torch.float32, gptq_kernel="int4")
    want = reference_greedy(alone, PROMPT, 24)
    got, engine = engine_greedy(checkpoints[fmt], checkpoints["draft"], "auto", offload)
    assert isinstance(engine.pair.target.hf_layers[0].mlp.down_proj, Int4Linear)
    assert got == want


@pytest.mark.parametrize(("fmt", "kernel", "source"), [
    ("awq", "int4", "ram"), ("ct-asym", "int4", "ram"), ("awq", "dequantize", "disk"),
    ("ct-sym", "dequantize", "disk"), ("ct-asym", "dequantize", "disk")])
def test_streamed_logits_equal_resident(checkpoints, fmt, kernel, source) -> None:
    target = str(checkpoints[fmt])
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32, gptq_kernel=kernel)))
    runner = streamed_runner(target, source=source, resident_layers=1, ring_size=2, kernel=kernel)
    try:
        assert len(runner.layers.streamed) == NUM_LAYERS - 1
        for _ in range(2):  # the second time, the ring has wrapped into the next passes
            assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


@pytest.mark.parametrize("kernel", ["int4", "dequantize"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_plan_counts_the_loaded_bytes(checkpoints, fmt, kernel) -> None:
    from engine.model import memory

    runner = DecoderRunner(checkpoint.load_model(str(checkpoints[fmt]), torch.float32, gptq_kernel=kernel))
    config = json.loads((checkpoints[fmt] / "config.json").read_text())
    counted = config_shapes.weight_bytes(config, 4, kernel)
    layer = layer_tensors(runner.hf_layers[0]).values()
    assert counted.layer == sum(t.numel() * t.element_size() for t in layer)
    scratch = memory.dequant_scratch_bytes(runner)
    assert scratch == (counted.largest_matrix * config_shapes.DEQUANT_BYTES_PER_WEIGHT if kernel == "dequantize" else 0)


def test_a_4bit_draft(checkpoints) -> None:
    """An AWQ draft beside the fp32 target: the output is the target's."""
    want = reference_greedy(checkpoint.load_model(str(checkpoints["fp32"]), torch.float32), PROMPT, 24)
    got, _ = engine_greedy(checkpoints["fp32"], checkpoints["awq"], "auto", None)
    assert got == want


def as_multimodal_release(folder: Path, out: Path) -> Path:
    """The 4-bit checkpoint in `folder` as a multimodal release of its model: config under text_config of a
    Mistral3ForConditionalGeneration, tensors under language_model.model.* / language_model.lm_head.*, and a
    (quantized-looking) vision tower beside them that must stay unread."""
    shutil.copytree(folder, out)
    text = json.loads((folder / "config.json").read_text())
    quant = text.pop("quantization_config")
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
              "vision_config": {"model_type": "pixtral"}, "quantization_config": quant, "dtype": text["dtype"]}
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(out / "model.safetensors"))
    renamed = {("language_model." + name if name.startswith(("model.", "lm_head.")) else name): value
               for name, value in state.items()}
    marker = next(name for name in state if name.endswith((".qweight", ".weight_packed")))
    renamed["vision_tower.transformer.layers.0.attention.q_proj." + marker.rpartition(".")[2]] = state[marker].clone()
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("fmt", "kernel", "offload"), [("awq", "dequantize", None), ("ct-asym", "int4", "ram")])
def test_a_multimodal_release_runs_as_its_language_model(checkpoints, tmp_path, fmt, kernel, offload) -> None:
    """Gemma 3, Mistral Small 3.x and Qwen3.5 4-bit releases keep the language model under a prefix. The
    reference: the test's own dequantized model, or (int4's arithmetic) the text-only checkpoint alone."""
    if kernel == "dequantize":
        want = reference_greedy(dequantized_model(checkpoints[fmt], checkpoints["fp32"]), PROMPT, 24)
    else:
        want = reference_greedy(checkpoint.load_model(str(checkpoints[fmt]), torch.float32, gptq_kernel="int4"), PROMPT, 24)
    release = as_multimodal_release(checkpoints[fmt], tmp_path / "release")
    got, _ = engine_greedy(release, checkpoints["draft"], kernel, offload)
    assert got == want


@pytest.mark.parametrize(("change", "message"), [
    ({"version": "gemv"}, "only 4-bit GEMM checkpoints with zero points"),
    ({"bits": 8}, "only 4-bit GEMM checkpoints"),
])
def test_unsupported_awq_variants_are_refused(tmp_path, change, message) -> None:
    config = {"architectures": ["LlamaForCausalLM"],
              "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", **change}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.read_config(str(tmp_path))


def test_unsupported_compressed_tensors_schemes_are_refused(checkpoints, tmp_path) -> None:
    config = json.loads((checkpoints["ct-sym"] / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantized activations are not supported"):
        checkpoint.read_config(str(tmp_path))
    config["quantization_config"]["format"] = "float-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="only pack-quantized 4-bit integer weights in groups"):
        checkpoint.read_config(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                    reason="compressed-tensors is not installed (transformers needs it to load these checkpoints)")
@pytest.mark.parametrize("fmt", ["ct-sym", "ct-asym"])
def test_compressed_tensors_own_reading_agrees(checkpoints, fmt) -> None:
    """compressed-tensors (0.20's PackedQuantizationCompressor) decompresses every map to the weights the
    test dequantized; transformers' own loading does too for the symmetric scheme (transformers 5.24 with
    compressed-tensors 0.20 declares asymmetric zero points unpacked in its meta pass and reinitialises
    the packed ones it reads, so asymmetric checkpoints are compared through the library alone)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    quant = json.loads((checkpoints[fmt] / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(targets=["Linear"], weights=quant["config_groups"]["group_0"]["weights"])
    state = load_file(str(checkpoints[fmt] / "model.safetensors"))
    want = dense_weights(checkpoints[fmt])
    prefixes = [name.removesuffix(".weight_packed") for name in state if name.endswith(".weight_packed")]
    for prefix in prefixes:
        tensors = {name.rsplit(".", 1)[1]: value for name, value in state.items() if name.startswith(prefix + ".")}
        got = PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]
        assert torch.allclose(got.float(), want[f"{prefix}.weight"], rtol=2**-7, atol=1e-6), prefix
    if fmt == "ct-sym":
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        model = AutoModelForCausalLM.from_pretrained(checkpoints[fmt], dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(run_compressed=False))
        loaded = model.state_dict()
        for prefix in prefixes:
            assert torch.allclose(loaded[f"{prefix}.weight"].float(), want[f"{prefix}.weight"], rtol=2**-7, atol=1e-6)
