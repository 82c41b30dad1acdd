"""Penalties are exact: the engine's output equals a plain reference loop over the target alone.

The reference shares no code with the engine: each token is `model(input_ids).logits[0, -1]` of
the transformers model, penalised by the documented meaning of each parameter, then argmax (greedy)
or the exact softmax (sampled):
- frequency_penalty (OpenAI): subtract penalty x the token's count in the generated text so far;
- presence_penalty (OpenAI): subtract penalty once if the token was generated so far;
- repetition_penalty (HF/vLLM): a token seen in the prompt or the generated text has its positive
  logit divided by the penalty and its negative logit multiplied by it.
Applied in vLLM's order: repetition, then frequency and presence, then temperature.

A greedy mismatch at a floating-point near-tie (top-2 reference gap below TIE_GAP) counts as a tie,
as in tests/model/test_equivalence.py. Also here: a draft whose vocabulary is padded past the
target's drafts only the target's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.reference import penalise
from tests.helpers.speculation import NAMED_TREES
from tests.helpers.tiny_models import build_model, build_tokenizer, make_tiny_pair, save_checkpoint
from tests.speculation.test_sampling_exactness import chi_square_p, marginal

NEW_TOKENS = 64
TIE_GAP = 1e-4
BUDGETS = [1, 4, 16, 64]
PENALTIES = {
    "frequency": dict(frequency_penalty=1.0),
    "negative-frequency": dict(frequency_penalty=-1.0),
    "presence": dict(presence_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "all": dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.3),
}


@torch.no_grad()
def reference_greedy(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """The target alone, one full forward per token: (tokens, top-2 gap of each step's logits)."""
    output: list[int] = []
    gaps: list[float] = []
    for _ in range(NEW_TOKENS):
        logits = penalise(model(torch.tensor([prompt + output])).logits[0, -1], params, prompt, output)
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        output.append(int(logits.argmax()))
    return output, gaps


def first_difference(got: list[int], want: list[int], gaps: list[float]) -> tuple[bool, bool]:
    """(mismatch, tie): a first difference at a near-tie counts as a tie, not a mismatch."""
    for pos, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            tie = gaps[pos] < TIE_GAP
            return not tie, tie
    return len(got) != len(want), False


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("penalty-pair"), arch="llama", draft="noisy", seed=11)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(pair):
    """(method, budget, draft) -> Engine; one loaded pair per draft (the pair's, and the self-draft: the
    target's 4-bit copy) shared by every speculation setting."""
    out = {}
    for draft in ("pair", "self"):
        base = Engine.load(EngineConfig(
            model=ModelConfig(target=pair[0], draft=pair[1] if draft == "pair" else "self"),
            speculation=SpeculationConfig(budget=max(BUDGETS)),
            limits=LimitsConfig(max_context=256),
        ))
        out.update({
            (method, budget, draft): base.with_speculation(SpeculationConfig(method=method, budget=budget,
                                                                             specinfer_temperature=NAMED_TREES))
            for method in ("specexec", "specinfer") for budget in BUDGETS
        })
    return out


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (1, 3, 10)]


GREEDY_CASES = [  # one case in the quick subset (-m "not slow"), the rest slow
    pytest.param(method, penalty, "pair", id=f"{method}-{penalty}",
                 marks=() if (method, penalty) == ("specexec", "all") else pytest.mark.slow)
    for method in ("specexec", "specinfer") for penalty in PENALTIES
] + [pytest.param(method, "all", "self", id=f"{method}-all-self", marks=pytest.mark.slow)
     for method in ("specexec", "specinfer")]


@pytest.mark.parametrize(("method", "penalty", "draft"), GREEDY_CASES)
def test_greedy_with_penalties_equals_the_reference_loop(engines, target_model, method, penalty, draft):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **PENALTIES[penalty])
    mismatches, ties, acts = [], 0, False
    for prompt in prompts(target_model.config.vocab_size):
        want, gaps = reference_greedy(target_model, prompt, params)
        acts |= want != reference_greedy(target_model, prompt, SamplingParams(temperature=0.0))[0]
        for budget in BUDGETS:
            got = engines[(method, budget, draft)].generate_ids(prompt, params)
            mismatch, tie = first_difference(got, want, gaps)
            ties += tie
            if mismatch:
                mismatches.append((len(prompt), budget))
    assert acts  # the penalty really changes the output
    assert not mismatches, f"(prompt_len, budget) that differ from the reference: {mismatches}"
    assert ties <= 1


SAMPLED_LEN = 3  # K: the first K tokens' joint distribution is compared
NUM_SAMPLES = 2_000
SAMPLED_PARAMS = dict(temperature=1.2, frequency_penalty=-0.8, presence_penalty=0.6, repetition_penalty=1.5)


def save_pair(target, draft, tokenizer, folder: Path) -> tuple[str, str]:
    return str(save_checkpoint(target, tokenizer, folder / "target")), str(save_checkpoint(draft, tokenizer, folder / "draft"))


