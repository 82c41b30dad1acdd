"""`specexec plan`: the startup memory plan from config.json shapes alone, for every shipped config.

- Every configs/*.toml plans on a 24 GB GPU without weights or a GPU, and fits the GPU its comments
  name; Llama-3.1-70B with its 8B draft is refused on 24 GB with the server's refusal and the
  drafts the README suggests.
- The shapes arithmetic (engine.model.config_shapes) gives the loaded bytes of a real load, every
  family; the plan's inputs are those the engine builds for the same config (tiny pairs, CPU).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, config_shapes, memory_plan
from engine.model.pair_plan import GB, plan_pair
from engine.model.runner import DecoderRunner
from engine.offload.layout import layer_tensors
from engine.runtime import Engine
from specexec.__main__ import main
from tests.helpers.family_configs import FAMILIES
from tests.helpers.tiny_models import make_tiny_pair

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))
NEEDS_GB = {  # the GPU each config's comments name
    "default.toml": 24, "llama2-70b-chat.toml": 80, "llama2-70b-chat-gptq.toml": 24,
    "llama3.1-70b-instruct.toml": 48, "mixtral-8x7b-instruct.toml": 48, "qwen2.5-72b-instruct.toml": 24,
}


def plan(capsys, *argv: str) -> tuple[int, str]:
    code = main(["plan", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_config_plans_without_weights_and_fits_its_gpu(path, capsys):
    code, out = plan(capsys, "--config", str(path), "--gpu-memory-total", "24")
    assert code in (0, 1) and "| total |" in out and "KV slots:" in out
    assert ("does not fit; the server refuses at start with:" in out) == (code == 1)
    code, out = plan(capsys, "--config", str(path), "--gpu-memory-total", str(NEEDS_GB[path.name]))
    assert code == 0 and "fits, " in out, out


def test_the_8b_draft_on_24_gb_is_refused_with_the_readme_alternatives(capsys):
    code, out = plan(capsys, "--config", str(CONFIG_DIR / "llama3.1-70b-instruct.toml"), "--gpu-memory-total", "24")
    assert code == 1
    refusal = out.split("refuses at start with:\n")[1].splitlines()[0]
    assert refusal.strip().startswith("model.draft: the weights do not fit on the device (draft weights 16.06 GB")
    for draft in ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct",
                  "hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4"):
        assert f"--draft {draft} --gpu-memory" in out
    readme = (CONFIG_DIR.parent / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| llama3.1-70b-instruct.toml")]
    assert len(table) == 4  # as configured, and the three drafts


def test_the_readme_tables_are_the_commands_output():
    """The shipped configs' table and today's models' table (known models, streamed, with their drafts)."""
    readme = (CONFIG_DIR.parent / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines()
                if line.strip().startswith("specexec plan --gpu-memory-total 24 --table")]
    assert len(commands) == 2
    for command in commands:
        argv = command.split()[2:]
        out = subprocess.run([sys.executable, "-m", "specexec", "plan", *argv], capture_output=True, text=True,
                             check=True, cwd=CONFIG_DIR.parent).stdout
        assert out.strip() in readme, command


KNOWN = config_shapes.known_models()


@pytest.mark.parametrize("name", list(KNOWN))
def test_every_known_model_plans_from_its_name_alone(name, capsys):
    """`specexec plan --target <id> --gpu-memory-total 24` answers without a GPU or weights, with the draft
    models.toml names for it (one of its vocabulary), or without speculation where none is known."""
    code, out = plan(capsys, "--target", name, "--gpu-memory-total", "24")
    assert code in (0, 1) and "| total |" in out
    assert ("what fits instead:" in out or "nothing of the kind" in out) == (code == 1)
    draft = KNOWN[name].get("draft")
    if draft is None:
        assert "planned without speculation" in out
    else:
        assert KNOWN[draft]["vocab_family"] == KNOWN[name]["vocab_family"] and f"draft  {draft}" in out


@pytest.mark.parametrize(("kernel", "bytes_per_weight"), [("auto", 5), ("int4", 5), ("dequantize", 7)])
def test_a_grouped_gptq_target_counts_the_dequantize_scratch(capsys, kernel, bytes_per_weight):
    """gptqmodel's dequantize kernel: 7 bytes a weight of the largest matrix per call; the int4 kernel
    (auto on CUDA) dequantizes calls of many rows to bf16 once: 5."""
    code, out = plan(capsys, "--config", str(CONFIG_DIR / "llama2-70b-chat-gptq.toml"), "--gpu-memory-total", "24",
                     "--gptq-kernel", kernel)
    scratch = bytes_per_weight * 8192 * 28672  # the largest matrix
    assert f"| dequantization scratch (4-bit, FP8) | {scratch / GB:.2f} |" in out


def test_an_unknown_model_names_the_fix(capsys, tmp_path):
    code = main(["plan", "--target", str(tmp_path / "nowhere"), "--method", "autoregressive",
                 "--gpu-memory-total", "24"])
    assert code == 2
    assert "nowhere: no config.json there; name a model folder, or a hub id" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict[str, tuple[str, str]] = {}

    def get(arch: str) -> tuple[str, str]:
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            cache[arch] = tuple(map(str, make_tiny_pair(folder, arch=arch, draft="noisy", seed=2, layers=3)))
        return cache[arch]

    return get


def constants(modules: list[torch.nn.Module]) -> int:
    """Bytes of the non-persistent buffers (rotary tables, Gemma's embedding scale): not weights."""
    return sum(sub._buffers[name].numel() * sub._buffers[name].element_size() for module in modules
               for sub in module.modules() for name in sub._non_persistent_buffers_set)


