"""RRS trees (children drawn without replacement, recursive rejection sampling) emit exactly the
target's distribution.

- The vectorised rejection steps equal a plain float64 loop over the whole vocabulary that follows
  the method's definition (accept c_i with min(1, p_i/q_i); p_{i+1} = norm(max(p_i - q_i, 0)); q_{i+1}
  = q_i without c_i).
- The bigram target and draft of test_sampling_exactness drive the engine's real growth
  (grow_rrs_tree, with each request's TreeShape learning between steps), verification (verify_step)
  and logits processing; the first two emitted tokens are compared by chi-square with the exact
  distribution from that file's independent reference (temperature, top_k, top_p, min_p, penalties;
  logit_bias added to the raw logits first).
- Again with one shape book shared by all the samples (each request starts from the evidence of the
  ones before it, as in the engine).
- A growth whose children are the draft's top tokens (SpecExec's) instead of a draw without
  replacement fails the same test, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch

import engine.speculation.rrs_growth as rrs_growth
from engine.config import SpeculationConfig
from engine.speculation.rrs import rejection_steps
from engine.speculation.rrs_shape import ShapeBook, TreeShape
from engine.speculation.sampling import make_generator
from engine.speculation.step import verify_step
from engine.types import SamplingParams
from tests.helpers.bigram import bigram_rrs_tree
from tests.speculation.test_sampling_exactness import (
    DRAFT,
    PROMPT_MASK,
    ROOT,
    SHAPED,
    STOP_MASK,
    TARGET,
    VOCAB,
    chi_square_p,
    marginal,
    reference_probs,
)

LENGTH = 2  # emitted tokens compared: the first and the second
NUM_SAMPLES = 4_000
SPEC = SpeculationConfig(budget=8, max_expand=4, max_children=4, max_depth=4)
PLAIN = SamplingParams(temperature=1.0)
BIASED = SamplingParams(temperature=0.8, logit_bias={2: 1.5, 4: -2.0}, top_k=5)


def reference_rejection(p: torch.Tensor, q: torch.Tensor, children: list[int]) -> tuple[list[float], torch.Tensor]:
    """float64 over the whole vocabulary: each child's acceptance probability given the earlier ones
    were rejected, and the distribution of the token emitted when all are rejected."""
    p, q = p.double().clone(), q.double().clone()
    accept = []
    for child in children:
        accept.append(min(1.0, float(p[child] / q[child])))
        residual = (p - q).clamp(min=0.0)
        p = residual / residual.sum() if residual.sum() > 0 else p
        q[child] = 0.0
        q = q / q.sum()
    return accept, p


@pytest.mark.parametrize("seed", range(6))
def test_rejection_steps_follow_the_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, width, num_nodes = 40, 8, 5
    rows = []
    for node in range(num_nodes):
        p = (torch.randn(vocab, generator=gen) * 2).softmax(-1)
        draft = (p.log() + torch.randn(vocab, generator=gen)).softmax(-1)
        top, ids = draft.topk(width)
        order = torch.randperm(width, generator=gen)
        rows.append((p, ids[order], (top / top.sum())[order], node % (width + 1)))
    ids = torch.stack([r[1] for r in rows])
    q = torch.stack([r[2] for r in rows])
    on_row = torch.stack([r[0][r[1]] for r in rows])
    off_mass = 1 - on_row.sum(-1)
    accept, residual, off = rejection_steps(on_row, off_mass, q, torch.tensor([r[3] for r in rows]))
    for node, (p, row_ids, row_q, k) in enumerate(rows):
        full_q = torch.zeros(vocab, dtype=torch.float64)
        full_q[row_ids] = row_q.double()
        want_accept, want_residual = reference_rejection(p, full_q, row_ids[:k].tolist())
        assert accept[node, :k].tolist() == pytest.approx(want_accept, abs=1e-5)
        assert (accept[node, k:] == 0).all()
        if all(a < 1 for a in want_accept):  # the residual is reachable
            total = residual[node].sum() + off[node]
            assert (residual[node] / total).double() == pytest.approx(want_residual[row_ids].tolist(), abs=1e-5)
            assert float(off[node] / total) == pytest.approx(1 - float(want_residual[row_ids].sum()), abs=1e-5)


def rrs_continuation(params: SamplingParams, gen: torch.Generator, book: ShapeBook | None = None) -> tuple[int, ...]:
    """One request: RRS steps (its TreeShape learning from each, and starting from `book`'s evidence)
    until LENGTH tokens."""
    tokens: list[int] = []
    counts = torch.zeros(VOCAB)
    shape = TreeShape(torch.device("cpu")) if book is None else book.shape(params, constrained=False)
    root = ROOT
    while len(tokens) < LENGTH:
        tree = bigram_rrs_tree(DRAFT, root, params, SPEC, SPEC.budget, STOP_MASK, gen, shape)
        verdict = verify_step(tree, TARGET[tree.token_ids], params, counts, PROMPT_MASK, gen)
        shape.observe(tree, verdict.node_log_probs)
        new_ids = [*tree.token_ids[verdict.path[1:]].tolist(), int(verdict.bonus_id)]
        tokens.extend(new_ids)
        counts.index_add_(0, torch.tensor(new_ids), torch.ones(len(new_ids)))
        root = tokens[-1]
    return tuple(tokens[:LENGTH])


def exact_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) under the target alone: logit_bias added to the raw logits, then the
    reference's penalties, temperature, top_k, top_p, min_p along the path."""
    table = TARGET.double().clone()
    for token, bias in params.logit_bias.items():
        table[:, token] += bias
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LENGTH):
        longer = {}
        for seq, prob in probs.items():
            counts = [seq.count(t) for t in range(VOCAB)]
            step = reference_probs(table[seq[-1] if seq else ROOT].tolist(), params, counts, {ROOT})
            longer.update({(*seq, t): prob * p for t, p in enumerate(step)})
        probs = longer
    return probs


