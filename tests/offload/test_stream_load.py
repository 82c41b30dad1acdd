"""Offloaded targets load tensor by tensor, after a host-memory check made from the checkpoint's headers.

- The streaming load (engine.offload.loader) gives transformers' own weights bit for bit: the dense
  and MoE families, a bf16 sharded checkpoint loaded as fp32 and fp16, Mixtral's and Qwen3-MoE's experts
  fused, Gemma's embedding scale rebuilt, tied embeddings, RAM and disk sources.
- The header arithmetic (engine.model.host_plan) counts the bytes the loaded layers really have.
- With too little host memory (a faked figure) the load is refused in one line before any weights
  load, and in a child process its resident set never grew past the figure; the disk source, which
  needs only the ring, loads with the same figure.
- cgroup v1 and v2 limits count (engine.offload.host_memory), from fake cgroup trees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig

from engine.config import EngineConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, host_plan
from engine.model import pair as pair_module
from engine.model.runner import DecoderRunner
from engine.offload import host_memory
from engine.offload.layout import ALIGN, layout_of
from engine.offload.loader import load_offloaded_target
from engine.types import CheckpointError, OffloadError
from tests.helpers.offload_passes import CPU, assert_same_logits, run_passes
from tests.helpers.tiny_models import build_model

ARCHS = ["llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "gemma3", "gpt_oss", "phi3"]  # fused experts
# per family, Gemma's embedding scale (a non-persistent buffer), sinks and biases, fused qkv
NUM_LAYERS = 3
GB = 10**9


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    folders: dict[str, Path] = {}

    def get(arch: str, tied: bool = False) -> Path:
        key = f"{arch}-tied" if tied else arch
        if key not in folders:
            model = build_model(arch, 320, seed=4, layers=NUM_LAYERS)
            if tied:
                model.config.tie_word_embeddings = True
                model.lm_head.weight = model.model.embed_tokens.weight
            folder = tmp_path_factory.mktemp(key)
            model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")  # sharded
            folders[key] = folder
        return folders[key]

    return get


def offload_config(target: Path, source: str, resident_layers: int = 1, **limits) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=str(target)),
                        speculation=SpeculationConfig(method="autoregressive"),
                        offload=OffloadConfig(enabled=True, source=source, resident_layers=resident_layers, **limits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("source", ["ram", "disk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_load_gives_transformers_weights(bf16_checkpoints, arch, source, dtype):
    folder = bf16_checkpoints(arch)
    reference = checkpoint.load_model(str(folder), dtype)
    model, streamer = load_offloaded_target(offload_config(folder, source), dtype, CPU)
    try:
        assert streamer is not None and streamer.streamed == [1, 2]
        want = reference.state_dict()
        resident = {name: value for name, value in model.state_dict().items() if ".layers." not in name or ".layers.0." in name}
        assert resident and all(torch.equal(value, want[name]) and value.dtype == dtype for name, value in resident.items())
        assert_same_logits(run_passes(DecoderRunner(model, streamer)), run_passes(DecoderRunner(reference)))
        assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id
    finally:
        streamer.close()


def test_tied_embeddings_are_read_once(bf16_checkpoints):
    folder = bf16_checkpoints("qwen2", tied=True)
    model, streamer = load_offloaded_target(offload_config(folder, "ram"), torch.float32, CPU)
    try:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        reference = checkpoint.load_model(str(folder), torch.float32)
        assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
        assert_same_logits(run_passes(DecoderRunner(model, streamer)), run_passes(DecoderRunner(reference)))
    finally:
        streamer.close()


@pytest.mark.parametrize("source", ["ram", "disk"])
def test_a_tensor_missing_from_the_checkpoint_is_named(tmp_path, source):
    model = build_model("llama", 320, seed=4, layers=NUM_LAYERS)
    state = {name: value.contiguous() for name, value in model.state_dict().items()
             if name != "model.layers.2.mlp.up_proj.weight"}
    model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.up_proj.weight"):
        load_offloaded_target(offload_config(tmp_path, source), torch.float32, CPU)


@pytest.mark.parametrize("arch", ARCHS)
def test_header_arithmetic_counts_the_loaded_bytes(bf16_checkpoints, arch):
    folder = bf16_checkpoints(arch)
    for dtype in (torch.float32, torch.float16):
        counted = host_plan.checkpoint_bytes(str(folder), dtype)
        model = checkpoint.load_model(str(folder), dtype)
        assert counted.layers == tuple(layout_of(layer).nbytes for layer in model.model.layers)
        outer = [model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight]
        assert counted.outer == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in outer)


def fake_available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(host_memory, "host_memory_available", lambda: nbytes)


def test_too_little_host_memory_is_refused_before_any_weights_load(bf16_checkpoints, monkeypatch):
    folder = bf16_checkpoints("mixtral")
    config = offload_config(folder, "ram", resident_layers=0)
    counted = host_plan.checkpoint_bytes(str(folder), torch.float32)
    fake_available(monkeypatch, counted.total // 2)

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights loaded before the host-memory check")

    monkeypatch.setattr(pair_module, "load_offloaded_target", must_not_load)
    monkeypatch.setattr(checkpoint, "load_model", must_not_load)
    with pytest.raises(OffloadError) as info:
        pair_module.load_pair(config)
    message = str(info.value)
    assert "\n" not in message and "not enough host memory" in message and "target layer store" in message
    assert "--offload-source disk" in message and "margin" in message


def test_the_disk_source_loads_where_the_ram_source_is_refused(mixtral_checkpoint, monkeypatch):
    folder = mixtral_checkpoint
    counted = host_plan.checkpoint_bytes(str(folder), torch.float32)
    ram = offload_config(folder, "ram", resident_layers=0)
    disk = offload_config(folder, "disk", resident_layers=0)
    ram_need = sum(n for _, n in host_plan.host_items(ram.offload, True, counted, 0, True))
    disk_need = sum(n for _, n in host_plan.host_items(disk.offload, True, counted, 0, True))
    assert disk_need < ram_need
    fake_available(monkeypatch, ram_need - 1 + host_plan.margin_for(ram_need - 1))
    with pytest.raises(OffloadError, match="not enough host memory"):
        pair_module.load_pair(ram)
    loaded = pair_module.load_pair(disk)
    loaded.close()


def test_cgroup_limits_count(tmp_path):
    v1 = tmp_path / "v1"
    group = v1 / "memory" / "box"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text("4000000000\n")
    (group / "memory.usage_in_bytes").write_text("1500000000\n")
    (group / "memory.stat").write_text("cache 1\ntotal_inactive_file 500000000\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: no limit
    proc = tmp_path / "cgroup-v1"
    proc.write_text("5:cpu:/\n4:memory:/box\n0::/\n")
    assert host_memory.cgroup_available(v1, proc) == 4_000_000_000 - (1_500_000_000 - 500_000_000)

    v2 = tmp_path / "v2"
    inner = v2 / "user.slice" / "job"
    inner.mkdir(parents=True)
    (inner / "memory.max").write_text("max\n")
    (inner / "memory.current").write_text("100\n")
    (v2 / "user.slice" / "memory.max").write_text("3000000000\n")  # the parent's limit binds
    (v2 / "user.slice" / "memory.current").write_text("1000000000\n")
    (v2 / "user.slice" / "memory.stat").write_text("anon 1\ninactive_file 200000000\n")
    proc2 = tmp_path / "cgroup-v2"
    proc2.write_text("0::/user.slice/job\n")
    assert host_memory.cgroup_available(v2, proc2) == 3_000_000_000 - 800_000_000
    proc2.write_text("0::/elsewhere\n")  # not visible from here (a container's namespace): the root only
    assert host_memory.cgroup_available(v2, proc2) is None
    assert host_memory.cgroup_available(tmp_path / "none", tmp_path / "missing") is None


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory) -> Path:
    """A Mixtral-shaped bf16 checkpoint of ~0.4 GB (8 experts, 8 layers of ~50 MB, small vocabulary)."""
    config = MixtralConfig(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    folder = tmp_path_factory.mktemp("mixtral-bf16")
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_refused_load_never_holds_more_than_is_available(mixtral_checkpoint):
    """In child processes (bench.load_memory, as `specexec bench load` measures it): with the
    available figure faked below what the RAM source needs, the load is refused and the process
    grew by almost nothing; the disk source loads and stays under the figure."""
    from bench.load_memory import measure

    counted = host_plan.checkpoint_bytes(str(mixtral_checkpoint), torch.float32)
    room = int(0.6 * counted.total)  # what the faked figure leaves beyond the margin
    available = (room + host_plan.margin_for(room)) / GB
    ram = measure(mixtral_checkpoint, "ram", "float32", available)
    assert ram["refused"] and "not enough host memory" in ram["refused"]
    assert (ram["peak_kb"] - ram["before_kb"]) * 1024 < 0.05 * counted.total
    disk = measure(mixtral_checkpoint, "disk", "float32", available)
    assert disk["refused"] is None
    assert (disk["peak_kb"] - disk["before_kb"]) * 1024 < room