@pytest.mark.parametrize("arch", FAMILIES)
def test_shapes_arithmetic_gives_the_loaded_bytes(pairs, arch):
    """Every family: weights per layer (norms, sinks, fused projections, experts), the outer weights,
    the plan's shape (windows, the MoE width a token runs through, eager attention's score blocks)."""
    target, _ = pairs(arch)
    model = checkpoint.load_model(target, torch.float32)
    runner = DecoderRunner(model)
    measured = memory_plan.loaded_bytes(runner, None, [], [])
    config = json.loads((Path(target) / "config.json").read_text())
    counted = config_shapes.weight_bytes(config, 4)
    outer = [runner.embed_tokens, runner.norm, runner.lm_head, runner.rotary_emb]
    assert counted.outer == measured["target embeddings, norm and head"] - constants(outer)
    assert counted.layers == tuple(sum(t.numel() * t.element_size() for t in layer_tensors(layer).values())
                                   for layer in runner.hf_layers)
    assert sum(counted.layers) == measured["target resident layers"]
    assert config_shapes.shape_from_config(config, 4) == memory_plan.shape_of(runner)


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_text"])
def test_the_plan_is_the_engines_plan(pairs, arch):
    """On CPU the engine's plan has no CUDA reserve; everything else (KV caches, logits, masks,
    activations, workspaces) is the same arithmetic on the same inputs. Draft graphs on (a CPU runs their
    static pass uncaptured): the plan reads from the configs whether the engine's draft has a static pass."""
    target, draft = pairs(arch)
    config = EngineConfig(model=ModelConfig(target=target, draft=draft, dtype="float32"),
                          speculation=SpeculationConfig(budget=32, draft_graphs=True),
                          offload=OffloadConfig(enabled=True, resident_layers=1),
                          limits=LimitsConfig(max_context=256, max_running=2, prefix_cache_slots=1))
    engine = Engine.load(config)
    try:
        got = plan_pair(config, 10**12)
        want = dataclasses.replace(engine.memory_plan_inputs(), kv_slots=got.inputs.kv_slots)
        assert got.inputs.kv_slots == 3 and got.resident_layers == 1
        assert got.inputs.draft_graphs == (arch == "llama")  # the others: experts or linear attention
        assert dataclasses.replace(got.inputs, loaded={}, reserve_bytes=0) == dataclasses.replace(want, loaded={})
        for name, nbytes in want.loaded.items():
            assert abs(got.inputs.loaded[name] - nbytes) <= max(0.02 * nbytes, 64 * 1024), name
    finally:
        engine.close()


def test_the_plan_prints_its_host_ram_and_a_labelled_speed_estimate(capsys):
    """tokens/s = tokens per pass x link GB/s / GB streamed per pass, with the bandwidth and tokens per pass it
    assumed; the host RAM is the load's peak as the server counts it before loading, margin included."""
    from engine.model import host_plan
    from engine.model.plan_estimate import assumed_tokens_per_pass

    qwen = str(CONFIG_DIR / "qwen2.5-72b-instruct.toml")
    code, out = plan(capsys, "--config", qwen, "--gpu-memory-total", "24", "--link-gbps", "50", "--tokens-per-pass", "10")
    layer = config_shapes.weight_bytes(config_shapes.read_model_config("Qwen/Qwen2.5-72B-Instruct")[0], 2).layer
    streamed = 78 * layer  # 2 of 80 layers resident (the plan's table above)
    estimate = next(line for line in out.splitlines() if line.startswith("speed estimate (arithmetic, not measured)"))
    assert f"about {10 * 50 * GB / streamed:.2f} tokens/s ({50 * GB / streamed:.2f} without speculation)" in estimate
    assert f"{streamed / GB:.2f} GB streamed per target pass (78 layers) at 50 GB/s" in estimate
    assert "50 GB/s: given (--link-gbps); 10.0 tokens per pass: given (--tokens-per-pass)" in out
    draft = config_shapes.weight_bytes(config_shapes.read_model_config("Qwen/Qwen2.5-1.5B-Instruct")[0], 2).total
    store = sum(host_plan.padded_bytes(layer) for _ in range(78))
    need = store + host_plan.READ_CHUNK + draft
    assert f"host RAM: {(need + host_plan.margin_for(need)) / GB:.2f} GB at the load's peak" in out
    code, out = plan(capsys, "--config", qwen, "--gpu-memory-total", "24")  # the defaults, said to be assumed
    assert "25 GB/s: assumed, PCIe 4.0 x16" in out and "tokens per pass: assumed for budget 1024" in out
    assert assumed_tokens_per_pass(256, "specexec") == 13.46 and assumed_tokens_per_pass(2048, "rrs") == 20.0
    assert 13.46 < assumed_tokens_per_pass(1024, "specexec") < 20 and assumed_tokens_per_pass(4096, "specexec") == 20
    assert assumed_tokens_per_pass(1024, "autoregressive") == 1.0
    code, out = plan(capsys, "--target", "Qwen/Qwen2.5-1.5B-Instruct", "--method", "autoregressive",
                     "--gpu-memory-total", "24")  # resident: nothing streams, no estimate from the link
    assert "speed estimate: none (no layer streams" in out


def test_a_family_the_engine_refuses_is_refused_by_the_plan_too(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["JambaForCausalLM"], "model_type": "jamba"}))
    code = main(["plan", "--target", str(tmp_path), "--method", "autoregressive", "--gpu-memory-total", "24"])
    assert code == 2 and "linear-attention hybrid" in capsys.readouterr().err
