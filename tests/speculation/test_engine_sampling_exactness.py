"""Sampled output of the real engine has the target's distribution with top_k, top_p and min_p, at
budgets above 16, alone and batched, for SpecExec (seeded: sample-and-match) and SpecInfer trees
(unseeded: rejection sampling), with the pair's draft and with the self-draft (--draft self, resident
and streamed from RAM); and greedy output in bf16 is the target's own bf16 choice.

The reference is the target alone: transformers' forward over every prefix of an 8-token vocabulary
(so 3 tokens have 512 outcomes to enumerate), processed by tests/speculation/test_sampling_exactness's
reference_probs (each parameter by its documented meaning, float64, no engine code)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.speculation import fix_unseeded_entropy
from tests.helpers.tiny_models import build_model, build_tokenizer, make_tiny_pair, save_checkpoint
from tests.speculation.test_sampling_exactness import chi_square_p, marginal, reference_probs

SAMPLED_LEN = 3
NUM_SAMPLES = 2_000
PROMPT = [3, 4, 5, 3]
PARAMS = dict(temperature=2.0, top_k=4, top_p=0.85, min_p=0.2)  # each option moves the law by 0.1-0.2 (total variation)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """An 8-token pair with flat-ish logits: every option above removes some tokens somewhere."""
    folder = tmp_path_factory.mktemp("engine-sampling")
    tokenizer = build_tokenizer()
    target = build_model("llama", 8, seed=5, init_range=0.3)
    draft = build_model("llama", 8, seed=6, init_range=0.3, hidden=32)
    return str(save_checkpoint(target, tokenizer, folder / "target")), str(save_checkpoint(draft, tokenizer, folder / "draft"))


@torch.no_grad()
def exact_distribution(target_dir: str, params: SamplingParams) -> dict[tuple[int, ...], float]:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    probs: dict[tuple[int, ...], float] = {}
    vocab = model.config.vocab_size
    for seq in itertools.product(range(vocab), repeat=SAMPLED_LEN):
        prob, counts = 1.0, [0] * vocab
        for k, token in enumerate(seq):
            logits = model(torch.tensor([PROMPT + list(seq[:k])])).logits[0, -1].double().tolist()
            prob *= reference_probs(logits, params, counts, set(PROMPT))[token]
            counts[token] += 1
        probs[seq] = prob
    return probs


def engine_for(pair: tuple[str, str], method: str, budget: int, max_running: int = 1, draft: str = "pair") -> Engine:
    """draft: the pair's ("pair"), or "self" (the target's 4-bit copy), resident or streamed from RAM
    ("self-ram"), with the draft growing trees during the target's pass ("self-ram-overlap")."""
    offload = OffloadConfig(enabled=True, resident_layers=1) if draft.startswith("self-ram") else OffloadConfig()
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1] if draft == "pair" else "self"),
        # method specexec: SpecExec trees at every temperature (no switch to SpecInfer trees for hot requests)
        speculation=SpeculationConfig(method=method, budget=budget, specinfer_temperature=3.0,
                                      overlap=draft.endswith("overlap")),
        offload=offload,
        limits=LimitsConfig(max_context=64, max_running=max_running),
    ))


def samples_from(engine: Engine, seeded: bool, batch: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for first in range(0, NUM_SAMPLES, batch):
        got: dict[str, list[int]] = {}
        for index in range(first, first + batch):
            params = SamplingParams(seed=index if seeded else None, max_tokens=SAMPLED_LEN, ignore_eos=True, **PARAMS)
            engine.add_request(Request(f"r{index}", PROMPT, params))
            got[f"r{index}"] = []
        while engine.num_running:
            step = engine.step()
            assert not step.failures
            for delta in step.deltas:
                got[delta.request_id].extend(delta.token_ids)
        out += [tuple(tokens) for tokens in got.values()]
    return out


CASES = [  # (method, budget, seeded, requests per pass, draft); one in the quick loop, the rest slow
    pytest.param("specexec", 32, True, 1, "pair", id="specexec-32-seeded"),
    pytest.param("specexec", 64, True, 4, "pair", id="specexec-64-seeded-batched", marks=pytest.mark.slow),
    pytest.param("specinfer", 32, False, 1, "pair", id="specinfer-32", marks=pytest.mark.slow),
    pytest.param("specinfer", 32, False, 4, "pair", id="specinfer-32-batched", marks=pytest.mark.slow),
    pytest.param("specexec", 32, True, 1, "self", id="specexec-32-seeded-self", marks=pytest.mark.slow),
    pytest.param("specinfer", 32, False, 4, "self-ram", id="specinfer-32-batched-self-ram", marks=pytest.mark.slow),
    pytest.param("specexec", 64, True, 4, "self-ram-overlap", id="specexec-64-seeded-batched-self-ram-overlap",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("method", "budget", "seeded", "batch", "draft"), CASES)
def test_engine_samples_follow_the_target(pair, method, budget, seeded, batch, draft, monkeypatch):
    exact = exact_distribution(pair[0], SamplingParams(**PARAMS))
    shaped = sum(1 for p in exact.values() if p == 0.0)
    assert shaped > 0  # top_k / top_p / min_p remove some continuations entirely
    fix_unseeded_entropy(monkeypatch)  # unseeded cases: the unseeded path, its draws the same every run
    engine = engine_for(pair, method, budget, max_running=batch, draft=draft)
    samples = samples_from(engine, seeded, batch)
    p_first = chi_square_p([s[:1] for s in samples], marginal(exact, 1))
    p_seq = chi_square_p(samples, exact)
    assert p_first > 1e-3 and p_seq > 1e-3, (p_first, p_seq)


BF16_TOKENS = 24
BF16_TIE = 0.07  # a bf16 logit of magnitude ~8 rounds by up to 0.03: a top-2 gap below this is a tie


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("bf16"), arch="llama", draft="noisy", seed=11)
    return str(target), str(draft)


@torch.no_grad()
def top2_gaps(model, prompt: list[int], tokens: list[int]) -> list[float]:
    gaps = []
    for k in range(len(tokens)):
        top = model(torch.tensor([prompt + tokens[:k]])).logits[0, -1].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    return gaps


def test_greedy_in_bf16_is_the_targets_own_bf16_choice(bf16_pair):
    """In bf16 a tree pass rounds differently from a one-token pass, so the engine's greedy text may part
    from the target's own bf16 greedy loop, but only where the target's top two logits are within
    bf16 rounding of each other; elsewhere it is token for token the same."""
    model = AutoModelForCausalLM.from_pretrained(bf16_pair[0], dtype=torch.bfloat16).eval()
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=bf16_pair[0], draft=bf16_pair[1], dtype="bfloat16"),
        speculation=SpeculationConfig(budget=32),
        limits=LimitsConfig(max_context=128),
    ))
    assert engine.pair.target.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    agree = 0
    for length in (1, 5, 12):
        prompt = torch.randint(3, model.config.vocab_size, (length,), generator=gen).tolist()
        want = reference_greedy(model, prompt, BF16_TOKENS)
        got = engine.generate_ids(prompt, SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True))
        first = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is None:
            agree += 1
            continue
        assert top2_gaps(model, prompt, want[: first + 1])[first] < BF16_TIE, (prompt, first)
    assert agree >= 2
