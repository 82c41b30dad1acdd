"""GPTQ targets: a tiny Llama quantized to 4 bits on CPU with gptqmodel, saved and reloaded.

Streamed layers move in packed form (qweight, qzeros, scales, g_idx), from RAM or from the
checkpoint on disk, and give the resident quantized logits; greedy SpecExec with the quantized target equals the quantized target
alone. Skipped, with the pip command, when the `gptq` extra is absent (failed instead under
SPECEXEC_REQUIRE_GPTQ=1, as scripts/test-gptq.sh runs them); the error tests always run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.quant import quantize_gptq
from engine.config import EngineConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, gptq, gptq_int4
from engine.model.runner import DecoderRunner
from engine.offload.build import build_offloaded_runner
from engine.offload.layout import layer_tensors, layout_of
from engine.runtime import Engine
from engine.types import CheckpointError, ConfigError, OffloadError, SamplingParams
from tests.helpers.gptq_extra import missing_gptq
from tests.helpers.offload_passes import assert_same_logits, reference_greedy, run_passes, streamed_runner
from tests.helpers.tiny_models import make_tiny_pair

NUM_LAYERS = 4
MISSING = missing_gptq()  # fails collection under SPECEXEC_REQUIRE_GPTQ=1 when the extra is absent
needs_gptq = pytest.mark.skipif(
    bool(MISSING), reason=f"the gptq extra is not installed ({', '.join(MISSING)} missing): {gptq.GPTQ_PIP}"
)


def quantize_tiny_llama(folder: Path, desc_act: bool) -> tuple[str, str, str]:
    """(GPTQ 4-bit, group 32, of a tiny Llama, quantized the way `specexec bench quant` does; the fp32
    original; an fp32 noisy copy of it for a draft)."""
    target, draft = make_tiny_pair(folder, arch="llama", draft="noisy", seed=3, layers=NUM_LAYERS)
    quantized = quantize_gptq(Path(target), folder / "target-gptq", group_size=32, seed=0, desc_act=desc_act)
    return str(quantized), str(target), str(draft)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "act-order"])
def gptq_pair(request, tmp_path_factory) -> tuple[str, str, str]:
    """Without and with act-order (desc_act: g_idx permutes the groups, as in TheBloke's
    Llama-2-70B-chat-GPTQ main branch, the shipped GPTQ config)."""
    if MISSING:
        pytest.skip(f"the gptq extra is not installed: {gptq.GPTQ_PIP}")
    return quantize_tiny_llama(tmp_path_factory.mktemp("gptq"), desc_act=request.param)


@needs_gptq
def test_layers_are_packed_and_stateless(gptq_pair, monkeypatch):
    target, original, _ = gptq_pair
    for name in ("GPTQ_TORCH_STREAMING", "GPTQ_TORCH_CACHE_WEIGHTS", "GPTQ_TORCH_LOOKAHEAD"):
        monkeypatch.setenv(name, "1")  # kernel options that keep state or use side streams: all undone
    model = checkpoint.load_model(target, torch.float32)
    subs = [sub for layer in model.model.layers for sub in gptq.quantized_modules(layer).values()]
    assert subs and not any(s._streaming_enabled or s._cache_enabled or s._lookahead_enabled for s in subs)
    layout = layout_of(model.model.layers[0])
    names = {entry.name.rsplit(".", 1)[-1] for entry in layout.entries}
    assert {"qweight", "qzeros", "scales", "g_idx"} <= names
    assert "weight" in names  # only the two RMSNorm weights are unquantized
    assert all(e.dtype != torch.float32 for e in layout.entries if not e.name.endswith("norm.weight"))
    fp32_layout = layout_of(checkpoint.load_model(original, torch.float32).model.layers[0])
    assert layout.nbytes * 4 < fp32_layout.nbytes  # what the planner and the ring count: packed bytes
    desc_act = json.loads((Path(target) / "config.json").read_text())["quantization_config"]["desc_act"]
    g_idx = model.model.layers[0].mlp.down_proj.g_idx
    assert torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=g_idx.dtype) // 32) != desc_act
    run_passes(DecoderRunner(model))
    for layer in model.model.layers:
        assert gptq.unregistered_tensors(layer) == []  # no caches or derived weights survive a call


@needs_gptq
@pytest.mark.parametrize(("source", "resident", "ring"), [("ram", 0, 2), ("ram", 1, 3), ("disk", 0, 2), ("disk", 1, 3)])
def test_streamed_quantized_logits_equal_resident(gptq_pair, source, resident, ring):
    target, _, _ = gptq_pair
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    runner = streamed_runner(target, source=source, resident_layers=resident, ring_size=ring)
    try:
        assert len(runner.layers.streamed) == NUM_LAYERS - resident
        for _ in range(2):  # the second time, the ring has wrapped into the next passes
            assert_same_logits(run_passes(runner), want)
        for idx in runner.layers.streamed:
            assert gptq.unregistered_tensors(runner.hf_layers[idx]) == []
    finally:
        runner.layers.close()


@needs_gptq
def test_disk_source_redoes_the_v1_zero_point_conversion(gptq_pair):
    """The file holds v1 zero points (each stored minus one); gptqmodel's kernel keeps v2. A disk read
    must land the loaded bytes: without the fixup the layer check refuses the checkpoint."""
    target, _, _ = gptq_pair
    model = checkpoint.load_model(target, torch.float32)
    fixups = gptq.disk_fixups(model.config, dict(enumerate(model.model.layers)))
    assert set(fixups) == set(range(NUM_LAYERS))
    assert all(len(f) == 7 and all(n.endswith(".qzeros") for n in f) for f in fixups.values())
    assert gptq.packed_ones(4, 32) == 0x11111111
    layer = model.model.layers[0]
    assert not any(n.startswith("mlp.up_proj.wf_") for n in layer_tensors(layer))  # constants stay put
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptq, "disk_fixups", lambda config, layers: {})
        with pytest.raises(OffloadError, match="qzeros read from .* differs from the loaded weights"):
            streamed_runner(target, source="disk", resident_layers=1)




@needs_gptq
@pytest.mark.parametrize(("offload", "kernel"), [(None, "auto"), ("ram", "auto"), ("disk", "auto"),
                                                 (None, "dequantize"), ("ram", "dequantize")])
def test_greedy_specexec_with_quantized_target_equals_target_alone(gptq_pair, offload, kernel):
    """auto: int4 on this CPU, except from disk (the dequantize kernel); the reference is the same
    model (checkpoint, kernel) alone, through transformers' generate."""
    target, _, draft = gptq_pair
    used = "dequantize" if kernel == "dequantize" or offload == "disk" else "int4"
    prompt = [5, 17, 42, 9, 77, 130, 64]
    want = reference_greedy(checkpoint.load_model(target, torch.float32, gptq_kernel=used), prompt, 24)
    config = EngineConfig(
        model=ModelConfig(target=target, draft=draft, gptq_kernel=kernel),
        speculation=SpeculationConfig(budget=16),
        offload=OffloadConfig(enabled=offload is not None, source=offload or "ram", resident_layers=1),
    )
    engine = Engine.load(config)
    try:
        layer = engine.pair.target.hf_layers[0]
        assert isinstance(layer.mlp.down_proj, gptq_int4.Int4Linear) == (used == "int4")
        got = engine.generate_ids(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    finally:
        engine.close()
    assert got == want


def write_quantized_config(folder: Path, method: str) -> str:
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "quantization_config": {"quant_method": method, "bits": 4},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_missing_extra_error_gives_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(gptq, "missing_modules", lambda names=gptq.GPTQ_MODULES: list(names))
    path = write_quantized_config(tmp_path / "gptq", "gptq")
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_config(path)
    message = str(info.value)
    assert "GPTQ 4-bit" in message and "optimum, gptqmodel not installed" in message
    assert gptq.GPTQ_PIP in message and gptq.GPTQ_PIP_SOURCE in message


def test_unsupported_quantization_is_refused(tmp_path):
    path = write_quantized_config(tmp_path / "bnb", "bitsandbytes")
    with pytest.raises(CheckpointError, match="quantization method 'bitsandbytes' is not supported; supported: gptq, "
                                              r"awq \(4-bit GEMM\), compressed-tensors"):
        checkpoint.read_config(path)


@needs_gptq
def test_greedy_specexec_with_quantized_draft_equals_target_alone(gptq_pair):
    quantized, target, _ = gptq_pair
    prompt = [5, 17, 42, 9, 77, 130, 64]
    want = reference_greedy(checkpoint.load_model(target, torch.float32), prompt, 24)
    config = EngineConfig(
        model=ModelConfig(target=target, draft=quantized), speculation=SpeculationConfig(budget=16)
    )
    got = Engine.load(config).generate_ids(
        prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    assert got == want


@needs_gptq
def test_int4_weights_are_the_dequantized_weights(gptq_pair):
    """Every int4 module applied to the identity gives its weight: the gptqmodel kernel's dequantized
    weight, rounded to bf16 (the int4 kernel's output dtype), act-order included."""
    target, _, _ = gptq_pair
    dense = checkpoint.load_model(target, torch.float32)
    packed = checkpoint.load_model(target, torch.float32, gptq_kernel="int4")
    for dense_layer, packed_layer in zip(dense.model.layers, packed.model.layers, strict=True):
        for name, sub in gptq.quantized_modules(dense_layer).items():
            want = sub.dequantize_weight().float()  # [in, out]
            module = packed_layer.get_submodule(name)
            assert isinstance(module, gptq_int4.Int4Linear)
            got = module(torch.eye(module.in_features))  # [in, out]
            assert torch.allclose(got, want, rtol=2**-7, atol=1e-6), name


@needs_gptq
@pytest.mark.parametrize(("resident", "ring"), [(0, 2), (1, 3)])
def test_int4_layers_stream_packed_from_ram(gptq_pair, resident, ring):
    target, original, _ = gptq_pair
    model = checkpoint.load_model(target, torch.float32, gptq_kernel="int4")
    layout = layout_of(model.model.layers[0])
    names = {entry.name.rsplit(".", 1)[-1] for entry in layout.entries}
    assert {"packed", "scales_and_zeros"} <= names and not {"qweight", "qzeros", "scales"} & names
    assert layout.nbytes * 4 < layout_of(checkpoint.load_model(original, torch.float32).model.layers[0]).nbytes
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32, gptq_kernel="int4")))
    cfg = EngineConfig(model=ModelConfig(target=target),
                       offload=OffloadConfig(enabled=True, source="ram", resident_layers=resident, ring_size=ring))
    runner = build_offloaded_runner(model, cfg, torch.device("cpu"))
    try:
        assert len(runner.layers.streamed) == NUM_LAYERS - resident
        for _ in range(2):
            assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


