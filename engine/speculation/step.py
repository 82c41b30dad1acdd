"""One sequence's part of a decoding step: its state, its draft tree, verification and commit of its rows."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import SpeculationConfig
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner, Segment
from engine.speculation.budget import acceptance_curve, node_indicator
from engine.speculation.drafter import Drafter, GrowLimits, Growth
from engine.speculation.forest_growth import ForestSearch, TreeRequest, extend_forest, grow_forest
from engine.speculation.logprobs import emitted_logprobs, unpack_logprobs
from engine.speculation.overlap import SEEDED_FORWARDS, commit_draft, extension
from engine.speculation.prediction import MATCH as PREDICTION_MATCH
from engine.speculation.prediction import SHARE as PREDICTION_SHARE
from engine.speculation.prediction import Prediction, graft_chain
from engine.speculation.rrs import verify_rrs
from engine.speculation.rrs_growth import CHILDREN as RRS_CHILDREN
from engine.speculation.rrs_growth import grow_rrs_tree
from engine.speculation.rrs_shape import ShapeBook, TreeShape
from engine.speculation.sampling import NodeLogits, position_noise
from engine.speculation.search_tree import SearchTree
from engine.speculation.specexec_growth import Search, grow_tree
from engine.speculation.specinfer_growth import grow_sampled_tree
from engine.speculation.tree import Tree
from engine.speculation.verify import Verdict, path_probabilities, verify_specinfer, verify_tree
from engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.speculation.grammar import GrammarState

PREFILL_CHUNK = 512


@dataclass
class SequenceState:
    """Committed tokens of one request; the last one is the root of the next tree (no KV yet)."""

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    output_counts: torch.Tensor  # [vocab] float, generated tokens so far, the root included (penalties)
    prompt_mask: torch.Tensor | None  # [vocab] bool, tokens of the prompt (repetition penalty)
    emitted: int = 0
    acceptance_curve: list[float] | None = None  # last step's E[accepted] per budget 1..n-1 (budget auto)
    expected_accepted: float | None = None  # last step's E[accepted draft tokens | its tree]; None: sampled SpecInfer
    step_logprobs: list[TokenLogprob] | None = None  # last step's, one per new token (params.logprobs set)
    grammar: GrammarState | None = None  # structured output: the grammar after the committed tokens
    tree_shape: TreeShape | None = None  # RRS trees: the acceptance model and threshold learned so far
    prediction: Prediction | None = None  # the request's predicted output (OpenAI's `prediction`)

    @property
    def root_id(self) -> int:
        return self.token_ids[-1]


def prefill(runner: DecoderRunner, cache: KVCache, token_ids: list[int]) -> None:
    """Write the KV of `token_ids` after the committed prefix; computes no logits. One pass over the
    layers, each running every PREFILL_CHUNK-token chunk (a streamed target loads each layer once)."""
    if not token_ids:
        return
    runner.prefill(torch.tensor(token_ids, device=cache.device), cache, PREFILL_CHUNK)
    cache.length += len(token_ids)


@dataclass
class StepContext:
    """One running sequence's side of a step: its caches, its drafter, its share of the budget."""

    target_cache: KVCache
    drafter: Drafter
    spec: SpeculationConfig
    budget: int
    stop_mask: torch.Tensor  # [vocab] bool, tokens never expanded (EOS, stop ids), on drafter.tree_device
    max_context: int
    track_acceptance: bool = False  # record the step's acceptance curve in the SequenceState (budget auto, shared budgets)
    seed: SearchTree | None = None  # the next tree, partly grown during the last pass (overlap), rooted at the root
    shape_book: ShapeBook | None = None  # RRS trees: the engine's acceptance evidence across requests