@pytest.fixture(scope="module")
def small_vocab_pairs(tmp_path_factory):
    """family -> an 8-token pair of that family (so K tokens have 8^K outcomes to enumerate), with
    flat-ish logits; the draft is a smaller model of the same family."""
    cache: dict[str, tuple[str, str]] = {}

    def get(family: str) -> tuple[str, str]:
        if family not in cache:
            target = build_model(family, 8, seed=5, init_range=0.3)
            draft = build_model(family, 8, seed=6, init_range=0.3, hidden=32)
            cache[family] = save_pair(target, draft, build_tokenizer(), tmp_path_factory.mktemp(f"small-vocab-{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def small_vocab_pair(small_vocab_pairs) -> tuple[str, str]:
    return small_vocab_pairs("llama")


@torch.no_grad()
def reference_distribution(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first SAMPLED_LEN tokens) under the target alone: penalised logits / temperature, softmax."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(SAMPLED_LEN):
        longer: dict[tuple[int, ...], float] = {}
        for seq, prob in probs.items():
            logits = penalise(model(torch.tensor([prompt + list(seq)])).logits[0, -1], params, prompt, list(seq))
            for token, p in enumerate((logits / params.temperature).softmax(-1).tolist()):
                longer[(*seq, token)] = prob * p
        probs = longer
    return probs


SAMPLED_CASES = [  # (family, method, budget): every method on Llama; today's families (q/k norms, sliding
    # windows, soft-capping, sinks) with SpecExec trees, and GPT-OSS with RRS's sampled trees too (~45 s each)
    *[("llama", method, budget) for method, budget in (("specexec", 1), ("specexec", 4), ("specinfer", 4), ("rrs", 4),
                                                      ("rrs", 16))],
    ("qwen3", "specexec", 4), ("gemma3", "specexec", 4), ("gpt_oss", "specexec", 4), ("gpt_oss", "rrs", 16),
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "method", "budget"), SAMPLED_CASES)
def test_sampled_with_penalties_follows_the_reference(small_vocab_pairs, family, method, budget):
    """Every step after the first has a generated root: a root counted twice shifts the K-token law."""
    target_dir, draft_dir = small_vocab_pairs(family)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=target_dir, draft=draft_dir),
        speculation=SpeculationConfig(method=method, budget=budget, specinfer_temperature=NAMED_TREES),
        limits=LimitsConfig(max_context=32),
    ))
    prompt = [3, 4, 5, 3]
    exact = reference_distribution(model, prompt, SamplingParams(**SAMPLED_PARAMS))
    samples = []
    for seed in range(NUM_SAMPLES):
        params = SamplingParams(seed=seed, max_tokens=SAMPLED_LEN, ignore_eos=True, **SAMPLED_PARAMS)
        samples.append(tuple(engine.generate_ids(prompt, params)))
    p_first = chi_square_p([s[:1] for s in samples], marginal(exact, 1))
    p_seq = chi_square_p(samples, exact)
    print(f"{family} {method} budget={budget}: p(first token)={p_first:.3g} p({SAMPLED_LEN} tokens)={p_seq:.3g}")
    assert p_first > 1e-3
    assert p_seq > 1e-3


@pytest.mark.slow
def test_batched_rrs_requests_sharing_a_shape_book_follow_the_reference(small_vocab_pair):
    """RRS requests four at a time, overlap off: every request's trees are shaped by the shape book,
    so by what its batch-mates and predecessors verified before its step; each request alone still
    follows the reference."""
    target_dir, draft_dir = small_vocab_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=target_dir, draft=draft_dir),
        speculation=SpeculationConfig(method="rrs", budget=16, overlap=False),
        limits=LimitsConfig(max_context=32, max_running=4),
    ))
    prompt = [3, 4, 5, 3]
    exact = reference_distribution(model, prompt, SamplingParams(**SAMPLED_PARAMS))
    samples = []
    for first in range(0, NUM_SAMPLES, 4):
        out: dict[str, list[int]] = {}
        for seed in range(first, first + 4):
            params = SamplingParams(seed=seed, max_tokens=SAMPLED_LEN, ignore_eos=True, **SAMPLED_PARAMS)
            engine.add_request(Request(f"s{seed}", prompt, params))
            out[f"s{seed}"] = []
        while engine.num_running:
            step = engine.step()
            assert not step.failures
            for delta in step.deltas:
                out[delta.request_id].extend(delta.token_ids)
        samples.extend(tuple(tokens) for tokens in out.values())
    assert len(engine.shape_book.settings) == 1
    p_first = chi_square_p([s[:1] for s in samples], marginal(exact, 1))
    p_seq = chi_square_p(samples, exact)
    print(f"rrs batched: p(first token)={p_first:.3g} p({SAMPLED_LEN} tokens)={p_seq:.3g}")
    assert p_first > 1e-3
    assert p_seq > 1e-3


@pytest.fixture(scope="module")
def padded_draft_pair(tmp_path_factory) -> tuple[str, str]:
    """The draft's embedding and head padded 16 rows past the shared tokenizer (as many drafts are)."""
    tokenizer = build_tokenizer()
    target = build_model("llama", len(tokenizer), seed=21, eos_token_id=tokenizer.eos_token_id)
    draft = build_model("llama", len(tokenizer) + 16, seed=22, hidden=32, eos_token_id=tokenizer.eos_token_id)
    return save_pair(target, draft, tokenizer, tmp_path_factory.mktemp("padded-draft"))


@pytest.mark.parametrize("method", ["specexec", "specinfer", "rrs"])
def test_a_draft_with_a_larger_vocabulary_drafts_only_target_tokens(padded_draft_pair, method):
    target_dir, draft_dir = padded_draft_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=target_dir, draft=draft_dir),
        speculation=SpeculationConfig(method=method, budget=16, specinfer_temperature=NAMED_TREES),
        limits=LimitsConfig(max_context=128),
    ))
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **PENALTIES["all"])
    want, gaps = reference_greedy(model, prompt, params)
    assert first_difference(engine.generate_ids(prompt, params), want, gaps) == (False, False)
    sampled = engine.generate_ids(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=32, ignore_eos=True))
    assert len(sampled) == 32 and max(sampled) < model.config.vocab_size
