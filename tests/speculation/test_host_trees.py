"""--host-trees: SpecExec trees grow on the host while the draft runs on the device (Drafter.tree_device).

On a CPU the host is the device, so the CPU tests check the plumbing (the flag, where the trees and the stop
mask live, seeds and grammars through it) and exactness against transformers' own forward; the `cuda` tests
check the same with the draft on a GPU and its trees on the host."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation import search_tree
from engine.types import ConfigError, Request, SamplingParams
from tests.helpers.reference import plain_loop
from tests.helpers.speculation import config_from_flags
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    emitted: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.num_running:
        for delta in engine.step().deltas:
            emitted[delta.request_id] += delta.token_ids
    return emitted


def tree_devices(monkeypatch) -> list[str]:
    """The device type of every SpecExec tree when its search ends (recorded as SearchTree.tree runs)."""
    seen: list[str] = []
    finish = search_tree.SearchTree.tree

    def recorded(self, *args, **kwargs):
        seen.append(self.token_ids.device.type)
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(search_tree.SearchTree, "tree", recorded)
    return seen


def pair_engine(tmp_path, device: str, host_trees: bool, overlap: bool) -> tuple[Engine, str]:
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=4)
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(target), draft=str(draft), device=device, dtype="float32"),
        speculation=SpeculationConfig(budget=16, max_depth=6, overlap=overlap, host_trees=host_trees),
        limits=LimitsConfig(max_context=128)))
    return engine, str(target)


def test_the_flag_reaches_the_config() -> None:
    config = config_from_flags  # the CLI's config of these flags
    assert config("--host-trees", "on").speculation.host_trees is True
    assert config().speculation.host_trees is False
    with pytest.raises(ConfigError, match="--host-trees"):  # on or off only
        config("--host-trees", "auto")


@pytest.mark.parametrize("overlap", [False, True])
def test_host_trees_emit_the_targets_greedy_tokens(tmp_path, monkeypatch, overlap) -> None:
    engine, target = pair_engine(tmp_path, "cpu", host_trees=True, overlap=overlap)
    seen = tree_devices(monkeypatch)
    emitted = run(engine, PROMPTS, GREEDY)
    assert seen and set(seen) == {"cpu"}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        assert emitted[f"r{i}"] == plain_loop(model, prompt, GREEDY, 16)


def test_host_trees_leave_seeded_sampling_as_it_was(tmp_path) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    outputs = [run(pair_engine(tmp_path / str(on), "cpu", host_trees=on, overlap=True)[0], PROMPTS, params)
               for on in (False, True)]
    assert outputs[0] == outputs[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", [False, True])
def test_on_cuda_trees_grow_on_the_host_and_the_output_is_the_targets(tmp_path, monkeypatch, overlap) -> None:
    engine, target = pair_engine(tmp_path, "cuda", host_trees=True, overlap=overlap)
    seen = tree_devices(monkeypatch)
    emitted = run(engine, PROMPTS, GREEDY)
    assert seen and set(seen) == {"cpu"}  # the search ran on the host; the pass and verification on the GPU
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        assert emitted[f"r{i}"] == plain_loop(model, prompt, GREEDY, 16)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=16, ignore_eos=True)
    device_trees = pair_engine(tmp_path / "off", "cuda", host_trees=False, overlap=overlap)[0]
    assert run(engine, PROMPTS, params) == run(device_trees, PROMPTS, params)
