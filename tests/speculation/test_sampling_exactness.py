"""Sampled output has the target's distribution, for SpecExec and SpecInfer trees.

A tiny-vocabulary bigram "model" (fixed logits tables for target and draft) drives the real
pure functions: both tree builders (best_first_search for SpecExec, grow_sampled_tree for
SpecInfer), logits processing from each node's own path, and verification. 20,000 continuations
of 3 tokens per configuration are compared by a chi-square test, for the first token and for
the whole 3-token continuation, with the exact target distribution. That distribution is
enumerated with a reference written here in plain float64 Python from the documented meaning of
each parameter (vLLM/OpenAI semantics), so it shares no code with engine.speculation.sampling. Two
deliberately broken verifiers show the test has teeth."""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch
from scipy.stats import chisquare

import engine.speculation.sampling as sampling
import engine.speculation.verify as verify
from engine.config import SpeculationConfig
from engine.speculation.sampling import make_generator, position_noise
from engine.speculation.step import verify_step
from engine.speculation.tree import Tree
from engine.types import SamplingParams
from tests.helpers.bigram import bigram_sampled_tree, bigram_tree

VOCAB = 6
ROOT = 0  # last prompt token
NUM_SAMPLES = 20_000
CONTINUATION = 3
_gen = torch.Generator().manual_seed(1234)
TARGET = torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5  # [prev token, vocab] bigram logits
DRAFT = TARGET + torch.randn(VOCAB, VOCAB, generator=_gen) * 0.8
PROMPT_MASK = torch.zeros(VOCAB, dtype=torch.bool)
PROMPT_MASK[ROOT] = True
STOP_MASK = torch.zeros(VOCAB, dtype=torch.bool)
SPEC = SpeculationConfig(budget=8, max_expand=4, max_children=3, max_depth=4)

PLAIN = SamplingParams(temperature=1.0)
SHAPED = SamplingParams(
    temperature=0.6, top_p=0.9, top_k=4, min_p=0.05,
    presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
)


_TREES: dict[tuple[int, str], Tree] = {}


def specexec_tree(root: int, params: SamplingParams, gen: torch.Generator) -> Tree:
    """Best-first tree from the draft bigram; deterministic given the root (so cached)."""
    key = (root, repr(params))
    if key not in _TREES:
        _TREES[key] = bigram_tree(DRAFT, root, params, SPEC, SPEC.budget, STOP_MASK)
    return _TREES[key]


def specinfer_tree(root: int, params: SamplingParams, gen: torch.Generator) -> Tree:
    """The engine's SpecInfer builder: 3 chains of 3 tokens sampled from the processed draft."""
    return bigram_sampled_tree(DRAFT, root, params, budget=9, max_depth=SPEC.max_depth, stop_mask=STOP_MASK,
                               generator=gen)


def speculative_continuation(
    make_tree, params: SamplingParams, gen: torch.Generator, seed: int | None = None
) -> tuple[int, ...]:
    """seed: sample-and-match with the engine's per-position noise (position_noise) instead of fresh
    draws from `gen`."""
    tokens: list[int] = []
    counts = torch.zeros(VOCAB)
    root = ROOT
    while len(tokens) < CONTINUATION:
        tree = make_tree(root, params, gen)
        logits = TARGET[tree.token_ids]  # [n, vocab]: the bigram target at every node
        noise = None
        if seed is not None:
            noise = position_noise(seed, len(tokens), int(tree.depths.max()) + 1, VOCAB, torch.device("cpu"))
        verdict = verify_step(tree, logits, params, counts, PROMPT_MASK, gen, noise=noise)  # counts: every generated token
        new_ids = [*tree.token_ids[verdict.path[1:]].tolist(), int(verdict.bonus_id)]
        tokens.extend(new_ids)
        counts.index_add_(0, torch.tensor(new_ids), torch.ones(len(new_ids)))
        root = tokens[-1]
    return tuple(tokens[:CONTINUATION])


def reference_probs(logits: list[float], params: SamplingParams, counts: list[int], prompt: set[int]) -> list[float]:
    """The next-token distribution the parameters define, in the order vLLM applies them:
    repetition penalty (tokens seen in the prompt or output: positive logits divided, negative
    multiplied), frequency (x count) and presence (once) penalties, temperature, top_k (the k
    largest), top_p (the smallest most-likely set whose mass reaches top_p), min_p (drop tokens
    below min_p x the top probability)."""
    out = list(logits)
    for tok, count in enumerate(counts):
        if params.repetition_penalty != 1.0 and (count > 0 or tok in prompt):
            rp = params.repetition_penalty
            out[tok] = out[tok] / rp if out[tok] > 0 else out[tok] * rp
        out[tok] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    out = [x / params.temperature for x in out]
    keep = set(range(len(out)))
    if 0 < params.top_k < len(out):
        keep = set(sorted(keep, key=lambda t: -out[t])[: params.top_k])

    def softmax(kept: set[int]) -> list[float]:
        top = max(out[t] for t in kept)
        weights = [math.exp(out[t] - top) if t in kept else 0.0 for t in range(len(out))]
        total = sum(weights)
        return [w / total for w in weights]

    if params.top_p < 1.0:
        probs, mass, nucleus = softmax(keep), 0.0, set()
        for tok in sorted(keep, key=lambda t: -probs[t]):
            if mass >= params.top_p:
                break
            nucleus.add(tok)
            mass += probs[tok]
        keep = nucleus
    if params.min_p > 0.0:
        probs = softmax(keep)
        keep = {t for t in keep if probs[t] >= params.min_p * max(probs)}
    return softmax(keep)


