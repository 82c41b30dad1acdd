"""Per-request trees: a specexec engine grows SpecInfer trees for unseeded sampled requests at
speculation.specinfer_temperature or above, SpecExec trees otherwise (seeded requests keep them, so
their text stays a function of seed and position); requests of both kinds share target passes and
stay exact (greedy against transformers' own generate). SpecInfer's sampling exactness is tested in
test_sampling_exactness and, through the engine, test_penalty_exactness and test_sampling_ranges."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import (
    ConfigError,
    EngineConfig,
    LimitsConfig,
    ModelConfig,
    OffloadConfig,
    SpeculationConfig,
)
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.speculation import NAMED_TREES
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [90, 12]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=5)
    return str(target), str(draft)


def load(pair, source: str | None = None, **spec) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=16, max_depth=6, **spec),
        limits=LimitsConfig(max_context=256),
        offload=OffloadConfig(enabled=True, source=source, resident_layers=0) if source else OffloadConfig(),
    ))  # fmt: skip


def sampled(temperature: float, seed: int | None = 3) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "method,greedy,temperature,seeded,switch,want",
    [
        ("specexec", True, 0.0, False, 0.85, "specexec"),
        ("specexec", False, 0.6, False, 0.85, "specexec"),
        ("specexec", False, 0.85, False, 0.85, "specinfer"),
        ("specexec", False, 1.3, False, 0.85, "specinfer"),
        ("specexec", False, 1.3, True, 0.85, "specexec"),
        ("specexec", False, 2.0, False, NAMED_TREES, "specexec"),
        ("specinfer", False, 0.3, True, 0.85, "specinfer"),
        ("autoregressive", False, 1.0, False, 0.85, "autoregressive"),
        ("rrs", True, 0.0, False, 0.85, "specexec"),  # greedy: SpecExec's trees, what RRS reduces to at T = 0
        ("rrs", False, 0.3, True, 0.85, "rrs"),
        ("rrs", False, 1.0, False, 0.85, "rrs"),
    ],
)
def test_tree_method(method, greedy, temperature, seeded, switch, want) -> None:
    spec = SpeculationConfig(method=method, specinfer_temperature=switch)
    assert spec.tree_method(greedy, temperature, seeded) == want


def test_the_startup_log_names_the_rule() -> None:
    assert SpeculationConfig().describe() == (
        "specexec, budget 64; SpecInfer trees for unseeded requests at temperature >= 0.85"
    )
    assert SpeculationConfig(specinfer_temperature=NAMED_TREES).describe() == "specexec, budget 64"
    assert SpeculationConfig(method="specinfer", budget="auto").describe() == "specinfer, budget auto"


def test_the_switch_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="speculation.specinfer_temperature"):
        SpeculationConfig(specinfer_temperature=0.0)


def specinfer_steps(deltas) -> list[bool]:
    """Per step with a tree beyond the root: whether it was a SpecInfer tree (no sample-and-match
    expectation is reported for those)."""
    return [d.stats.expected_accepted is None for d in deltas if d.stats is not None and d.stats.tree_size > 1]


def test_hot_unseeded_requests_grow_specinfer_trees(pair) -> None:
    default, specexec = load(pair), load(pair, specinfer_temperature=NAMED_TREES)
    hot = list(default.generate(Request("hot", PROMPTS[0], sampled(1.0, seed=None))))
    assert sum(len(d.token_ids) for d in hot) == 24 and all(specinfer_steps(hot)) and specinfer_steps(hot)
    for temperature in (0.6, 1.0):  # cool, or seeded: SpecExec trees, the same text as with no switch
        deltas = list(default.generate(Request("seeded", PROMPTS[0], sampled(temperature))))
        assert not any(specinfer_steps(deltas))
        assert [t for d in deltas for t in d.token_ids] == specexec.generate_ids(PROMPTS[0], sampled(temperature))


def test_both_kinds_of_tree_share_a_pass_and_stay_exact(pair) -> None:
    engine = load(pair)
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [Request("greedy", PROMPTS[0], greedy), Request("seeded", PROMPTS[1], sampled(1.2)),
                Request("hot", PROMPTS[2], sampled(1.2, seed=None))]  # fmt: skip
    seeded_alone = engine.generate_ids(PROMPTS[1], sampled(1.2))
    for request in requests:
        engine.add_request(request)
    out: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.num_running:
        step = engine.step()
        assert not step.failures
        for delta in step.deltas:
            out[delta.request_id].append(delta)
    assert max(d.stats.batch_size for d in out["hot"] if d.stats) == 3
    assert all(specinfer_steps(out["hot"])) and not any(specinfer_steps(out["seeded"]))
    tokens = {name: [t for d in deltas for t in d.token_ids] for name, deltas in out.items()}
    assert tokens["greedy"] == reference_greedy(model, PROMPTS[0], 24)
    assert tokens["seeded"] == seeded_alone  # seeded draws do not depend on the batch
    assert len(tokens["hot"]) == 24


def test_rrs_trees_share_a_pass_with_greedy_and_a_seed_repeats_alone(pair) -> None:
    """method rrs: greedy requests grow SpecExec trees and equal transformers' greedy while sampled
    RRS requests share their passes; a seeded sampled request repeats when run alone on a fresh
    engine (its seed fixes its random stream; the trees' shape learns from earlier requests: README
    "Seeds")."""
    engine = load(pair, method="rrs")
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded_alone = engine.generate_ids(PROMPTS[1], sampled(0.8))
    assert load(pair, method="rrs").generate_ids(PROMPTS[1], sampled(0.8)) == seeded_alone
    requests = [Request("greedy", PROMPTS[0], greedy), Request("hot", PROMPTS[2], sampled(1.0, seed=None))]
    for request in requests:
        engine.add_request(request)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.num_running:
        step = engine.step()
        assert not step.failures
        for delta in step.deltas:
            out[delta.request_id].extend(delta.token_ids)
    assert out["greedy"] == reference_greedy(model, PROMPTS[0], 24)
    assert len(out["hot"]) == 24


@pytest.mark.parametrize("source", ["ram", "disk"])
def test_a_seeded_rrs_request_streamed_equals_it_resident(pair, source) -> None:
    """RRS verification reads the streamed target's logits: with every layer streamed, a seeded RRS
    request (same trees, same random stream) emits what it emits resident, whose distribution
    test_rrs_exactness checks against the reference."""
    resident = load(pair, method="rrs").generate_ids(PROMPTS[1], sampled(0.8))
    assert load(pair, source, method="rrs").generate_ids(PROMPTS[1], sampled(0.8)) == resident


def test_rrs_requests_start_from_the_evidence_of_earlier_ones_with_their_settings(pair) -> None:
    """The shape book: after a sampled RRS request, the next one with the same sampling settings
    starts from what its trees showed (verified acceptance in (rank, pi) cells); other settings
    start from the prior. Exactness with a book: test_rrs_exactness."""
    engine = load(pair, method="rrs")
    engine.generate_ids(PROMPTS[1], sampled(0.8))
    book = engine.shape_book
    seen = book.shape(sampled(0.8, seed=None), constrained=False)
    assert float(seen.own.counts.sum()) > 0
    assert torch.equal(seen.own.sums, book.settings[(0.8, 1.0, 0, 0.0, False)].sums)
    assert float(book.shape(sampled(1.0), constrained=False).own.counts.sum()) == 0  # another temperature
    assert float(book.shape(sampled(0.8), constrained=True).own.counts.sum()) == 0  # a grammar's
    before = float(book.settings[(0.8, 1.0, 0, 0.0, False)].counts.sum())
    engine.generate_ids(PROMPTS[2], sampled(0.8, seed=None))
    assert float(book.settings[(0.8, 1.0, 0, 0.0, False)].counts.sum()) != before  # it keeps learning
