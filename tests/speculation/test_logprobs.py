"""Log-probabilities of emitted tokens equal an independent reference.

The reference shares no code with the engine: one transformers forward of the target over prompt +
the engine's final completion, and at each completion position the log_softmax of that position's
logits processed by the documented meaning of each parameter (repetition penalty over prompt and
output so far, frequency and presence penalties, temperature, top_k, top_p, min_p; greedy: the raw
logits), in float64. Every token's log-prob and every reported alternative match within 1e-4, and
the alternatives are the most likely ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import FinishReason, Request, SamplingParams, TokenDelta, TokenLogprob
from tests.helpers.reference import penalise
from tests.helpers.speculation import NAMED_TREES
from tests.helpers.tiny_models import make_tiny_pair

TOLERANCE = 1e-4
PROMPT = [5, 6, 7, 8, 9, 10]
SHAPED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.4, frequency_penalty=0.3,
              repetition_penalty=1.2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("logprob-pair"), arch="llama", draft="noisy", seed=7,
                                   init_range=0.2)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float64).eval()  # exact within fp32 error


def load(pair, method: str, budget: int = 16) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(method=method, budget=budget, specinfer_temperature=NAMED_TREES),
        limits=LimitsConfig(max_context=256),
    ))


def reference_log_probs(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    """[vocab] raw logits -> float64 log-probs of the processed distribution (-inf where removed)."""
    out = penalise(logits, params, prompt, output)
    if params.temperature == 0.0:
        return out.log_softmax(-1)
    out = out / params.temperature
    if 0 < params.top_k < out.shape[0]:
        out[out < out.topk(params.top_k).values[-1]] = -math.inf
    if params.top_p < 1.0:
        probs = out.softmax(-1)
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        out[order[mass_before >= params.top_p]] = -math.inf
    if params.min_p > 0.0:
        probs = out.softmax(-1)
        out[probs < params.min_p * probs.max()] = -math.inf
    return out.log_softmax(-1)


@torch.no_grad()
def reference(model, prompt: list[int], output: list[int], params: SamplingParams) -> list[torch.Tensor]:
    """One [vocab] float64 log-prob row per output token, from one forward over prompt + output."""
    logits = model(torch.tensor([prompt + output])).logits[0]  # [len, vocab]
    return [reference_log_probs(logits[len(prompt) - 1 + t], params, prompt, output[:t]) for t in range(len(output))]


def run(engine: Engine, params: SamplingParams) -> tuple[list[int], list[TokenLogprob], list[TokenDelta]]:
    deltas = list(engine.generate(Request("lp", PROMPT, params)))
    for delta in deltas:
        assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs or []]
    return tokens, logprobs, deltas


def assert_matches(tokens: list[int], logprobs: list[TokenLogprob], rows: list[torch.Tensor], num_top: int) -> None:
    for pos, (token, got, want) in enumerate(zip(tokens, logprobs, rows, strict=True)):
        assert abs(got.logprob - float(want[token])) <= TOLERANCE, (pos, got.logprob, float(want[token]))
        assert len(got.top_ids) == len(got.top_logprobs) == num_top
        assert got.top_logprobs == sorted(got.top_logprobs, reverse=True)
        kth_largest = float(want.topk(num_top).values[-1]) if num_top else math.inf
        for top_id, top_lp in zip(got.top_ids, got.top_logprobs, strict=True):
            ref = float(want[top_id])
            if math.isinf(ref) or math.isinf(top_lp):  # a token processing removed (top_k, top_p, min_p)
                assert ref == top_lp == -math.inf, (pos, top_id, top_lp, ref)
            else:
                assert abs(top_lp - ref) <= TOLERANCE, (pos, top_id, top_lp, ref)
                assert top_lp >= kth_largest - TOLERANCE  # among the num_top most likely


@pytest.mark.parametrize("method", ["specexec", "specinfer", "autoregressive"])
def test_greedy_logprobs_are_the_raw_log_softmax(pair, target_model, method):
    engine = load(pair, method)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    tokens, logprobs, deltas = run(engine, params)
    assert len(tokens) == 40 and deltas[-1].finish_reason is FinishReason.LENGTH
    assert_matches(tokens, logprobs, reference(target_model, PROMPT, tokens, params), 5)
    assert all(lp.top_ids[0] == t for lp, t in zip(logprobs, tokens, strict=True))  # greedy takes the top one
    assert max(d.stats.num_emitted for d in deltas if d.stats) > 1 or method == "autoregressive"


@pytest.mark.parametrize("method", ["specexec", "specinfer"])
def test_sampled_logprobs_follow_the_processed_distribution(pair, target_model, method):
    engine = load(pair, method)
    params = SamplingParams(**SHAPED, seed=3, max_tokens=40, ignore_eos=True, logprobs=20)
    tokens, logprobs, _ = run(engine, params)
    rows = reference(target_model, PROMPT, tokens, params)
    assert_matches(tokens, logprobs, rows, 20)
    assert any(-math.inf in lp.top_logprobs for lp in logprobs)  # the shaping removed tokens somewhere
    plain = reference(target_model, PROMPT, tokens, SamplingParams(temperature=1.0))
    assert max(abs(lp.logprob - float(p[t])) for lp, p, t in zip(logprobs, plain, tokens, strict=True)) > 0.05


def test_zero_alternatives_and_greedy_penalties(pair, target_model):
    engine = load(pair, "specexec")
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, max_tokens=30,
                            ignore_eos=True, logprobs=0)
    tokens, logprobs, _ = run(engine, params)
    assert_matches(tokens, logprobs, reference(target_model, PROMPT, tokens, params), 0)


def test_no_logprobs_unless_asked_and_truncated_at_stop(pair):
    engine = load(pair, "specexec")
    free = engine.generate_ids(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert all(d.logprobs is None for d in engine.generate(Request("n", PROMPT, SamplingParams(max_tokens=5))))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(free[9],), logprobs=2)
    tokens, logprobs, deltas = run(engine, params)
    assert tokens == free[: free.index(free[9])] and len(logprobs) == len(tokens)
    assert deltas[-1].finish_reason is FinishReason.STOP


def test_logprobs_bound_is_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
