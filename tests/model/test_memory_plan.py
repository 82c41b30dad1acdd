"""The startup memory plan: byte counts against real allocations, the 24 GB card, Engine.load's refusal."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import draft_graphs, memory, memory_plan
from engine.model.memory_plan import ModelShape, PlanInputs, check_fits, plan_memory
from engine.model.runner import DecoderRunner
from engine.runtime import Engine
from engine.types import ConfigError, Request, SamplingParams
from tests.helpers.tiny_models import build_model, make_tiny_pair

GIB = 2**30
# Llama-3.x shapes, fp16 (128256-token vocabulary shared by the 70B, 8B, 3B and 1B models)
LLAMA_70B = ModelShape(80, 64, 8, 128, 8192, 28672, 128256, 2, 1)
LLAMA_8B = ModelShape(32, 32, 8, 128, 4096, 14336, 128256, 2, 1)
LLAMA_3B = ModelShape(28, 24, 8, 128, 3072, 8192, 128256, 2, 1)
LLAMA_1B = ModelShape(16, 32, 8, 64, 2048, 8192, 128256, 2, 1)
LAYER_70B = 2 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) + 2 * 2 * 8192  # fp16 bytes
HEAD_70B = 2 * 2 * 128256 * 8192 + 2 * 8192  # embeddings, lm_head, final norm
CARD_24GB_FREE = 24 * GIB - 600 * 2**20  # an RTX 4090 after the CUDA context


def llama70b_inputs(draft: ModelShape, draft_bytes: int, **changes) -> PlanInputs:
    inputs = PlanInputs(
        target=LLAMA_70B,
        draft=draft,
        loaded={
            "draft weights": draft_bytes,
            "target embeddings, norm and head": HEAD_70B,
            "target resident layers": 0,
            "offload ring": 2 * LAYER_70B,
        },
        max_context=8192,
        budget=2048,
        max_depth=32,
        max_expand=128,
        prefill_chunk=512,
        streamed=True,
        logits_processing_bytes=8 * 64 * 2**20,
        reserve_bytes=memory_plan.CUDA_RESERVE_BYTES,
    )
    return dataclasses.replace(inputs, **changes)


def free_after_loading(inputs: PlanInputs, free_at_start: int) -> int:
    return free_at_start - sum(inputs.loaded.values())


def test_kv_cache_bytes_equal_a_real_cache() -> None:
    runner = DecoderRunner(build_model("mistral", 320, 0))
    shape = memory_plan.shape_of(runner)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (2, 2, 16, 4)
    for capacity in (1, 37, 300):
        cache = runner.new_cache(capacity)
        real = cache.keys.nbytes + cache.values.nbytes + cache.positions.nbytes
        assert memory_plan.kv_cache_bytes(shape, capacity) == real


def test_device_bytes_counts_a_shared_storage_once() -> None:
    weight = torch.zeros(10, 4)
    other = torch.zeros(3)
    tensors = [weight, weight.view(-1), weight[2:], other]
    assert memory_plan.device_bytes(tensors, torch.device("cpu")) == weight.nbytes + other.nbytes
    assert memory_plan.device_bytes(tensors, torch.device("meta")) == 0


def test_fp16_8b_draft_with_70b_target_does_not_fit_a_24gb_card() -> None:
    inputs = llama70b_inputs(LLAMA_8B, 16_060_000_000)
    plan = plan_memory(inputs)
    assert plan.total > 24 * GIB
    with pytest.raises(ConfigError) as info:
        check_fits(inputs, plan, free_after_loading(inputs, CARD_24GB_FREE), "cuda:0")
    message = str(info.value)
    assert info.value.field == "model.draft"  # no context length would make room
    assert "\n" not in message and "draft weights 16.06 GB" in message
    assert "smaller or quantized draft" in message and "--gpu-memory" in message


@pytest.mark.parametrize("draft, draft_bytes", [(LLAMA_1B, 2_470_000_000), (LLAMA_3B, 6_430_000_000)])
def test_1b_or_3b_draft_with_70b_target_fits_a_24gb_card(draft: ModelShape, draft_bytes: int) -> None:
    inputs = llama70b_inputs(draft, draft_bytes)
    plan = plan_memory(inputs)
    check_fits(inputs, plan, free_after_loading(inputs, CARD_24GB_FREE), "cuda:0")
    assert plan.total < CARD_24GB_FREE


def test_plan_items_follow_context_and_budget() -> None:
    inputs = llama70b_inputs(LLAMA_1B, 2_470_000_000)
    plan = plan_memory(inputs)
    target_slots = 8192 + 2048 + 1
    assert plan.bytes_of("target KV caches") == target_slots * (2 * 80 * 8 * 128 * 2 + 8)
    assert plan.bytes_of("target logits") == 2049 * 128256 * (2 + 4)
    assert plan.bytes_of("offload ring") == 2 * LAYER_70B
    smaller = plan_memory(dataclasses.replace(inputs, max_context=4096, budget=1024))
    assert smaller.to_allocate < plan.to_allocate
    assert smaller.total - smaller.to_allocate == plan.total - plan.to_allocate  # loaded items unchanged
    resident = plan_memory(dataclasses.replace(inputs, streamed=False))
    assert resident.bytes_of("prefill hidden states") == 0 < plan.bytes_of("prefill hidden states")


def test_refusal_offers_the_largest_context_that_fits() -> None:
    inputs = llama70b_inputs(LLAMA_1B, 2_470_000_000, max_context=65536)
    free = plan_memory(dataclasses.replace(inputs, max_context=20000)).to_allocate
    with pytest.raises(ConfigError) as info:
        check_fits(inputs, plan_memory(inputs), free, "cuda:0")
    assert info.value.field == "limits.max_context"
    suggested = int(str(info.value).split("from 65536 to ")[1].split()[0])
    assert suggested == 20000  # the largest that fits
    assert plan_memory(dataclasses.replace(inputs, max_context=suggested + 1)).to_allocate > free


# -- Engine.load ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=4)
    return str(target), str(draft)


def config_for(pair: tuple[str, str], **offload) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=16, max_depth=4),
        offload=OffloadConfig(**offload),
        limits=LimitsConfig(max_context=200),
    )


def test_load_allocates_every_kv_slot_and_requests_reuse_them(pair) -> None:
    engine = Engine.load(config_for(pair))
    slots = list(engine.pool.slots)
    assert len(slots) == 4 + 4  # --max-running + --prefix-cache-slots (defaults), all fit here
    assert all(s.target.capacity == 200 + 16 + 1 and s.draft.capacity == 200 + 4 * 17 + 2 for s in slots)
    engine.generate_ids([5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    assert engine.pool.slots == slots and all(a is b for a, b in zip(engine.pool.slots, slots, strict=True))
    other = engine.with_speculation(SpeculationConfig(budget=8, max_depth=4))
    other.generate_ids([5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    assert all(a is b for a, b in zip(other.pool.slots, slots, strict=True))


def test_the_plan_lowers_running_requests_and_cache_slots_to_what_fits(pair, monkeypatch) -> None:
    engine = Engine.load(config_for(pair))
    inputs = engine.memory_plan_inputs()
    one_slot = memory_plan.plan_memory(dataclasses.replace(inputs, kv_slots=1))
    per_slot = one_slot.bytes_of("target KV caches") + one_slot.bytes_of("draft KV caches")
    monkeypatch.setattr(memory, "free_device_memory", lambda device: one_slot.to_allocate + 2 * per_slot)
    smaller = Engine.load(config_for(pair))
    assert (smaller.max_running, len(smaller.pool.slots)) == (3, 3)  # 3 slots fit: all running, none cached


def test_load_refuses_when_free_memory_is_too_small(pair, monkeypatch) -> None:
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 4096)
    with pytest.raises(ConfigError) as info:
        Engine.load(config_for(pair))
    message = str(info.value)
    assert "not enough device memory on cpu" in message and "target KV caches" in message
    assert "draft weights 0." in message and "MB" in message and "smaller or quantized draft" in message


def test_offloaded_target_plans_its_ring(pair) -> None:
    engine = Engine.load(config_for(pair, enabled=True, resident_layers=0))
    inputs = engine.memory_plan_inputs()
    layer_bytes = max(p.nbytes for p in engine.pair.target.hf_layers[0].parameters())
    assert inputs.streamed and inputs.loaded["offload ring"] >= 2 * layer_bytes
    assert inputs.loaded["target resident layers"] == 0
    assert engine.generate_ids([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))


def test_weights_that_do_not_fit_name_what_to_change(pair, monkeypatch) -> None:
    def out_of_memory(config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr("engine.runtime.load_pair", out_of_memory)
    with pytest.raises(ConfigError) as info:
        Engine.load(config_for(pair))
    assert info.value.field == "offload.enabled" and "Tried to allocate 2.00 GiB" in str(info.value)
    assert info.value.__context__ is None  # the failed load's frames are not kept alive



def fake_cuda_memory(monkeypatch, free: int, total: int, reserved: int, allocated: int, fraction: float | None):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    if fraction is None:
        monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    else:
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)


def test_free_device_memory_honours_a_per_process_memory_fraction(monkeypatch) -> None:
    """An 80 GB card capped at 23 GB (a 24 GB card emulated) with 10 GB allocated has 13 GB left,
    though the card itself has 60 GB free; without a cap, the card's free memory plus the allocator's
    unused cache."""
    gb, cuda = 10**9, torch.device("cuda", 0)
    fake_cuda_memory(monkeypatch, free=60 * gb, total=80 * gb, reserved=12 * gb, allocated=10 * gb, fraction=23 / 80)
    assert memory.free_device_memory(cuda) == 13 * gb
    fake_cuda_memory(monkeypatch, free=60 * gb, total=80 * gb, reserved=12 * gb, allocated=10 * gb, fraction=1.0)
    assert memory.free_device_memory(cuda) == 62 * gb
    fake_cuda_memory(monkeypatch, free=60 * gb, total=80 * gb, reserved=12 * gb, allocated=10 * gb, fraction=None)
    assert memory.free_device_memory(cuda) == 62 * gb


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plan_under_a_memory_fraction_refuses_instead_of_running_out(pair) -> None:
    """Under set_per_process_memory_fraction the plan sees the cap: a cap below what the plan must still
    allocate is refused at load (ConfigError), not met with an out-of-memory error later; a cap above it
    loads and generates."""
    config = dataclasses.replace(config_for(pair), model=dataclasses.replace(config_for(pair).model, device="cuda"))
    probe = Engine.load(config)
    to_allocate = memory_plan.plan_memory(probe.memory_plan_inputs()).to_allocate
    probe.close()
    del probe
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    weights = torch.cuda.memory_allocated() + 64 * 2**20  # what is allocated now, the tiny pair's weights and more
    try:
        torch.cuda.set_per_process_memory_fraction((weights + to_allocate // 2) / total)
        with pytest.raises(ConfigError, match="not enough device memory"):
            Engine.load(config)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((weights + 2 * to_allocate) / total)
        engine = Engine.load(config)
        assert engine.generate_ids([5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
        engine.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_draft_plan_holds_every_running_trees_forward_in_one_pass() -> None:
    """Lockstep growth: one draft pass expands every running tree's nodes together."""
    one = plan_memory(llama70b_inputs(LLAMA_1B, 2_470_000_000))
    four = plan_memory(llama70b_inputs(LLAMA_1B, 2_470_000_000, max_running=4, kv_slots=4))
    assert one.bytes_of("draft logits") == 128 * 128256 * 4 * 3
    assert four.bytes_of("draft logits") == 4 * 128 * 128256 * 4 * 3
    small = plan_memory(llama70b_inputs(LLAMA_1B, 2_470_000_000, max_running=4, budget=16))
    assert small.bytes_of("draft logits") == (2 * 16 + 4) * 128256 * 4 * 3  # the trees' nodes bound it


