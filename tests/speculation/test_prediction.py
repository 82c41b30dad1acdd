"""Predicted outputs (engine.speculation.prediction): a prediction grafted into each SpecExec tree as a
chain. Whatever it says, greedy and seeded sampled output equal the target alone's (a plain loop over
transformers' forward); a prediction of the answer itself makes passes accept far more tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation import step
from engine.speculation.prediction import Prediction, graft_chain
from engine.speculation.tree import Tree
from engine.types import Request, SamplingParams
from tests.helpers.reference import plain_loop
from tests.helpers.think_model import make_think_pair
from tests.helpers.tiny_models import make_tiny_pair
from tests.speculation.test_reasoning_exactness import JSON_SPEC

TOKENS = 24


def small_tree() -> Tree:
    """root -> 5 -> 6, root -> 7: score-ordered, parents first."""
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    return Tree(token_ids=torch.tensor([1, 5, 7, 6]), parents=torch.tensor([-1, 0, 0, 1]),
                depths=torch.tensor([0, 1, 1, 2]), scores=torch.tensor([0.0, -0.5, -1.0, -1.5]),
                ancestors=ancestors, draft_slots=torch.tensor([3, 4, -1, -1]))


def check_tree(tree: Tree) -> None:
    """Parents precede children, depths follow parents, ancestors match the parents, scores never rise."""
    parents = tree.parents.tolist()
    for node in range(1, tree.num_nodes):
        assert parents[node] < node and tree.depths[node] == tree.depths[parents[node]] + 1
        expected = {node}
        walk = parents[node]
        while walk >= 0:
            expected.add(walk)
            walk = parents[walk]
        assert set(tree.ancestors[node].nonzero().squeeze(1).tolist()) == expected
    assert (tree.scores[1:] <= tree.scores[:-1]).all()


def test_graft_follows_existing_nodes_then_appends() -> None:
    grafted = graft_chain(small_tree(), [5, 6, 9, 9], max_nodes=10)
    check_tree(grafted)
    assert grafted.token_ids.tolist() == [1, 5, 7, 6, 9, 9] and grafted.parents.tolist()[4:] == [3, 4]
    assert grafted.predicted == 2 and grafted.draft_slots.tolist()[4:] == [-1, -1]
    assert graft_chain(small_tree(), [5, 6], max_nodes=10).predicted == 0  # the tree spells it already


def test_graft_cuts_the_tree_to_stay_within_its_nodes() -> None:
    grafted = graft_chain(small_tree(), [7, 8, 8], max_nodes=5)  # node 7 kept, the tree cut to 3 nodes
    check_tree(grafted)
    assert grafted.token_ids.tolist() == [1, 5, 7, 8, 8] and grafted.parents.tolist() == [-1, 0, 0, 2, 3]
    assert grafted.predicted == 2
    grafted = graft_chain(small_tree(), [5, 6, 8], max_nodes=4)  # node 6 (index 3) is cut: spelled again
    check_tree(grafted)
    assert grafted.token_ids.tolist() == [1, 5, 6, 8] and grafted.parents.tolist() == [-1, 0, 1, 2]
    assert grafted.predicted == 2


def test_the_prediction_follows_the_answer_and_finds_it_again() -> None:
    prediction = Prediction([10, 11, 12, 13, 14, 15, 16, 12, 13, 17])
    assert prediction.chain(3) == [10, 11, 12]
    prediction.advance([10, 11], [10, 11])
    assert prediction.position == 2 and prediction.accepted == 2
    prediction.advance([10, 11, 99, 14], [99, 14])  # left it: "99 14" and "11 99" are not in it
    assert prediction.position == len(prediction.token_ids) and prediction.accepted == 2
    prediction.advance([10, 11, 99, 14, 15], [15])  # "14 15" is: on from 16
    assert prediction.chain(3) == [16, 12, 13] and prediction.accepted == 2
    prediction.position = 1
    assert prediction.find([12, 13]) == 4  # the nearest occurrence at or after where it stood
    prediction.position = 6
    assert prediction.find([12, 13]) == 9
    assert prediction.find([9, 12, 13]) == 9  # the longest tail that occurs: "12 13"


def run(tmp_path, prompts, params, predictions, overlap=False, budget=16, source=None):
    """source: None (resident), "ram" or "disk" (the target streamed, one layer resident)."""
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=4)
    offload = OffloadConfig() if source is None else OffloadConfig(enabled=True, resident_layers=1, source=source)
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(target), draft=str(draft)),
        speculation=SpeculationConfig(budget=budget, max_depth=6, overlap=overlap), offload=offload,
        limits=LimitsConfig(max_context=160, max_running=2)))
    for i, (prompt, prediction) in enumerate(zip(prompts, predictions, strict=True)):
        engine.add_request(Request(f"r{i}", prompt, params, prediction_ids=prediction))
    emitted = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.num_running:
        steps += 1
        for delta in engine.step().deltas:
            emitted[delta.request_id] += delta.token_ids
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return emitted, steps, reference


@pytest.mark.parametrize("overlap,temperature,seed,source", [
    (False, 0, None, None), (True, 0, None, None), (False, 0.9, 3, None), (True, 0, None, "ram"),
    (False, 0.9, 3, "disk")])
def test_the_answer_as_its_own_prediction_takes_fewer_steps_and_the_same_tokens(tmp_path, overlap, temperature,
                                                                                 seed, source) -> None:
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=TOKENS, ignore_eos=True)
    plain, plain_steps, reference = run(tmp_path / "a", [prompt], params, [None], overlap, source=source)
    answer = plain_loop(reference, prompt, params, TOKENS)
    assert plain["r0"] == answer
    predicted, steps, _ = run(tmp_path / "b", [prompt], params, [answer], overlap, source=source)
    assert predicted["r0"] == answer
    assert steps <= plain_steps // 2, (steps, plain_steps)  # chains of up to 6 (max_depth) a pass


@pytest.mark.parametrize("temperature,seed", [(0, None), (0.9, 3)])
def test_a_wrong_prediction_changes_nothing(tmp_path, temperature, seed) -> None:
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=TOKENS, ignore_eos=True)
    wrong = [list(range(100, 140)), [3, 4] * 20]
    emitted, _, reference = run(tmp_path, prompts, params, wrong)
    for i, prompt in enumerate(prompts):
        assert emitted[f"r{i}"] == plain_loop(reference, prompt, params, TOKENS)


def test_a_half_right_prediction_is_found_again(tmp_path) -> None:
    """The answer with a few tokens changed in the middle: after the change the answer's tail is found in
    the prediction again, and the passes after it accept its chain."""
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    _, plain_steps, reference = run(tmp_path / "a", [prompt], params, [None])
    answer = plain_loop(reference, prompt, params, TOKENS)
    edited = answer[:8] + [200, 201, 202] + answer[8:]  # text the answer does not have
    emitted, steps, _ = run(tmp_path / "b", [prompt], params, [edited])
    assert emitted["r0"] == answer
    assert steps < plain_steps, (steps, plain_steps)


def test_under_a_grammar_a_prediction_changes_nothing(tmp_path, monkeypatch) -> None:
    """JSON under a schema on the thinking bigram pair (tests/helpers/think_model.py): speculative greedy with
    the answer as its prediction, or a wrong one, equals autoregressive greedy under the same grammar."""
    target, draft = make_think_pair(tmp_path)
    base = Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)),
                                    speculation=SpeculationConfig(budget=16), limits=LimitsConfig(max_context=256)))
    prompt = base.tokenizer.encode("Pick a color.", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_output=JSON_SPEC)

    def generate(engine: Engine, prediction: list[int] | None) -> tuple[list[int], int]:
        deltas = list(engine.generate(Request("r", prompt, params, prediction_ids=prediction)))
        return [t for d in deltas for t in d.token_ids], len(deltas)

    answer, _ = generate(base.with_speculation(SpeculationConfig(method="autoregressive")), None)
    assert base.tokenizer.decode(answer).startswith("{")
    grafted: list[int] = []  # chain nodes the verified trees held (the draft already writes this JSON well)

    def graft(tree, chain, max_nodes):
        tree = graft_chain(tree, chain, max_nodes)
        grafted.append(tree.predicted)
        return tree

    monkeypatch.setattr(step, "graft_chain", graft)
    for prediction in (answer, answer[:3] + [7, 8, 9] + answer[3:], list(range(10, 40))):
        grafted.clear()
        assert generate(base, prediction)[0] == answer
        assert grafted and (prediction is answer or sum(grafted) > 0)


def test_greedy_chains_reach_past_the_depth_cap(tmp_path) -> None:
    """The answer as its own prediction, budget 64 and max_depth 6: chains of up to 32 tokens a pass (half
    the budget), not 6, and the plain loop's tokens."""
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    _, _, reference = run(tmp_path / "a", [prompt], params, [None])
    answer = plain_loop(reference, prompt, params, TOKENS)
    predicted, steps, _ = run(tmp_path / "b", [prompt], params, [answer], budget=64)
    assert predicted["r0"] == answer
    assert steps <= 3, steps  # the prompt's step, then the 24 tokens in one or two passes (6 + 1 a pass: 4)
