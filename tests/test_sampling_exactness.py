"""Sampled output has the target's distribution, for SpecExec and SpecInfer trees.

A tiny-vocabulary bigram "model" (fixed logits tables for target and draft) drives the real
pure functions: tree growth (add_best_children / select_leaves, append_children), logits
processing from each node's own path, and verification. 20,000 continuations of 3 tokens per
configuration are compared with the exact target distribution (enumerated) by a chi-square test,
for the first token and for the whole 3-token continuation. Two deliberately broken verifiers
show the test has teeth."""

from __future__ import annotations

import itertools

import pytest
import torch
from bigram import bigram_tree
from scipy.stats import chisquare

import engine.sampling as sampling
import engine.verify as verify
from engine.config import SpeculationConfig
from engine.draft import (
    append_children,
    root_tree,
)
from engine.sampling import make_generator, process_logits
from engine.step import verify_step
from engine.tree import Tree
from engine.types import SamplingParams

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


def specinfer_tree(root: int, params: SamplingParams, gen: torch.Generator):
    """Three root children drawn i.i.d. from the processed draft, each continued by one draw."""
    draft_params = SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p
    )
    tree = root_tree(root, 0, torch.device("cpu"))
    tree.draft_probs = process_logits(DRAFT[[root]], draft_params).softmax(-1)
    frontier, draws = torch.zeros(1, dtype=torch.long), 3
    for _ in range(2):
        child_ids = torch.multinomial(tree.draft_probs[frontier], draws, replacement=True, generator=gen)
        first = tree.num_nodes
        tree = append_children(tree, frontier.repeat_interleave(draws), child_ids.flatten(), VOCAB)
        frontier = torch.arange(first, tree.num_nodes)
        tree.draft_probs[frontier] = process_logits(DRAFT[tree.token_ids[frontier]], draft_params).softmax(-1)
        draws = 1
    return tree


def speculative_continuation(make_tree, params: SamplingParams, gen: torch.Generator) -> tuple[int, ...]:
    tokens: list[int] = []
    counts = torch.zeros(VOCAB)
    root = ROOT
    while len(tokens) < CONTINUATION:
        tree = make_tree(root, params, gen)
        logits = TARGET[tree.token_ids]  # [n, vocab]: the bigram target at every node
        verdict = verify_step(tree, logits, params, counts, PROMPT_MASK, len(tokens) > 0, gen)
        new_ids = [*tree.token_ids[verdict.path[1:]].tolist(), int(verdict.bonus_id)]
        tokens.extend(new_ids)
        counts.index_add_(0, torch.tensor(new_ids), torch.ones(len(new_ids)))
        root = tokens[-1]
    return tuple(tokens[:CONTINUATION])


def exact_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) under the target alone, with every processing step along the path."""
    probs: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(VOCAB), repeat=CONTINUATION):
        prob, prev, counts = 1.0, ROOT, torch.zeros(VOCAB)
        for token in seq:
            logits = process_logits(TARGET[[prev]], params, counts[None], PROMPT_MASK)
            prob *= float(logits.softmax(-1)[0, token])
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


@pytest.mark.parametrize("params", [PLAIN, SHAPED], ids=["t1.0", "t0.6-topp-topk-minp-penalties"])
@pytest.mark.parametrize("make_tree", [specexec_tree, specinfer_tree], ids=["specexec", "specinfer"])
def test_continuations_follow_the_target(make_tree, params):
    p_first, p_seq = run(make_tree, params, NUM_SAMPLES, seed=2024)
    print(f"{make_tree.__name__} {params.temperature}: p(first token)={p_first:.3g} p(3 tokens)={p_seq:.3g}")
    assert p_first > 1e-3
    assert p_seq > 1e-3


def shared_noise_sampler(logits: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
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


def test_shared_random_numbers_are_detected(monkeypatch):
    monkeypatch.setattr(verify, "sample_tokens", shared_noise_sampler)
    _, p_seq = run(specexec_tree, PLAIN, 5_000, seed=7)
    print(f"broken (shared noise): p(3 tokens)={p_seq:.3g}")
    assert p_seq < 1e-6


def test_wrong_top_p_is_detected(monkeypatch):
    monkeypatch.setattr(sampling, "apply_top_p", ascending_top_p)
    params = SamplingParams(temperature=1.0, top_p=0.8)
    samples_gen = make_generator(7, torch.device("cpu"))
    samples = [speculative_continuation(specexec_tree, params, samples_gen) for _ in range(5_000)]
    monkeypatch.undo()
    p_seq = chi_square_p(samples, exact_distribution(params))
    print(f"broken (ascending top-p): p(3 tokens)={p_seq:.3g}")
    assert p_seq < 1e-6