def tree_growth(ctx: StepContext, seq: SequenceState, max_depth: int) -> Growth:
    """The step's tree, as a growth (draft.Growth: it yields its draft forwards); with a grammar,
    children it forbids are never proposed, and tree.allowed holds every node's mask for verification.
    A seed left by the last step's extension is grown on (a few forwards) instead of a fresh tree."""
    grammar = seq.grammar
    mask = None if grammar is None else grammar.masks_for
    seed, ctx.seed = ctx.seed, None
    if grammar is not None:
        grammar.check_live()
    if ctx.spec.method == "autoregressive" or max_depth < 1:
        tree = Tree.single(seq.root_id, ctx.target_cache.device)
    else:
        pending, limits = draft_pending(ctx, seq), tree_limits(ctx, max_depth)
        if ctx.spec.method == "specinfer":
            growth = grow_sampled_tree(ctx.drafter, seq.root_id, pending, seq.params, limits, seq.generator, mask)
        elif ctx.spec.method == "rrs":
            if seq.tree_shape is None:
                seq.tree_shape = ctx.shape_book.shape(seq.params, grammar is not None) if ctx.shape_book is not None \
                    else TreeShape(ctx.target_cache.device, ctx.spec.decay)
            growth = grow_rrs_tree(ctx.drafter, seq.root_id, pending, seq.params, ctx.spec.max_expand,
                                   RRS_CHILDREN, limits, seq.tree_shape, seq.generator, mask)
        else:
            growth = grow_tree(ctx.drafter, seq.root_id, pending, seq.params, ctx.spec, limits, mask,
                               seed, SEEDED_FORWARDS)
        tree = finished_tree(ctx, seq, (yield from growth), max_depth)
    if grammar is not None:
        tree.allowed = grammar.bitmask(tree)
    return tree


def draft_pending(ctx: StepContext, seq: SequenceState) -> list[int]:
    """Committed tokens the draft has not seen (the root excluded): its catch-up feeds them."""
    return seq.token_ids[ctx.drafter.cache.length : len(seq.token_ids) - 1]


def tree_limits(ctx: StepContext, max_depth: int) -> GrowLimits:
    """The step's tree limits: its share of the budget, `max_depth`, the request's stop tokens."""
    return GrowLimits(budget=ctx.budget, max_depth=max_depth, stop_mask=ctx.stop_mask)


