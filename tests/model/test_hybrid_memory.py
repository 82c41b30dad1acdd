"""A hybrid model's state memory: the plan counts what its caches allocate, the budget is capped (with a
log line) where a tree's rows do not fit, `specexec plan` shows the per-node figure for Qwen3.5."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.model import memory, memory_plan
from engine.model.hybrid_cache import HybridCache
from engine.model.runner import DecoderRunner
from engine.runtime import Engine
from engine.types import SamplingParams
from specexec.__main__ import main
from tests.helpers.tiny_models import build_model, make_tiny_pair


def allocated(cache: HybridCache) -> tuple[int, int]:
    """(KV bytes, linear-attention state bytes) of a real cache."""
    kv = cache.keys.nbytes + cache.values.nbytes + cache.positions.nbytes
    states = cache.linear
    linear = sum(t.nbytes for t in (states.state, states.window, states.x, states.keys, states.values, states.gammas))
    return kv, linear


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_the_plan_counts_what_a_hybrid_cache_allocates(family):
    runner = DecoderRunner(build_model(family, 320, 0, layers=4))
    shape = memory_plan.shape_of(runner)
    assert (shape.num_linear_layers, shape.num_layers) == (3, 4)
    for capacity, pending in ((40, 8), (300, 65)):
        kv, linear = allocated(runner.new_cache(capacity, pending))
        assert memory_plan.kv_cache_bytes(shape, capacity) == kv  # KV for the one attention layer only
        assert memory_plan.linear_state_bytes(shape, pending) == linear


def test_pending_rows_follow_the_trees_not_the_drafts_kv_room():
    target, draft = memory_plan.pending_slots(max_context=1000, budget=64, max_depth=32, max_expand=128)
    assert target == 65  # the target's tree
    assert draft == 3 * 65 + 32 + 2  # catch-up and (1 + SMALL_EXTENSION_FACTOR) trees of expanded nodes, < KV room


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    return tuple(map(str, make_tiny_pair(tmp_path_factory.mktemp("hybrid-memory"), arch="qwen3_5_text",
                                         draft="noisy", seed=1, layers=4)))


def config_for(pair, budget: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=pair[0], draft=pair[1]), speculation=SpeculationConfig(budget=budget),
                        limits=LimitsConfig(max_context=128, max_running=1, prefix_cache_slots=0))


def test_a_budget_whose_rows_do_not_fit_is_capped_with_a_log_line(pair, monkeypatch, caplog):
    probe = Engine.load(config_for(pair, 64))
    inputs = dataclasses.replace(probe.memory_plan_inputs(budget=16), kv_slots=1)
    room = memory_plan.plan_memory(inputs).to_allocate  # one slot's caches at budget 16, and the workspaces
    probe.close()
    monkeypatch.setattr(memory, "free_device_memory", lambda device: room)
    with caplog.at_level(logging.WARNING, logger="specexec.engine"):
        engine = Engine.load(config_for(pair, 64))
    assert 16 <= engine.budget < 64 and engine.config.speculation.budget == engine.budget
    assert any("linear-attention rows" in r.message and f"budget capped to {engine.budget}" in r.message
               for r in caplog.records)
    assert len(engine.generate_ids([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))) == 4


def test_specexec_plan_shows_the_state_memory_of_qwen3_5(capsys):
    code = main(["plan", "--target", "Qwen/Qwen3.5-27B", "--gpu-memory-total", "24", "--offload"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "target linear-attention state: 2.57 MB a tree node (48 layers; a full recurrent state per node would be 151 MB)" in out
    assert "| target linear-attention states |" in out and "| draft linear-attention states |" in out


def test_a_hybrid_cache_allocates_kv_only_for_attention_layers():
    runner = DecoderRunner(build_model("qwen3_5_text", 320, 0, layers=4))
    cache = runner.new_cache(16, 4)
    assert cache.keys.shape[0] == 1 and runner.attention_layers == [3]
    keys = torch.ones(2, 1, 32)
    cache.write(3, 0, keys, keys)
    assert torch.equal(cache.view(3, 1)[0], keys)
