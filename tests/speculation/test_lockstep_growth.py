"""Draft growths advance in lockstep: each round, the forwards every still-growing tree asks for run as
one draft pass (one segment each). The driver alone (fake runner), then in an engine step."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.model.runner import Segment
from engine.runtime import Engine
from engine.speculation.drafter import run_growths
from engine.speculation.tree import Tree
from engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_tiny_pair


class FakeRunner:
    """Records each pass's segments; returns logits whose value is the segment's first input id."""

    def __init__(self):
        self.passes: list[list[int]] = []

    def forward_groups(self, groups):
        assert len(groups) == 1
        self.passes.append([int(s.input_ids[0]) for s in groups[0]])
        return [[torch.full((1, 3), float(s.input_ids[0])) for s in groups[0]]]


def growth(name: int, rounds: int) -> Iterator[Segment]:
    seen = []
    for r in range(rounds):
        logits = yield Segment(torch.tensor([name * 10 + r]), torch.tensor([0]), SimpleNamespace(), 0, None)
        seen.append(int(logits[0, 0]))
    tree = Tree.single(name, torch.device("cpu"))
    tree.seen = seen
    return tree


def test_each_round_is_one_pass_over_the_growths_still_running() -> None:
    runner = FakeRunner()
    trees = run_growths([(runner, growth(1, 2)), (runner, growth(2, 0)), (runner, growth(3, 3))])
    assert runner.passes == [[10, 30], [11, 31], [32]]
    assert [t.seen for t in trees] == [[10, 11], [], [30, 31, 32]]  # each got its own segment's logits
    assert [int(t.token_ids[0]) for t in trees] == [1, 2, 3]


def test_an_engine_step_grows_every_tree_in_shared_draft_passes(tmp_path) -> None:
    target_dir, draft_dir = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=11)
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(target_dir), draft=str(draft_dir)),
        speculation=SpeculationConfig(budget=16, max_depth=6),
        limits=LimitsConfig(max_context=256),
    ))  # fmt: skip
    draft = engine.pair.draft
    segments_per_pass: list[int] = []  # every draft pass of the step
    forward_groups = draft.forward_groups

    def counted(groups):
        segments_per_pass.append(sum(len(g) for g in groups))
        return forward_groups(groups)

    draft.forward_groups = counted
    prompts = [[5, 6, 7, 8], [40, 41, 42], [90, 12, 13, 14, 15]]
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    engine.step()  # admission: draft prefills, then the first trees
    segments_per_pass.clear()
    engine.step()
    assert segments_per_pass and max(segments_per_pass) == 3  # the three trees' forwards share passes
