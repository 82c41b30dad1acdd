"""Constrained sampling under speculation has the exact constrained distribution.

A bigram target and draft (fixed logits tables over the tiny tokenizer's vocabulary) drive the real
tree builders with the grammar's draft masks (best_first_search for SpecExec, grow_sampled_tree for
SpecInfer, grow_rrs_tree for RRS trees), the grammar's node masks in verification, and `GrammarState.accept` between steps, until
EOS. The grammar is a regex with four words; the exact distribution over token sequences is
enumerated here without xgrammar: after text s, a token t is allowed iff s + text(t) is a prefix of
a word, and EOS iff s is a word; each step's probability is reference_probs (tests/speculation/
test_sampling_exactness.py) of the target row with the other tokens at -inf. Chi-square as there.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import SpeculationConfig
from engine.speculation.grammar import GrammarCache, GrammarState
from engine.speculation.rrs_shape import TreeShape
from engine.speculation.sampling import make_generator
from engine.speculation.step import verify_step
from engine.speculation.tree import Tree
from engine.types import SamplingParams, StructuredOutput
from tests.helpers.bigram import bigram_rrs_tree, bigram_sampled_tree, bigram_tree
from tests.helpers.tiny_models import build_tokenizer
from tests.speculation.test_sampling_exactness import chi_square_p, reference_probs

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)
EOS = TOKENIZER.eos_token_id
WORDS = ("cat", "dog", "do", "at")
REGEX = StructuredOutput("regex", "(" + "|".join(WORDS) + ")")
ROOT = 5  # the prompt's last token
NUM_SAMPLES = 1_500
_gen = torch.Generator().manual_seed(77)
TARGET = torch.randn(VOCAB, VOCAB, generator=_gen) * 2.0  # [prev token, vocab] bigram logits
DRAFT = TARGET + torch.randn(VOCAB, VOCAB, generator=_gen) * 1.0
SPEC = SpeculationConfig(budget=8, max_expand=4, max_children=3, max_depth=4)
STOP = torch.zeros(VOCAB, dtype=torch.bool)
STOP[EOS] = True
PLAIN = SamplingParams(temperature=1.0)
SHAPED = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.4)


def specexec_tree(root: int, state: GrammarState, params: SamplingParams, gen: torch.Generator) -> Tree:
    return bigram_tree(DRAFT, root, params, SPEC, SPEC.budget, STOP, state.masks_for)


def specinfer_tree(root: int, state: GrammarState, params: SamplingParams, gen: torch.Generator) -> Tree:
    return bigram_sampled_tree(DRAFT, root, params, 9, SPEC.max_depth, STOP, gen, state.masks_for)


def rrs_tree(root: int, state: GrammarState, params: SamplingParams, gen: torch.Generator) -> Tree:
    """A fresh TreeShape per step (its first-step shape); test_rrs_exactness covers the learned ones."""
    return bigram_rrs_tree(DRAFT, root, params, SPEC, SPEC.budget, STOP, gen, TreeShape(torch.device("cpu")),
                           state.masks_for)


def constrained_sample(make_tree, cache: GrammarCache, params: SamplingParams, gen: torch.Generator,
                       target_masks: bool = True) -> tuple[int, ...]:
    """Speculative steps until EOS; the tokens, EOS included (target_masks=False: verification without
    the grammar's masks, broken on purpose; a token outside the grammar ends the sample as (-1,))."""
    state = cache.new_state(REGEX, torch.device("cpu"))
    tokens: list[int] = []
    counts = torch.zeros(VOCAB)
    while EOS not in tokens:
        tree = make_tree(tokens[-1] if tokens else ROOT, state, params, gen)
        tree.allowed = state.bitmask(tree) if target_masks else None
        verdict = verify_step(tree, TARGET[tree.token_ids], params, counts, PROMPT_MASK, gen)
        new_ids = [*tree.token_ids[verdict.path[1:]].tolist(), int(verdict.bonus_id)]
        try:
            state.accept(new_ids)
        except AssertionError:
            return (-1,)
        tokens.extend(new_ids)
        counts.index_add_(0, torch.tensor(new_ids), torch.ones(len(new_ids)))
    return tuple(tokens[: tokens.index(EOS) + 1])


PROMPT_MASK = torch.zeros(VOCAB, dtype=torch.bool)
PROMPT_MASK[ROOT] = True


def allowed_after(text: str) -> list[int]:
    """Tokens whose text continues `text` towards a word, and EOS once `text` is a word."""
    special = set(TOKENIZER.all_special_ids)
    out = [t for t in range(VOCAB) if t not in special
           and any(w.startswith(text + TOKENIZER.decode([t])) and TOKENIZER.decode([t]) for w in WORDS)]
    return out + ([EOS] if text in WORDS else [])


def exact_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    table = TARGET.double().tolist()
    probs: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], str, float]] = [((), "", 1.0)]
    while frontier:
        seq, text, prob = frontier.pop()
        allowed = set(allowed_after(text))
        prev = seq[-1] if seq else ROOT
        masked = [x if t in allowed else float("-inf") for t, x in enumerate(table[prev])]
        counts = [seq.count(t) for t in range(VOCAB)]
        step = reference_probs(masked, params, counts, {ROOT})
        for token in allowed:
            if step[token] == 0.0:
                continue
            if token == EOS:
                probs[(*seq, EOS)] = prob * step[token]
            else:
                frontier.append(((*seq, token), text + TOKENIZER.decode([token]), prob * step[token]))
    return probs


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return GrammarCache(TOKENIZER, VOCAB, [EOS])


def test_the_reference_language_is_what_the_grammar_accepts(cache):
    exact = exact_distribution(PLAIN)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    assert {TOKENIZER.decode(list(seq[:-1])) for seq in exact} == set(WORDS)
    assert len(exact) > len(WORDS)  # several tokenizations of some words


@pytest.mark.slow
@pytest.mark.parametrize(("make_tree", "params"), [(specexec_tree, PLAIN), (specexec_tree, SHAPED),
                                                   (specinfer_tree, PLAIN), (rrs_tree, PLAIN), (rrs_tree, SHAPED)],
                         ids=["specexec-t1.0", "specexec-t0.7-topk-repetition", "specinfer-t1.0", "rrs-t1.0",
                              "rrs-t0.7-topk-repetition"])
def test_constrained_samples_follow_the_constrained_target(cache, make_tree, params):
    gen = make_generator(2025, torch.device("cpu"))
    samples = [constrained_sample(make_tree, cache, params, gen) for _ in range(NUM_SAMPLES)]
    exact = exact_distribution(params)
    p_value = chi_square_p(samples, exact)
    print(f"{make_tree.__name__} {params.temperature}: p={p_value:.3g} over {len(exact)} token sequences")
    assert p_value > 1e-3


def test_a_target_without_the_mask_is_detected(cache):
    """Verification that ignores the grammar (only the draft masked) emits sequences it forbids."""
    gen = make_generator(7, torch.device("cpu"))
    samples = [constrained_sample(specexec_tree, cache, PLAIN, gen, target_masks=False) for _ in range(300)]
    assert chi_square_p(samples, exact_distribution(PLAIN)) < 1e-6
