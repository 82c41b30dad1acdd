"""DecoderRunner.compile_layers (the draft's layers through torch.compile, attention eager between them):
a compiled forward agrees with the eager one, and a pair whose draft runs compiled emits the target
alone's tokens (the draft only proposes). bench.gpu_check's draftpass section times it on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.model.runner import DecoderRunner, Segment
from engine.runtime import Engine
from engine.speculation.tree import causal_mask
from engine.types import Request, SamplingParams
from tests.helpers.reference import plain_loop
from tests.helpers.tiny_models import build_model, make_tiny_pair


def tree_pass(runner: DecoderRunner, rows: int) -> torch.Tensor:
    """Logits [rows, vocab] of a tree-shaped segment after a 12-token prefix (fresh cache each call)."""
    cache = runner.new_cache(64)
    runner.prefill(torch.arange(3, 15), cache, 16)
    cache.length = 12
    generator = torch.Generator().manual_seed(rows)
    allowed = torch.cat([torch.ones(rows, 12, dtype=torch.bool),
                         causal_mask(rows, 0, torch.device("cpu")) & (torch.rand(rows, rows, generator=generator) < 0.6)
                         | torch.eye(rows, dtype=torch.bool)], dim=1)
    positions = 12 + torch.randint(0, 4, (rows,), generator=generator)
    ids = torch.randint(3, runner.vocab_size, (rows,), generator=generator)
    return runner.forward_groups([[Segment(ids, positions, cache, 12, allowed)]])[0][0]


def test_compiled_layers_agree_with_eager_at_every_tree_size() -> None:
    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2))
    with torch.inference_mode():
        eager = {rows: tree_pass(runner, rows) for rows in (1, 5, 9)}
        eager_forward = runner.layer_forwards[0]
        runner.compile_layers()
        assert len({id(f) for f in runner.layer_forwards}) == 1  # one compiled forward for the layer class
        assert runner.layer_forwards[0] is not eager_forward
        for rows, logits in eager.items():
            torch.testing.assert_close(tree_pass(runner, rows), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("streams", [1, 2])
def test_a_compiled_draft_leaves_the_output_the_targets(tmp_path, streams) -> None:
    target_path, draft_path = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=4)
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(target_path), draft=str(draft_path)),
        speculation=SpeculationConfig(budget=16, max_depth=6), limits=LimitsConfig(max_context=128)))
    engine.pair.draft.compile_layers()
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]][:streams]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    emitted: dict[str, list[int]] = {f"r{i}": [] for i in range(streams)}
    while engine.num_running:
        for delta in engine.step().deltas:
            emitted[delta.request_id] += delta.token_ids
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert emitted[f"r{i}"] == plain_loop(target, prompt, params, 16)