def test_draft_graphs_plan_their_masks_and_a_layers_gathered_keys_and_values() -> None:
    inputs = llama70b_inputs(LLAMA_1B, 2_470_000_000, max_context=4096, budget=1024, max_running=4, kv_slots=4)
    eager = plan_memory(inputs)
    graphs = plan_memory(dataclasses.replace(inputs, draft_graphs=True))
    held = graphs.bytes_of("draft graphs (masks, gathered KV)")
    gathered = 2 * 4 * 8194 * 8 * 64 * 2  # 4 segments x the widest span: the whole cache (4096 + 32 x 128 + 2)
    assert eager.bytes_of("draft graphs (masks, gathered KV)") == 0
    assert gathered < held <= draft_graphs.MASK_BYTES + gathered
    assert graphs.to_allocate - eager.to_allocate >= held
    check_fits(inputs, graphs, free_after_loading(inputs, CARD_24GB_FREE), "cuda:0")  # a 24 GB card holds them


def test_the_planned_graph_masks_bound_the_masks_a_run_makes(pair) -> None:
    """Masks the static passes allocate (CPU: the same buffers, uncaptured) across streams, budgets and
    depths, against the plan's bound for the engine's own inputs."""
    engine = Engine.load(dataclasses.replace(config_for(pair), speculation=SpeculationConfig(
        budget=32, max_depth=6, draft_graphs=True), limits=LimitsConfig(max_context=200, max_running=3)))
    graphs = engine.pair.draft.graphs
    assert graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for streams in (1, 3):
        for i in range(streams):
            engine.add_request(Request(f"s{streams}-{i}", [5 + i, 6, 7], params))
        while engine.num_running:
            engine.step()
    made = sum(static.mask.nbytes for static in graphs.passes.values())
    inputs = engine.memory_plan_inputs()
    assert inputs.draft_graphs and made > 0
    draft = inputs.draft
    _, capacity = memory_plan.cache_capacities(inputs.max_context, inputs.budget, inputs.max_depth, inputs.max_expand)
    gathered = 2 * inputs.max_running * capacity * draft.num_kv_heads * draft.head_dim * draft.dtype_bytes  # widest span
    planned = plan_memory(inputs).bytes_of("draft graphs (masks, gathered KV)")
    assert made <= planned - gathered


