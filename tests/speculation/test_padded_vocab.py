"""A target vocabulary padded further than the draft's embedding (Qwen2.5-72B: 152064 rows, its
1.5B draft: 151936, both past the tokenizer's 151665).

The target favours ids in its padded region (tests/helpers/padded_vocab.py), so it emits ids the
draft cannot embed; one prompt holds such an id too. The draft never
proposes them and is fed a fallback id for them; greedy output equals transformers' greedy generate
on the target, in every mode: resident, streamed from RAM and from disk, batched, SpecExec and
SpecInfer trees, autoregressive. Seeded sampling stays inside the target's vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.padded_vocab import make_padded_pair, prompts
from tests.helpers.speculation import NAMED_TREES

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory) -> tuple[str, str, int]:
    """(target folder, draft folder, draft embedding rows)."""
    return make_padded_pair(tmp_path_factory.mktemp("padded-vocab"))


@pytest.fixture(scope="module")
def references(padded_pair) -> list[list[int]]:
    target_dir, _, draft_rows = padded_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    refs = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts(draft_rows)]
    beyond = [t for ref in refs for t in ref if t >= draft_rows]
    assert len(beyond) >= 5, "the target must emit ids past the draft's embedding for this test to mean anything"
    return refs


def load(padded_pair, method: str, offload: str | None = None, budget: int = 16) -> Engine:
    target_dir, draft_dir, _ = padded_pair
    return Engine.load(EngineConfig(
        model=ModelConfig(target=target_dir, draft=draft_dir),
        speculation=SpeculationConfig(method=method, budget=budget, max_depth=8, specinfer_temperature=NAMED_TREES),
        offload=OffloadConfig(enabled=True, source=offload, resident_layers=0) if offload else OffloadConfig(),
        limits=LimitsConfig(max_context=128),
    ))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_the_draft_is_fed_a_fallback_id_for_target_ids_past_its_embedding(padded_pair) -> None:
    engine = load(padded_pair, "specexec")
    draft = engine.pair.draft
    assert engine.pair.target.vocab_size > draft.num_embeddings == padded_pair[2]
    assert draft.fallback_input_id == 2  # the draft's pad token
    assert engine.pair.target.fallback_input_id is None


@pytest.mark.parametrize(("method", "offload"), [
    ("specexec", None), ("specinfer", None), ("autoregressive", None),
    ("specexec", "ram"), ("specexec", "disk"), ("specinfer", "disk"),
])
def test_greedy_equals_the_target_alone(padded_pair, references, method, offload) -> None:
    engine = load(padded_pair, method, offload)
    for prompt, want in zip(prompts(padded_pair[2]), references, strict=True):
        assert engine.generate_ids(prompt, greedy()) == want


@pytest.mark.parametrize("offload", [None, "disk"])
def test_batched_greedy_equals_the_target_alone(padded_pair, references, offload) -> None:
    engine = load(padded_pair, "specexec", offload, budget=24)
    requests = [Request(f"r{i}", prompt, greedy()) for i, prompt in enumerate(prompts(padded_pair[2]))]
    for request in requests:
        engine.add_request(request)
    got: dict[str, list[int]] = {request.request_id: [] for request in requests}
    batch_sizes = set()
    while engine.num_running:
        output = engine.step()
        assert not output.failures
        for delta in output.deltas:
            got[delta.request_id] += delta.token_ids
            if delta.stats is not None:
                batch_sizes.add(delta.stats.batch_size)
    assert max(batch_sizes) == len(requests)
    assert [got[request.request_id] for request in requests] == references


@pytest.mark.parametrize("method", ["specexec", "specinfer", "rrs"])
def test_seeded_sampling_stays_in_the_target_vocabulary(padded_pair, method) -> None:
    engine = load(padded_pair, method)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = engine.generate_ids(prompts(padded_pair[2])[0], params)
    assert len(sampled) == NEW_TOKENS and max(sampled) < engine.pair.target.vocab_size
