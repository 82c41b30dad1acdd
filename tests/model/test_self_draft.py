"""`--draft self` (engine.model.self_draft): the target with 4-bit copies of its layers as the draft.

- the RTN copy: within half a quantization step of each weight, and its Int4Linear computes with the
  weight it stands for;
- what is copied and what is shared: a resident target's every layer is copied; a streamed target's
  resident layers, and always the embeddings, norm, rotary tables and head, are the target's own
  tensors; the streamed layers' copies own their tensors;
- the draft's own config object, referenced by every module of its layers, so its passes never touch
  the field the target's passes set (and the reverse), which overlap relies on;
- memory: shared tensors counted once, and the plan's arithmetic from config.json gives the loaded bytes;
- a 4-bit checkpoint of the target as the layers' source (--self-draft-from), and the refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import memory, memory_plan, self_draft_quant
from engine.model.gptq_int4 import Int4Linear
from engine.model.hf_attention import engine_attention
from engine.model.pair_plan import plan_pair
from engine.model.preflight import check_pair
from engine.runtime import Engine
from engine.speculation.tree import causal_mask
from engine.types import CheckpointError, ConfigError, SamplingParams
from specexec.__main__ import main
from tests.helpers.int4_checkpoints import write_awq
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

NUM_LAYERS = 3
PROMPT = [5, 17, 42, 9, 77, 130, 64]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("self-draft")
    target, draft = make_tiny_pair(root, arch="llama", draft="noisy", seed=3, layers=NUM_LAYERS, hidden=128)
    return str(target), str(draft)


def load(target: str, offload: dict | None = None, **model) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=target, draft="self", **model),
        speculation=SpeculationConfig(budget=16),
        offload=OffloadConfig(enabled=True, **offload) if offload is not None else OffloadConfig(),
        limits=LimitsConfig(max_context=128, max_running=2, prefix_cache_slots=1),
    ))


def test_the_rtn_copy_is_within_half_a_step_and_its_kernel_computes_with_it():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=gen) * torch.linspace(0.1, 3, 256)  # groups of different ranges
    q, scale, zero = self_draft_quant.quantize_rows(weight, 128)
    assert q.min() >= 0 and q.max() <= 15
    step = scale.float().repeat_interleave(128, dim=1)
    assert ((self_draft_quant.dequantize_rows(q, scale, zero) - weight).abs() <= 0.51 * step + 1e-6).all()
    bias = torch.randn(96, generator=gen)
    linear = self_draft_quant.quantize_linear(weight, bias, torch.device("cpu"))
    x = torch.randn(5, 256, generator=gen)
    want = x.bfloat16().float() @ self_draft_quant.dequantize_rows(q, scale, zero).T + bias
    assert (linear(x) - want).abs().max() <= 0.01 * want.abs().max()  # bf16 products


def test_group_sizes_and_what_the_kernel_cannot_take():
    assert [self_draft_quant.group_for(k) for k in (256, 704, 96, 100)] == [128, 64, 32, None]
    cpu = torch.device("cpu")
    assert self_draft_quant.refusal(256, 40, cpu) is not None  # the CPU kernel's rows come in 16s
    assert self_draft_quant.refusal(100, 64, cpu) is not None
    assert self_draft_quant.refusal(704, 256, cpu) is None


def configs_in(module: nn.Module) -> list[object]:
    return [value for sub in module.modules() for name, value in vars(sub).items() if name == "config"]


def test_a_resident_target_has_every_layer_copied_and_shares_the_rest(pair):
    engine = load(pair[0])
    target, draft = engine.pair.target, engine.pair.draft
    assert draft.config is not target.config and draft.config.to_dict() == target.config.to_dict()
    for idx, layer in enumerate(draft.hf_layers):
        assert not [m for m in layer.modules() if isinstance(m, nn.Linear)], idx  # every map 4-bit
        assert len([m for m in layer.modules() if isinstance(m, Int4Linear)]) == 7
        assert configs_in(layer) and all(c is draft.config for c in configs_in(layer))
        target_ptrs = {t.data_ptr() for t in target.hf_layers[idx].parameters()}
        assert not target_ptrs & {t.data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    for name in ("embed_tokens", "norm", "lm_head", "rotary_emb"):
        assert getattr(draft, name) is getattr(target, name)
    assert all(c is target.config for layer in target.hf_layers for c in configs_in(layer))


def test_a_streamed_target_shares_its_resident_layers(pair):
    engine = load(pair[0], {"source": "ram", "resident_layers": 1})
    try:
        target, draft = engine.pair.target, engine.pair.draft
        assert target.layers.streamed == [1, 2]
        shared = draft.hf_layers[0]
        assert shared is not target.hf_layers[0] and all(c is draft.config for c in configs_in(shared))
        assert [p.data_ptr() for p in shared.parameters()] == [p.data_ptr() for p in target.hf_layers[0].parameters()]
        for idx in (1, 2):
            assert len([m for m in draft.hf_layers[idx].modules() if isinstance(m, Int4Linear)]) == 7
            target_params = {id(p) for p in target.hf_layers[idx].parameters()}
            assert not target_params & {id(p) for p in draft.hf_layers[idx].parameters()}
        loaded = memory_plan.loaded_bytes(target, draft, [1, 2], target.layers.ring)
        copies = [t for idx in (1, 2) for t in [*draft.hf_layers[idx].parameters(), *draft.hf_layers[idx].buffers()]]
        assert loaded["draft weights"] == sum(t.untyped_storage().nbytes() for t in copies)
        config = EngineConfig(model=ModelConfig(target=pair[0], draft="self", dtype="float32"),
                              speculation=SpeculationConfig(budget=16),
                              offload=OffloadConfig(enabled=True, resident_layers=1),
                              limits=LimitsConfig(max_context=128, max_running=2, prefix_cache_slots=1))
        planned = plan_pair(config, 10**12).inputs
        for name, nbytes in loaded.items():
            assert abs(planned.loaded[name] - nbytes) <= max(0.02 * nbytes, 64 * 1024), name
        inputs = memory.plan_inputs(target, draft, engine.config.speculation, (128, 16, 64), 0)
        assert inputs.draft == inputs.target  # the draft's caches and activations have the target's shape
    finally:
        engine.close()


def test_draft_and_target_passes_never_touch_each_others_attention_field(pair):
    """A draft pass inside a target pass (what overlap does from two threads) leaves the target's
    `_attn_implementation` as the target's pass set it, and the draft's layers see only the draft's."""
    engine = load(pair[0])
    target, draft = engine.pair.target, engine.pair.draft
    seen = []
    layer0 = draft.hf_layers[0]
    original = draft.layer_forwards[0]

    def spy(layer, *args, **kwargs):
        seen.append((target.config._attn_implementation_internal, draft.config._attn_implementation_internal))
        return original(layer, *args, **kwargs)

    draft.layer_forwards[0] = spy
    ids = torch.tensor(PROMPT)
    cache = draft.new_cache(16)
    before = target.config._attn_implementation_internal
    alone = draft.forward(ids, torch.arange(len(PROMPT)), cache, 0, causal_mask(len(PROMPT), 0, ids.device))
    with engine_attention(target.config):
        inside = draft.forward(ids, torch.arange(len(PROMPT)), cache, 0, causal_mask(len(PROMPT), 0, ids.device))
        assert target.config._attn_implementation_internal == "specexec"
    assert target.config._attn_implementation_internal == before
    assert seen == [(before, "specexec"), ("specexec", "specexec")]
    assert torch.equal(alone, inside) and layer0 is draft.hf_layers[0]