def finished_tree(ctx: StepContext, seq: SequenceState, tree: Tree, max_depth: int) -> Tree:
    """A grown tree as the target scores it: with the request's predicted chain (SpecExec trees), on the
    target's device (SpecExec trees may grow on the host: Drafter.tree_device)."""
    if seq.prediction is not None and tree.draft_probs is None and tree.proposals is None:  # SpecExec trees
        chain = seq.prediction.chain(min(ctx.budget // PREDICTION_SHARE, chain_depth(ctx, seq, max_depth)))
        if chain:
            tree = graft_chain(tree, chain, ctx.budget + 1)
    return tree.to(ctx.target_cache.device)


def in_forest(ctx: StepContext, seq: SequenceState, max_depth: int) -> bool:
    """Whether the step's tree grows in a forest (forest_growth): SpecExec trees without a grammar."""
    return ctx.spec.forest and ctx.spec.method == "specexec" and seq.grammar is None and max_depth >= 1


# the growth of several trees as one forest: yields each round's segments, is sent their logits, returns the trees
ForestGrowth = Generator[list[Segment], list[torch.Tensor], list[Tree]]


def forest_growth(parts: list[tuple[StepContext, SequenceState, int]]) -> ForestGrowth:
    """The trees of `parts` ((ctx, seq, max_depth), each in_forest, their drafters on one runner) grown as
    one forest; each as tree_growth would grow it (its seed too), in the parts' order."""
    requests = []
    for ctx, seq, max_depth in parts:
        seed, ctx.seed = ctx.seed, None
        requests.append(TreeRequest(ctx.drafter, seq.params, tree_limits(ctx, max_depth), seq.root_id,
                                    draft_pending(ctx, seq), seed))
    grown = yield from grow_forest(requests, parts[0][0].spec, SEEDED_FORWARDS)
    return [finished_tree(ctx, seq, tree.tree(), max_depth)
            for (ctx, seq, max_depth), tree in zip(parts, grown, strict=True)]


def chain_depth(ctx: StepContext, seq: SequenceState, max_depth: int) -> int:
    """The longest predicted chain a tree may hold: greedy, what the request may still emit, past --max-depth (a
    chain costs no draft forward). Sampled requests stop at max_depth (sample-and-match draws a noise row of the
    vocabulary per depth), and so do hybrid drafts (their caches keep linear-attention rows for a catch-up of
    max_depth + 1 tokens: memory_plan.pending_slots)."""
    if not seq.params.greedy or any(ctx.drafter.runner.linear_layers):
        return max_depth
    return max(max_depth, remaining_tokens(ctx, seq) - 1)


def can_extend(ctx: StepContext, tree: Tree) -> bool:
    """Whether the tree grows on during its pass: SpecExec trees (best-first, with their proposals), but not
    those with a predicted output's chain (the draft never expands its nodes)."""
    return ctx.spec.method == "specexec" and tree.child_lp is not None and tree.predicted == 0


def extension_growth(ctx: StepContext, seq: SequenceState, tree: Tree, stop: Callable[[], bool]) -> Search:
    """The tree's growth during its pass (overlap.extension); needs can_extend."""
    mask = None if seq.grammar is None else seq.grammar.masks_for
    return extension(ctx.drafter, tree, seq.params, ctx.spec, extension_limits(ctx, seq), mask, stop)


def extension_limits(ctx: StepContext, seq: SequenceState) -> GrowLimits:
    """An extension's limits: SpeculationConfig.extension_budget nodes, twice --max-depth (what may be emitted)."""
    max_depth = min(2 * ctx.spec.max_depth, remaining_tokens(ctx, seq) - 1)
    return GrowLimits(budget=ctx.spec.extension_budget(ctx.budget), max_depth=max_depth, stop_mask=ctx.stop_mask)


def extends_in_forest(ctx: StepContext, seq: SequenceState) -> bool:
    """Whether the tree's extension grows in a forest (extension_forest): without a grammar."""
    return ctx.spec.forest and seq.grammar is None


def extension_forest(parts: list[tuple[StepContext, SequenceState, Tree]], stop: Callable[[], bool]) -> ForestSearch:
    """The extensions of `parts` ((ctx, seq, tree), each can_extend and extends_in_forest, their drafters on one
    runner) grown as one forest, set up now (before the pass is queued); each as extension_growth would grow
    it, in the parts' order."""
    requests = [TreeRequest(ctx.drafter, seq.params, extension_limits(ctx, seq)) for ctx, seq, _ in parts]
    return extend_forest(requests, [tree for _, _, tree in parts], parts[0][0].spec, stop)


def accept_committed(seq: SequenceState, new_ids: list[int]) -> None:
    """After a step appended `new_ids` to seq.token_ids: advance the grammar past them (finish check:
    seq.grammar.terminated, then only the first seq.grammar.num_consumed of them are output)."""
    if seq.grammar is not None:
        seq.grammar.accept(new_ids)


def verify_step(
    tree: Tree,
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    generator: torch.Generator,
    track_acceptance: bool = False,
    rows_per_block: int | None = None,
    *,
    allowed: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> Verdict:
    """Process every node's logits from its own path, then verify. Pure: tensors in, verdict out.

    logits: [n, vocab] raw target logits; output_counts: [vocab] counts of the generated tokens so
    far, the root among them unless it is the prompt's last token (nodes below the root are added
    per path); track_acceptance: sampled verdicts carry node_log_probs (budget auto's curve). Rows are
    processed in blocks of rows_per_block (None: LOGITS_BLOCK_BYTES per block). allowed: [n, words]
    packed grammar masks, applied before everything else (None: tree.allowed, set by tree_growth).
    noise: [max depth + 1, vocab] per-depth sampling noise for sample-and-match (position_noise)."""
    allowed = tree.allowed if allowed is None else allowed
    nodes = NodeLogits(tree, logits, params, output_counts, prompt_mask, allowed)
    with_log_probs = track_acceptance and not params.greedy
    if tree.draft_probs is not None and not params.greedy:
        return verify_specinfer(tree, nodes, generator, rows_per_block, with_log_probs)
    if tree.proposals is not None and not params.greedy:
        return verify_rrs(tree, nodes, generator, rows_per_block)
    return verify_tree(tree, nodes, params.greedy, generator, rows_per_block, with_log_probs, noise)


def step_curve(ctx: StepContext, seq: SequenceState, tree: Tree, verdict: Verdict) -> torch.Tensor:
    """[n - 1] E[accepted] per smaller budget (empty unless tracking); greedy counts argmax paths."""
    if not ctx.track_acceptance:
        return tree.scores.new_zeros(0)
    if seq.params.greedy:
        return acceptance_curve(node_indicator(tree.num_nodes, verdict.path))
    assert verdict.node_log_probs is not None, "verify_step(track_acceptance=True) gives the log-probs"
    return acceptance_curve(path_probabilities(tree, verdict.node_log_probs))


def expected_accepted(seq: SequenceState, tree: Tree) -> float | None:
    """E[accepted draft tokens] of the step's tree: the sum over non-root nodes of the probability that
    verification accepts them (the last entry of the curve): sample-and-match, the target's path
    probability; RRS trees, the product of each step's acceptance; greedy: the argmax path's length.
    None when not tracked, and for sampled SpecInfer trees (not computed for them)."""
    if seq.acceptance_curve is None or (tree.draft_probs is not None and not seq.params.greedy):
        return None
    return seq.acceptance_curve[-1] if seq.acceptance_curve else 0.0


def remaining_tokens(ctx: StepContext, seq: SequenceState) -> int:
    """Tokens the request may still emit (max_tokens, context)."""
    return min(seq.params.max_tokens - seq.emitted, ctx.max_context - len(seq.token_ids))


def step_depth(ctx: StepContext, seq: SequenceState) -> int:
    """The deepest node this step's tree may have (the tree is cut to what the request may still emit)."""
    remaining = remaining_tokens(ctx, seq)
    return 0 if ctx.spec.method == "autoregressive" else max(0, min(ctx.spec.max_depth, remaining - 1))


def step_noise(ctx: StepContext, seq: SequenceState, tree: Tree, vocab_size: int) -> torch.Tensor | None:
    """Sample-and-match noise keyed by (seed, position): None for greedy, SpecInfer and RRS trees. Rows for
    every depth the tree may hold: the step's, and a predicted chain's below a node at most that deep."""
    if seq.params.greedy or tree.draft_probs is not None or tree.proposals is not None:
        return None
    seed = seq.generator.initial_seed()
    depths = step_depth(ctx, seq) + tree.predicted + 1
    return position_noise(seed, len(seq.token_ids), depths, vocab_size, ctx.target_cache.device)


def commit_step(
    ctx: StepContext, seq: SequenceState, tree: Tree, logits: torch.Tensor, grown: SearchTree | None = None
) -> list[int]:
    """Verify the scored tree (logits: [n, vocab]), keep the accepted path's KV in both caches, and
    append the step's tokens (accepted path + bonus) to `seq`; returns them. With `grown` (the tree's
    extension during its pass) the next step's seed is kept in ctx.seed. One host sync (two with `grown`)."""
    device = ctx.target_cache.device
    verdict = verify_step(
        tree, logits, seq.params, seq.output_counts, seq.prompt_mask, seq.generator, ctx.track_acceptance,
        noise=step_noise(ctx, seq, tree, logits.shape[1]),
    )
    ctx.target_cache.commit(ctx.target_cache.length + verdict.path)
    num_new = verdict.path.shape[0]
    new_id_tensor = torch.cat([tree.token_ids[verdict.path[1:]], verdict.bonus_id.reshape(1)])  # [num_new]
    token_lp = emitted_logprobs(tree, logits, seq.params, seq.output_counts, seq.prompt_mask,
                                verdict.path, new_id_tensor)  # read before this step's counts are added
    seq.output_counts.index_add_(0, new_id_tensor, torch.ones(num_new, device=device))
    curve = step_curve(ctx, seq, tree, verdict)
    summary = torch.cat([new_id_tensor.double(), curve.double(), token_lp]).tolist()
    # ^ the step's last host sync for this sequence (verification's path is the other)
    new_ids = [int(t) for t in summary[:num_new]]
    ctx.seed = commit_draft(ctx.drafter, tree, verdict.path, grown, new_ids)
    lp_begin = num_new + curve.shape[0]
    seq.acceptance_curve = summary[num_new:lp_begin] if ctx.track_acceptance else None
    seq.expected_accepted = expected_accepted(seq, tree)
    seq.step_logprobs = unpack_logprobs(summary[lp_begin:], num_new) if seq.params.logprobs is not None else None
    if seq.tree_shape is not None and tree.proposals is not None and verdict.node_log_probs is not None:
        seq.tree_shape.observe(tree, verdict.node_log_probs)
    seq.token_ids.extend(new_ids)
    if seq.prediction is not None:
        tail = max(seq.prompt_len, len(seq.token_ids) - len(new_ids) - PREDICTION_MATCH)  # what `advance` reads
        seq.prediction.advance(seq.token_ids[tail:], new_ids)
    accept_committed(seq, new_ids)
    return new_ids