def test_the_auto_extension_factor_is_the_large_one_exactly_where_the_plan_is_the_same() -> None:
    """--extension-factor auto: 8 only where the memory plan with 8x extensions equals the plan with 2x (trees
    large enough that a draft forward is --max-expand rows a tree either way), 2 elsewhere and with a hybrid
    draft (its linear-attention rows grow with the factor); a number given is kept."""
    spec = SpeculationConfig()
    chosen = set()
    for budget in (16, 64, 256, 1024):
        for running in (1, 4, 8):
            factor = spec.extension_factor_for(False, budget, running)
            plans = [plan_memory(llama70b_inputs(LLAMA_1B, 2_470_000_000, budget=budget, max_running=running,
                                                 kv_slots=running, extension_factor=f)).total for f in (2, 8)]
            assert factor in (2, 8) and (factor == 8) == (plans[0] == plans[1]), (budget, running)
            chosen.add(factor)
    assert chosen == {2, 8}
    assert spec.extension_factor_for(True, 1024, 1) == 2
    assert SpeculationConfig(extension_factor=4).extension_factor_for(False, 16, 8) == 4


def test_an_engine_resolves_the_extension_factor_for_its_budget(tmp_path) -> None:
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=3)
    for budget, factor in ((256, 8), (16, 2)):
        config = EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)),
                              speculation=SpeculationConfig(budget=budget, overlap=True),
                              limits=LimitsConfig(max_context=512, max_running=2))
        with Engine.load(config) as engine:
            assert engine.config.speculation.extension_factor == factor
            assert engine.config.speculation.extension_budget(budget) == factor * budget