@pytest.fixture(scope="module")
def awq(pair, tmp_path_factory) -> str:
    return str(write_awq(Path(pair[0]), tmp_path_factory.mktemp("awq") / "awq"))


@pytest.mark.parametrize("offload", [None, {"source": "ram", "resident_layers": 1}], ids=["resident", "ram"])
def test_a_4bit_checkpoint_of_the_target_gives_the_layers(pair, awq, offload):
    engine = load(pair[0], offload, self_draft_from=awq)
    try:
        from engine.model import checkpoint

        source = checkpoint.load_model(awq, torch.float32, gptq_kernel="int4")
        for idx in ([0, 1, 2] if offload is None else [1, 2]):
            got = engine.pair.draft.hf_layers[idx].self_attn.q_proj
            want = source.model.layers[idx].self_attn.q_proj
            assert isinstance(got, Int4Linear) and torch.equal(got.packed, want.packed)
            assert torch.equal(got.scales_and_zeros, want.scales_and_zeros)
        model = checkpoint.load_model(pair[0], torch.float32)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        assert engine.generate_ids(PROMPT, params) == reference_greedy(model, PROMPT, 24)
    finally:
        engine.close()


def test_refusals(pair, awq, tmp_path):
    with pytest.raises(ConfigError, match="model.self_draft_from"):
        ModelConfig(target=pair[0], draft=pair[1], self_draft_from=awq)
    with pytest.raises(ConfigError, match="already quantized"):
        load(awq)
    with pytest.raises(ConfigError, match="model.self_draft_from.*not a quantized checkpoint"):
        load(pair[0], self_draft_from=pair[1])
    other = make_tiny_pair(tmp_path / "other", arch="llama", seed=4, layers=2, hidden=128)[0]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load(pair[0], self_draft_from=str(write_awq(other, tmp_path / "other-awq")))
    moe = make_tiny_pair(tmp_path / "moe", arch="mixtral", seed=4, layers=2)[0]
    with pytest.raises(ConfigError, match="experts in fused tensors"):
        load(str(moe))
    # serve and generate find the same before loading (engine.model.preflight), and pass a good one
    with pytest.raises(ConfigError, match="experts in fused tensors"):
        check_pair(EngineConfig(model=ModelConfig(target=str(moe), draft="self")))
    with pytest.raises(CheckpointError, match="--self-draft-from .*no such folder"):
        check_pair(EngineConfig(model=ModelConfig(target=pair[0], draft="self", self_draft_from=str(tmp_path / "no"))))
    check_pair(EngineConfig(model=ModelConfig(target=pair[0], draft="self", self_draft_from=awq)))