def exact_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) under the target alone, with every processing step along the path."""
    table = TARGET.double().tolist()
    probs: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(VOCAB), repeat=CONTINUATION):
        prob, prev, counts = 1.0, ROOT, [0] * VOCAB
        for token in seq:
            prob *= reference_probs(table[prev], params, counts, {ROOT})[token]
            counts[token] += 1
            prev = token
        probs[seq] = prob
    return probs


def chi_square_p(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; cells expected below 5 are pooled into one."""
    observed: dict[tuple[int, ...], int] = {}
    for sample in samples:
        observed[sample] = observed.get(sample, 0) + 1
    total = len(samples)
    big = [k for k, p in exact.items() if p * total >= 5]
    impossible = sum(n for k, n in observed.items() if exact.get(k, 0.0) == 0.0)
    if impossible:
        return 0.0  # a continuation the target can never produce was sampled
    obs = [observed.get(k, 0) for k in big]
    exp = [exact[k] * total for k in big]
    small_exp = sum(p for k, p in exact.items() if k not in big) * total
    if small_exp > 0:
        obs.append(total - sum(obs))
        exp.append(small_exp)
    scale = total / sum(exp)  # exact probabilities sum to 1 within float error
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def marginal(exact: dict[tuple[int, ...], float], length: int) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    for seq, prob in exact.items():
        out[seq[:length]] = out.get(seq[:length], 0.0) + prob
    return out


def run(make_tree, params: SamplingParams, num: int, seed: int) -> tuple[float, float]:
    gen = make_generator(seed, torch.device("cpu"))
    samples = [speculative_continuation(make_tree, params, gen) for _ in range(num)]
    exact = exact_distribution(params)
    first = chi_square_p([s[:1] for s in samples], marginal(exact, 1))
    return first, chi_square_p(samples, exact)


@pytest.mark.parametrize("params", [
    PLAIN, SHAPED, SamplingParams(temperature=0.7, top_k=2), SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.9, presence_penalty=1.1, frequency_penalty=-0.4),
], ids=["plain", "shaped", "top_k", "top_p", "min_p", "repetition", "presence-frequency"])
def test_engine_processing_matches_the_reference(params):
    """Row by row, the engine's processed distribution equals the independent reference."""
    from engine.speculation.sampling import process_logits

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, VOCAB, generator=gen) * 2
    counts = torch.randint(0, 3, (64, VOCAB), generator=gen) * (torch.rand(64, VOCAB, generator=gen) < 0.4)
    engine = process_logits(logits, params, counts.float(), PROMPT_MASK).softmax(-1).double()
    reference = torch.tensor([reference_probs(row, params, c, {ROOT})
                              for row, c in zip(logits.double().tolist(), counts.tolist(), strict=True)],
                             dtype=torch.float64)
    assert torch.allclose(engine, reference, atol=1e-6), (engine - reference).abs().max()
    plain = (logits.double() / params.temperature).softmax(-1)
    assert params is PLAIN or (reference - plain).abs().max() > 0.05  # the parameter really acts


@pytest.mark.slow
@pytest.mark.parametrize("params", [PLAIN, SHAPED], ids=["t1.0", "t0.6-topp-topk-minp-penalties"])
@pytest.mark.parametrize("make_tree", [specexec_tree, specinfer_tree], ids=["specexec", "specinfer"])
def test_continuations_follow_the_target(make_tree, params):
    p_first, p_seq = run(make_tree, params, NUM_SAMPLES, seed=2024)
    print(f"{make_tree.__name__} {params.temperature}: p(first token)={p_first:.3g} p(3 tokens)={p_seq:.3g}")
    assert p_first > 1e-3
    assert p_seq > 1e-3


QUICK = SamplingParams(temperature=0.8, top_p=0.9, top_k=4, min_p=0.2,
                       presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3)
QUICK_SAMPLES = 2_000  # about 1.5 s; every sampling step in QUICK acts, and dropping any one is detected


