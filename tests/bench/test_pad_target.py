"""The padded benchmark target computes what the original computes (zero-width MLP units, no-op layers)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.pad_target import DONE_FILE, pad_checkpoint, plan_padding
from engine.model import checkpoint
from engine.speculation.tree import causal_mask
from specexec.__main__ import main
from tests.helpers.tiny_models import build_model, build_tokenizer, save_checkpoint


def test_plan_reaches_size_with_wide_layers():
    config = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 704}
    plan = plan_padding(config, int(1.5e9))
    assert plan.num_layers == 11  # 1.5 GB / 128 MiB
    assert plan.intermediate_size % 256 == 0 and plan.intermediate_size >= 704
    assert 1.5e9 <= plan.total_bytes < 1.5e9 * 1.02


def test_plan_never_shrinks():
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 6, "intermediate_size": 4096}
    plan = plan_padding(config, 1000)
    assert plan.num_layers == 6 and plan.intermediate_size == 4096


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_logits_equal_original(tmp_path, arch):
    tokenizer = build_tokenizer()
    model = build_model(arch, len(tokenizer), seed=3, eos_token_id=tokenizer.eos_token_id)
    source = save_checkpoint(model, tokenizer, tmp_path / "target")
    folder, plan = pad_checkpoint(source, tmp_path / "cache", target_gb=0.004, seed=1, layer_bytes=10**6)
    assert plan.num_layers > model.config.num_hidden_layers
    assert plan.intermediate_size > model.config.intermediate_size
    assert json.loads((folder / DONE_FILE).read_text())["num_layers"] == plan.num_layers
    padded = checkpoint.load_model(str(folder), torch.float32)
    assert padded.config.num_hidden_layers == plan.num_layers
    extra = padded.model.layers[-1]
    assert extra.mlp.down_proj.weight.abs().sum() == 0 and extra.self_attn.o_proj.weight.abs().sum() == 0
    assert extra.mlp.gate_proj.weight.abs().sum() > 0  # real compute
    input_ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 120]])
    with torch.no_grad():
        want = model(input_ids).logits
        got = padded(input_ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert checkpoint.load_tokenizer(str(folder)) is not None
    again, _ = pad_checkpoint(source, tmp_path / "cache", target_gb=0.004, seed=1, layer_bytes=10**6)
    assert again == folder  # cached


def test_padded_runs_through_engine_runner(tmp_path):
    from engine.model.runner import DecoderRunner

    tokenizer = build_tokenizer()
    model = build_model("llama", len(tokenizer), seed=4, eos_token_id=tokenizer.eos_token_id)
    source = save_checkpoint(model, tokenizer, tmp_path / "target")
    folder, _ = pad_checkpoint(source, tmp_path / "cache", target_gb=0.003, layer_bytes=10**6)
    ids = torch.tensor([3, 9, 27, 81, 11])
    outs = []
    for runner in (DecoderRunner(model), DecoderRunner(checkpoint.load_model(str(folder), torch.float32))):
        cache = runner.new_cache(8)
        outs.append(runner.forward(ids, torch.arange(5), cache, 0, causal_mask(5, 0, ids.device)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_unsupported_checkpoints_are_refused_from_the_cli(tmp_path, capsys, arch):
    """A quantized or MoE target cannot be padded: `specexec bench` says so in one line, exit 2."""
    tokenizer = build_tokenizer()
    target = save_checkpoint(build_model(arch, len(tokenizer), seed=1, layers=2), tokenizer, tmp_path / "target")
    if arch == "llama":  # what a GPTQ checkpoint's config.json carries
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unquantized checkpoints only" if arch == "llama" else "dense"):
        pad_checkpoint(target, tmp_path / "cache", 0.01)
    args = ["bench", "--target", str(target), "--draft", str(target), "--pad-to-gb", "0.01", "--out", str(tmp_path)]
    capsys.readouterr()  # drop the checkpoint writer's progress bar
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("specexec: error: --pad-to-gb: ") and err.count("\n") == 1