def p_values(params: SamplingParams, num: int, seed: int, book: ShapeBook | None = None) -> tuple[float, float]:
    gen = make_generator(seed, torch.device("cpu"))
    samples = [rrs_continuation(params, gen, book) for _ in range(num)]
    exact = exact_distribution(params)
    return chi_square_p([s[:1] for s in samples], marginal(exact, 1)), chi_square_p(samples, exact)


@pytest.mark.slow
@pytest.mark.parametrize("params", [PLAIN, SHAPED, BIASED], ids=["t1.0", "t0.6-topp-topk-minp-penalties", "logit-bias"])
def test_rrs_tokens_follow_the_target(params):
    p_first, p_two = p_values(params, NUM_SAMPLES, seed=2027)
    print(f"rrs {params.temperature}: p(first token)={p_first:.3g} p(two tokens)={p_two:.3g}")
    assert p_first > 1e-3 and p_two > 1e-3


@pytest.mark.slow
def test_rrs_tokens_follow_the_target_with_a_shape_book():
    book = ShapeBook(torch.device("cpu"))
    p_first, p_two = p_values(PLAIN, NUM_SAMPLES, seed=2028, book=book)
    print(f"rrs with a book: p(first token)={p_first:.3g} p(two tokens)={p_two:.3g}")
    assert float(book.settings[(1.0, 1.0, 0, 0.0, False)].counts.sum()) > 0
    assert p_first > 1e-3 and p_two > 1e-3


@pytest.mark.slow
def test_top_children_instead_of_drawn_ones_are_detected(monkeypatch):
    """BROKEN on purpose: each node's children are the draft's top tokens in order (SpecExec's
    children) instead of a draw without replacement, verified as if drawn: likely tokens are offered
    more often than q says, so the emitted tokens lean to the draft."""
    draw = rrs_growth.draw_proposals

    def top_tokens(*args, **kwargs):
        ids, probs, ranked = draw(*args, **kwargs)
        order = probs.argsort(dim=-1, descending=True, stable=True)
        return ids.gather(1, order), probs.gather(1, order), ranked

    monkeypatch.setattr(rrs_growth, "draw_proposals", top_tokens)
    p_first, p_two = p_values(PLAIN, 1_500, seed=7)
    print(f"broken (top children): p(first token)={p_first:.3g} p(two tokens)={p_two:.3g}")
    assert min(p_first, p_two) < 1e-6