def quick_samples(seed: int = 11) -> tuple[float, float]:
    gen = make_generator(seed, torch.device("cpu"))
    samples = [speculative_continuation(specexec_tree, QUICK, gen) for _ in range(QUICK_SAMPLES)]
    exact = exact_distribution(QUICK)
    return chi_square_p([s[:1] for s in samples], marginal(exact, 1)), chi_square_p(samples, exact)


def test_continuations_follow_the_target_quick():
    """The quick loop's chi-square (`scripts/test.sh --quick`): SpecExec trees, seeded, with temperature,
    top_k, top_p, min_p and all three penalties."""
    p_first, p_seq = quick_samples()
    assert p_first > 1e-3 and p_seq > 1e-3, (p_first, p_seq)


@pytest.mark.parametrize("broken", ["shared-noise", "no-min-p", "no-penalties"])
def test_the_quick_chi_square_detects_a_broken_sampler(monkeypatch, broken):
    if broken == "shared-noise":
        monkeypatch.setattr(verify, "sample_tokens", shared_noise_sampler)
    elif broken == "no-min-p":
        monkeypatch.setattr(sampling, "apply_min_p", lambda logits, min_p: logits)
    else:
        monkeypatch.setattr(sampling, "apply_penalties", lambda logits, *args, **kwargs: logits)
    monkeypatch.setattr(sys.modules[__name__], "_TREES", {})  # trees grown under the broken processing
    assert quick_samples()[1] < 1e-6


def root_only_tree(root: int, params: SamplingParams, gen: torch.Generator) -> Tree:
    return Tree.single(root, torch.device("cpu"))


def wide_tree(root: int, params: SamplingParams, gen: torch.Generator) -> Tree:
    key = (root, "wide" + repr(params))
    if key not in _TREES:
        spec = SpeculationConfig(budget=30, max_expand=8, max_children=6, max_depth=3)
        _TREES[key] = bigram_tree(DRAFT, root, params, spec, spec.budget, STOP_MASK)
    return _TREES[key]


@pytest.mark.slow
@pytest.mark.parametrize("params", [PLAIN, SHAPED], ids=["t1.0", "t0.6-topp-topk-minp-penalties"])
def test_position_keyed_noise_follows_the_target(params):
    """The engine's seeded SpecExec sampling (noise per (seed, position), shared by a depth's nodes):
    one continuation per seed, 20,000 seeds, against the exact distribution."""
    gen = make_generator(0, torch.device("cpu"))
    samples = [speculative_continuation(specexec_tree, params, gen, seed=seed) for seed in range(NUM_SAMPLES)]
    exact = exact_distribution(params)
    p_first, p_seq = chi_square_p([x[:1] for x in samples], marginal(exact, 1)), chi_square_p(samples, exact)
    print(f"position noise {params.temperature}: p(first token)={p_first:.3g} p(3 tokens)={p_seq:.3g}")
    assert p_first > 1e-3 and p_seq > 1e-3


def test_seeded_output_does_not_depend_on_the_tree():
    """With per-position noise a seed fixes the output: the same with a best-first tree, a wider one,
    and no speculation at all (a root-only tree)."""
    gen = make_generator(0, torch.device("cpu"))
    for seed in range(300):
        outputs = {speculative_continuation(make, SHAPED, gen, seed=seed)
                   for make in (specexec_tree, wide_tree, root_only_tree)}
        assert len(outputs) == 1, (seed, outputs)


def shared_noise_sampler(
    logits: torch.Tensor, greedy: bool, generator: torch.Generator, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """BROKEN on purpose: one random vector reused by every node."""
    probs = logits.softmax(dim=-1)
    noise = torch.empty(probs.shape[1]).exponential_(generator=generator)
    return (probs / noise[None]).argmax(dim=-1)


def ascending_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """BROKEN on purpose: the reference code's bug (descending sort, ascending-sort removal test)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    remove_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


@pytest.mark.slow
def test_shared_random_numbers_are_detected(monkeypatch):
    monkeypatch.setattr(verify, "sample_tokens", shared_noise_sampler)
    _, p_seq = run(specexec_tree, PLAIN, 5_000, seed=7)
    print(f"broken (shared noise): p(3 tokens)={p_seq:.3g}")
    assert p_seq < 1e-6


@pytest.mark.slow
def test_wrong_top_p_is_detected(monkeypatch):
    monkeypatch.setattr(sampling, "apply_top_p", ascending_top_p)
    params = SamplingParams(temperature=1.0, top_p=0.8)
    samples_gen = make_generator(7, torch.device("cpu"))
    samples = [speculative_continuation(specexec_tree, params, samples_gen) for _ in range(5_000)]
    monkeypatch.undo()
    p_seq = chi_square_p(samples, exact_distribution(params))
    print(f"broken (ascending top-p): p(3 tokens)={p_seq:.3g}")
    assert p_seq < 1e-6
