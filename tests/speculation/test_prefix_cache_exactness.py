"""Prefix-cache hits are exact: a request whose prompt KV comes partly from the prefix cache gives what
the target alone gives for its whole prompt, checked against a plain loop over transformers' forward
(tests/helpers/reference.py), never against the engine with the cache off. Greedy and seeded sampling,
resident and streamed from RAM:
- full hits: the same prompt again, and a second turn over the first turn's prompt + answer;
- a partial hit: a shared head then another tail (the shared KV is copied into another slot);
- hits after eviction: more distinct prompts than prefix-cache slots, one at a time and several running
  at once, so slots are overwritten and stale KV lies past the reused length.
The cached_tokens asserts pin which kind of hit each request is (engine/model/kv_pool.py's policy)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams, TokenDelta
from tests.helpers.reference import plain_loop
from tests.helpers.tiny_models import make_tiny_pair

_gen = torch.Generator().manual_seed(7)
HEAD = torch.randint(3, 300, (12,), generator=_gen).tolist()  # a shared "system prompt"
TAILS = [torch.randint(3, 300, (n,), generator=_gen).tolist() for n in (9, 5, 14, 7)]
NUM_TOKENS = 14
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=31, max_tokens=NUM_TOKENS, ignore_eos=True),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=5)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def reference(pair):
    """prompt, params -> the target alone's NUM_TOKENS tokens (memoised: prompts recur across tests)."""
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    memo: dict[tuple[tuple[int, ...], str], list[int]] = {}

    def get(prompt: list[int], kind: str) -> list[int]:
        key = (tuple(prompt), kind)
        if key not in memo:
            memo[key] = plain_loop(model, prompt, PARAMS[kind], NUM_TOKENS)
        return memo[key]

    return get


def load(pair, streamed: bool = False, **limits) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=16, max_depth=6),
        offload=OffloadConfig(enabled=True, source="ram", resident_layers=0) if streamed else OffloadConfig(),
        limits=LimitsConfig(max_context=256, **limits),
    ))


def run(engine: Engine, prompt: list[int], kind: str) -> tuple[list[int], int]:
    """(the tokens, cached_tokens) of one request run alone."""
    deltas = list(engine.generate(Request("r", prompt, PARAMS[kind])))
    return [t for d in deltas for t in d.token_ids], deltas[-1].totals.cached_tokens


kinds = pytest.mark.parametrize("kind", list(PARAMS))
residency = pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])


@kinds
@residency
def test_full_prefix_hits_equal_the_target_alone(pair, reference, kind, streamed) -> None:
    with load(pair, streamed, max_running=1, prefix_cache_slots=2) as engine:
        first = HEAD + TAILS[0]
        got, cached = run(engine, first, kind)
        assert (got, cached) == (reference(first, kind), 0)
        got, cached = run(engine, first, kind)  # the same prompt: everything but its last token is cached
        assert (got, cached) == (reference(first, kind), len(first) - 1)
        turn2 = first + got + TAILS[1]  # a second turn: the first turn's prompt and answer are cached
        got, cached = run(engine, turn2, kind)
        assert cached == len(first) + NUM_TOKENS - 1  # the answer's last token never had KV written
        assert got == reference(turn2, kind)


@kinds
@residency
def test_a_partial_hit_equals_the_target_alone(pair, reference, kind, streamed) -> None:
    with load(pair, streamed, max_running=1, prefix_cache_slots=2) as engine:
        x, y = HEAD + TAILS[0], HEAD + TAILS[2]
        assert run(engine, x, kind) == (reference(x, kind), 0)
        assert run(engine, y, kind) == (reference(y, kind), len(HEAD))  # HEAD's KV copied to another slot
        assert run(engine, x, kind) == (reference(x, kind), len(x) - 1)  # x's own slot kept all of x
        short = x[:7] + TAILS[3]  # shares less than HEAD with either slot
        assert run(engine, short, kind) == (reference(short, kind), 7)


@kinds
@residency
def test_hits_after_eviction_equal_the_target_alone(pair, reference, kind, streamed) -> None:
    """Two slots (one running, one for the cache), three prompts that share HEAD: every request after
    the first reuses HEAD from the most recent slot and overwrites the least recently used one."""
    with load(pair, streamed, max_running=1, prefix_cache_slots=1) as engine:
        assert len(engine.pool.slots) == 2
        x, y, z = (HEAD + tail for tail in TAILS[:3])
        assert run(engine, x, kind) == (reference(x, kind), 0)
        assert run(engine, y, kind) == (reference(y, kind), len(HEAD))
        assert run(engine, z, kind) == (reference(z, kind), len(HEAD))  # x's slot now holds z (x evicted)
        assert run(engine, x, kind) == (reference(x, kind), len(HEAD))  # y evicted; x's old KV is gone
        assert run(engine, z, kind) == (reference(z, kind), len(z) - 1)  # z's slot survived
        # that hit ran in x's slot (z's own slot, holding z's answer too, stays): x is evicted again
        assert run(engine, x, kind) == (reference(x, kind), len(HEAD))


@kinds
def test_many_requests_through_few_slots_equal_the_target_alone(pair, reference, kind) -> None:
    """Eight requests over four prompts that share HEAD, admitted as slots free up, two running at a
    time with one cache slot: hits of every kind happen while other requests run beside them."""
    prompts = [HEAD + TAILS[i % 4] for i in range(8)]
    with load(pair, max_running=2, prefix_cache_slots=1) as engine:
        assert len(engine.pool.slots) == 3
        waiting = [Request(f"r{i}", p, PARAMS[kind]) for i, p in enumerate(prompts)]
        deltas: dict[str, list[TokenDelta]] = {r.request_id: [] for r in waiting}
        while waiting or engine.num_running:
            while waiting and engine.can_add:
                engine.add_request(waiting.pop(0))
            output = engine.step()
            assert not output.failures
            for delta in output.deltas:
                deltas[delta.request_id].append(delta)
    for i, prompt in enumerate(prompts):
        assert [t for d in deltas[f"r{i}"] for t in d.token_ids] == reference(prompt, kind), i
    cached = [deltas[f"r{i}"][-1].totals.cached_tokens for i in range(8)]
    assert cached[:2] == [0, 0]  # both start on empty slots, side by side
    assert all(c >= len(HEAD) for c in cached[2:]), cached  # every later one reuses at least HEAD