@needs_gptq
def test_int4_from_disk_is_refused_by_name(gptq_pair):
    target, _, draft = gptq_pair
    config = EngineConfig(model=ModelConfig(target=target, draft=draft, gptq_kernel="int4"),
                          offload=OffloadConfig(enabled=True, source="disk"))
    with pytest.raises(ConfigError, match="model.gptq_kernel: a GPTQ target streamed from disk"):
        Engine.load(config)


@needs_gptq
@pytest.mark.parametrize("kernel", ["dequantize", "int4"])
def test_the_plan_counts_the_loaded_gptq_bytes(gptq_pair, kernel):
    """`specexec plan`'s arithmetic from config.json (engine.model.config_shapes) against a real
    load, both kernels' forms; and the dequantize kernel's scratch in the startup plan."""
    from engine.model import config_shapes, memory

    target, _, _ = gptq_pair
    runner = DecoderRunner(checkpoint.load_model(target, torch.float32, gptq_kernel=kernel))
    config = json.loads((Path(target) / "config.json").read_text())
    counted = config_shapes.weight_bytes(config, 4, kernel)
    layer = layer_tensors(runner.hf_layers[0]).values()
    assert counted.layer == sum(t.numel() * t.element_size() for t in layer)
    scratch = memory.dequant_scratch_bytes(runner)
    assert scratch == (counted.largest_matrix * config_shapes.DEQUANT_BYTES_PER_WEIGHT if kernel == "dequantize" else 0)
