"""One decoding step for one sequence: draft a tree -> one target pass -> verify -> commit."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import SpeculationConfig
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner
from engine.offload.device import PhaseClock
from engine.spec.budget import acceptance_curve, node_indicator
from engine.spec.draft import Drafter, GrowLimits, grow_sampled_tree, grow_tree
from engine.spec.logprobs import emitted_logprobs, unpack_logprobs
from engine.spec.sampling import NodeLogits
from engine.spec.tree import Tree, prefix_tree_mask
from engine.spec.verify import Verdict, path_probabilities, verify_specinfer, verify_tree
from engine.types import SamplingParams, StepStats, TokenLogprob

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
    step_logprobs: list[TokenLogprob] | None = None  # last step's, one per new token (params.logprobs set)

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
    target: DecoderRunner
    target_cache: KVCache
    drafter: Drafter
    spec: SpeculationConfig
    budget: int
    stop_mask: torch.Tensor  # [vocab] bool, tokens never expanded (EOS, stop ids)
    max_context: int
    track_acceptance: bool = False  # budget auto: record the step's acceptance curve in the SequenceState


def draft_tree(ctx: StepContext, seq: SequenceState, max_depth: int) -> Tree:
    device = ctx.target_cache.device
    if ctx.spec.method == "autoregressive" or max_depth < 1:
        return Tree.single(seq.root_id, device)
    pending = seq.token_ids[ctx.drafter.cache.length : len(seq.token_ids) - 1]
    limits = GrowLimits(budget=ctx.budget, max_depth=max_depth, stop_mask=ctx.stop_mask)
    if ctx.spec.method == "specinfer":
        return grow_sampled_tree(ctx.drafter, seq.root_id, pending, seq.params, limits, seq.generator)
    return grow_tree(ctx.drafter, seq.root_id, pending, seq.params, ctx.spec, limits)


def score_tree(ctx: StepContext, tree: Tree) -> torch.Tensor:
    """One target pass over every tree node (node i at slot prefix + i). Returns [n, vocab]."""
    start = ctx.target_cache.length
    positions = start + tree.depths
    mask = prefix_tree_mask(tree.ancestors, start)
    return ctx.target.forward(tree.token_ids, positions, ctx.target_cache, start, mask)


def verify_step(
    tree: Tree,
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    generator: torch.Generator,
    track_acceptance: bool = False,
    rows_per_block: int | None = None,
) -> Verdict:
    """Process every node's logits from its own path, then verify. Pure: tensors in, verdict out.

    logits: [n, vocab] raw target logits; output_counts: [vocab] counts of the generated tokens so
    far, the root among them unless it is the prompt's last token (nodes below the root are added
    per path); track_acceptance: sampled verdicts carry node_log_probs (budget auto's curve). Rows are
    processed in blocks of rows_per_block (None: LOGITS_BLOCK_BYTES per block)."""
    nodes = NodeLogits(tree, logits, params, output_counts, prompt_mask)
    with_log_probs = track_acceptance and not params.greedy
    if tree.draft_probs is not None and not params.greedy:
        return verify_specinfer(tree, nodes, generator, rows_per_block, with_log_probs)
    return verify_tree(tree, nodes, params.greedy, generator, rows_per_block, with_log_probs)


def step_curve(ctx: StepContext, seq: SequenceState, tree: Tree, verdict: Verdict) -> torch.Tensor:
    """[n - 1] E[accepted] per smaller budget (empty unless tracking); greedy counts argmax paths."""
    if not ctx.track_acceptance:
        return tree.scores.new_zeros(0)
    if seq.params.greedy:
        return acceptance_curve(node_indicator(tree.num_nodes, verdict.path))
    assert verdict.node_log_probs is not None, "verify_step(track_acceptance=True) gives the log-probs"
    return acceptance_curve(path_probabilities(tree, verdict.node_log_probs))


def run_step(ctx: StepContext, seq: SequenceState) -> tuple[list[int], StepStats]:
    """Append the step's tokens (accepted path + bonus) to `seq`; returns them and the step's stats."""
    device = ctx.target_cache.device
    begin = time.perf_counter()
    clock = PhaseClock(device)  # draft | target, read after the step's host sync below
    remaining = min(seq.params.max_tokens - seq.emitted, ctx.max_context - len(seq.token_ids))
    tree = draft_tree(ctx, seq, min(ctx.spec.max_depth, remaining - 1))
    clock.mark()
    logits = score_tree(ctx, tree)
    clock.mark()
    verdict = verify_step(
        tree, logits, seq.params, seq.output_counts, seq.prompt_mask, seq.generator, ctx.track_acceptance
    )
    ctx.target_cache.commit(ctx.target_cache.length + verdict.path)
    ctx.drafter.commit(tree, verdict.path)
    num_new = verdict.path.shape[0]
    new_id_tensor = torch.cat([tree.token_ids[verdict.path[1:]], verdict.bonus_id.reshape(1)])  # [num_new]
    token_lp = emitted_logprobs(tree, logits, seq.params, seq.output_counts, seq.prompt_mask,
                                verdict.path, new_id_tensor)  # read before this step's counts are added
    seq.output_counts.index_add_(0, new_id_tensor, torch.ones(num_new, device=device))
    curve = step_curve(ctx, seq, tree, verdict)
    summary = torch.cat([new_id_tensor.double(), curve.double(), token_lp]).tolist()
    # ^ the step's last host sync (verification's path is the other)
    new_ids = [int(t) for t in summary[:num_new]]
    lp_begin = num_new + curve.shape[0]
    seq.acceptance_curve = summary[num_new:lp_begin] if ctx.track_acceptance else None
    seq.step_logprobs = unpack_logprobs(summary[lp_begin:], num_new) if seq.params.logprobs is not None else None
    seq.token_ids.extend(new_ids)
    draft_seconds, target_seconds = clock.seconds()
    stats = StepStats(
        tree_size=tree.num_nodes,
        num_accepted=len(new_ids) - 1,
        num_emitted=len(new_ids),
        draft_seconds=draft_seconds,
        target_seconds=target_seconds,
        step_seconds=time.perf_counter() - begin,
    )
    return new_ids, stats
