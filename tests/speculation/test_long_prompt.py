"""Prompts longer than one prefill chunk (engine/speculation/step.py PREFILL_CHUNK): a ~1,100-token prompt
is written in three chunks, alone or in the same target pass as another request's prompt or tree, with
the target resident or streamed from RAM; greedy output equals transformers' own greedy generate on the
whole prompt. A second long prompt that shares only a head with the first prefills its rest (two
chunks) after a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation.step import PREFILL_CHUNK
from engine.types import Request, SamplingParams, TokenDelta
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

_gen = torch.Generator().manual_seed(3)
LONG = torch.randint(3, 300, (1100,), generator=_gen).tolist()  # three chunks, the last one short
SHARED = 300  # LONG2 shares LONG's first 300 tokens, then 760 of its own: two chunks after a cache hit
LONG2 = LONG[:SHARED] + torch.randint(3, 300, (760,), generator=_gen).tolist()
SHORT = [5, 17, 42, 9, 77]
NUM_TOKENS = {"long": 20, "long2": 16, "short": 24}
PROMPTS = {"long": LONG, "long2": LONG2, "short": SHORT}
residency = pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=8, max_positions=2048
    )
    return str(target), str(draft)


@pytest.fixture(scope="module")
def references(pair) -> dict[str, list[int]]:
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    return {name: reference_greedy(model, PROMPTS[name], NUM_TOKENS[name]) for name in PROMPTS}


def load(pair, streamed: bool, prefill_slice: int = 0) -> Engine:
    """prefill_slice 0 (auto) may split a prompt that joins running requests; a slice as long as the
    prompt keeps the whole prompt in the pass it joins (slices: tests/speculation/test_step_isolation.py)."""
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=16, max_depth=6),
        offload=OffloadConfig(enabled=True, source="ram", resident_layers=0) if streamed else OffloadConfig(),
        limits=LimitsConfig(max_context=1200, max_running=2, prefix_cache_slots=1, prefill_slice=prefill_slice),
    ))


def request(name: str) -> Request:
    return Request(name, PROMPTS[name], SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS[name], ignore_eos=True))


def run_all(engine: Engine, joins: dict[int, list[str]]) -> dict[str, list[TokenDelta]]:
    """Step until nothing runs; the requests named in joins[k] are added before step k."""
    deltas: dict[str, list[TokenDelta]] = {}
    step = 0
    while step <= max(joins) or engine.num_running:
        for name in joins.get(step, []):
            engine.add_request(request(name))
            deltas[name] = []
        output = engine.step()
        assert not output.failures
        for delta in output.deltas:
            deltas[delta.request_id].append(delta)
        step += 1
    return deltas


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_the_prompts_span_several_chunks() -> None:
    assert 2 * PREFILL_CHUNK < len(LONG) < 3 * PREFILL_CHUNK
    assert PREFILL_CHUNK < len(LONG2) - SHARED < 2 * PREFILL_CHUNK


@residency
def test_a_long_prompt_alone_equals_the_reference(pair, references, streamed) -> None:
    with load(pair, streamed) as engine:
        first = list(engine.generate(request("long")))
        assert tokens(first) == references["long"]
        assert first[0].stats.pass_tokens == len(LONG) - 1 + first[0].stats.tree_size  # the whole prompt in one pass
        second = list(engine.generate(request("long2")))
        assert second[-1].totals.cached_tokens == SHARED
        assert tokens(second) == references["long2"]


@residency
def test_a_long_prompt_batched_with_a_short_request_equals_the_reference(pair, references, streamed) -> None:
    """Both prompts in the first pass; then the long prompt joining while the short request decodes
    (its three chunks and the short request's tree in one pass)."""
    with load(pair, streamed) as engine:
        together = run_all(engine, {0: ["long", "short"]})
        assert together["long"][0].stats.batch_size == 2
        assert together["long"][0].stats.pass_tokens == len(LONG) - 1 + len(SHORT) - 1 + sum(
            together[name][0].stats.tree_size for name in ("long", "short"))
    with load(pair, streamed, prefill_slice=len(LONG)) as engine:  # a fresh engine: no prefix-cache hit
        joining = run_all(engine, {0: ["short"], 2: ["long"]})
        assert joining["long"][0].stats.batch_size == 2 and joining["long"][-1].totals.cached_tokens == 0
    for deltas in (together, joining):
        assert tokens(deltas["long"]) == references["long"]
        assert tokens(deltas["short"]) == references["short"]


def test_a_long_prompt_joining_in_automatic_slices_equals_the_reference(pair) -> None:
    """prefill_slice 0 (auto, engine.pass_times): the long prompt joins a running request and is written
    in slices sized from the passes seen, over several passes; both outputs equal the reference."""
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    long_short = Request("short", SHORT, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    want_short = reference_greedy(model, SHORT, 80)
    with load(pair, streamed=True) as engine:
        engine.add_request(long_short)
        got: dict[str, list[int]] = {"short": [], "long": []}
        passes_before_first_token, step = 0, 0
        while engine.num_running:
            if step == 1:
                engine.add_request(request("long"))
            output = engine.step()
            assert not output.failures
            for delta in output.deltas:
                got[delta.request_id] += delta.token_ids
            if step >= 1 and not got["long"]:
                passes_before_first_token += 1
            step += 1
    assert passes_before_first_token >= 2  # the prompt was written in slices, not in the pass it joined
    assert got["long"] == reference_greedy(model, LONG, NUM_TOKENS["long"])
    assert got["short"] == want_short