def test_specexec_plan_counts_the_copies_and_says_what_is_shared(pair, capsys):
    code = main(["plan", "--target", pair[0], "--draft", "self", "--offload", "--resident-layers", "1",
                 "--dtype", "float32", "--gpu-memory-total", "24"])
    out = capsys.readouterr().out
    assert code == 0
    assert "self-draft: 4-bit copies of 2 layers" in out and "1 resident layers" in out
    assert "| draft weights |" in out


def test_the_self_draft_table_says_where_it_fits(capsys):
    assert main(["plan", "--gpu-memory-total", "25.8", "--self-draft-table", "Qwen/Qwen3-32B",
                 "mistralai/Mixtral-8x7B-Instruct-v0.1", "meta-llama/Llama-3.3-70B-Instruct"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert "| yes | 64 | 1024 | 0 |" in rows[0] and "--draft self --offload" in rows[0]
    assert "no: the target's MoE layers" in rows[1]
    assert "| no |" in rows[2]  # 36 GB of 4-bit copies
    assert all(line.count("|") == 10 for line in rows)


def test_a_streamed_plan_suggests_the_self_draft_where_it_fits(capsys):
    code = main(["plan", "--target", "Qwen/Qwen3-32B", "--offload", "--gpu-memory-total", "25.8"])
    out = capsys.readouterr().out
    assert code == 0 and "self-draft: `--draft self --offload" in out


def test_a_config_file_names_the_self_draft(tmp_path, pair):
    path = tmp_path / "self.toml"
    path.write_text(f'[model]\ntarget = "{pair[0]}"\ndraft = "self"\n')
    from engine.config import engine_config_from, read_config_file

    assert engine_config_from(read_config_file(str(path))).model.draft == "self"
