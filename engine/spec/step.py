"""One decoding step for one sequence: draft a tree -> one target pass -> verify -> commit."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import SpeculationConfig
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner
from engine.offload.device import timed
from engine.spec.budget import acceptance_curve, node_indicator
from engine.spec.draft import Drafter, GrowLimits, grow_sampled_tree, grow_tree
from engine.spec.sampling import process_logits
from engine.spec.tree import Tree, causal_mask, path_token_counts, prefix_tree_mask
from engine.spec.verify import Verdict, path_probabilities, verify_specinfer, verify_tree
from engine.types import SamplingParams, StepStats

PREFILL_CHUNK = 512


@dataclass
class SequenceState:
    """Committed tokens of one request; the last one is the root of the next tree (no KV yet)."""

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    output_counts: torch.Tensor  # [vocab] float, generated tokens so far (penalties)
    prompt_mask: torch.Tensor | None  # [vocab] bool, tokens of the prompt (repetition penalty)
    emitted: int = 0
    acceptance_curve: list[float] | None = None  # last step's E[accepted] per budget 1..n-1 (budget auto)

    @property
    def root_id(self) -> int:
        return self.token_ids[-1]


def prefill(runner: DecoderRunner, cache: KVCache, token_ids: list[int]) -> None:
    """Write the KV of `token_ids` after the committed prefix, in chunks; computes no logits."""
    device = cache.device
    no_rows = torch.zeros(0, dtype=torch.long, device=device)
    for begin in range(0, len(token_ids), PREFILL_CHUNK):
        chunk = torch.tensor(token_ids[begin : begin + PREFILL_CHUNK], device=device)
        start = cache.length
        positions = torch.arange(start, start + chunk.shape[0], device=device)
        runner.forward(chunk, positions, cache, start, causal_mask(chunk.shape[0], start, device), no_rows)
        cache.length = start + chunk.shape[0]


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
    include_root: bool,
    generator: torch.Generator,
) -> Verdict:
    """Process every node's logits from its own path, then verify. Pure: tensors in, verdict out.

    logits: [n, vocab] raw target logits; output_counts: [vocab] generated tokens before the root;
    include_root: the root is a generated token (not the prompt's last), so penalties count it."""
    counts = None
    if params.uses_penalties:
        counts = output_counts[None] + path_token_counts(tree, logits.shape[1], include_root)
    processed = process_logits(logits, params, counts, prompt_mask)
    if tree.draft_probs is not None and not params.greedy:
        tree.draft_probs = align_vocab(tree.draft_probs, processed.shape[1])
        return verify_specinfer(tree, processed, generator)
    return verify_tree(tree, processed, params.greedy, generator)


def align_vocab(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if probs.shape[1] >= vocab_size:
        return probs[:, :vocab_size]
    return torch.cat([probs, probs.new_zeros(probs.shape[0], vocab_size - probs.shape[1])], dim=1)


def step_curve(ctx: StepContext, seq: SequenceState, tree: Tree, verdict: Verdict) -> torch.Tensor:
    """[n - 1] E[accepted] per smaller budget (empty unless tracking); greedy counts argmax paths."""
    if not ctx.track_acceptance:
        return tree.scores.new_zeros(0)
    if seq.params.greedy:
        return acceptance_curve(node_indicator(tree.num_nodes, verdict.path))
    return acceptance_curve(path_probabilities(tree, verdict.logits))


def run_step(ctx: StepContext, seq: SequenceState) -> tuple[list[int], StepStats]:
    """Append the step's tokens (accepted path + bonus) to `seq`; returns them and the step's stats."""
    device = ctx.target_cache.device
    begin = time.perf_counter()
    remaining = min(seq.params.max_tokens - seq.emitted, ctx.max_context - len(seq.token_ids))
    tree = draft_tree(ctx, seq, min(ctx.spec.max_depth, remaining - 1))
    draft_seconds = timed(device, begin)
    logits = score_tree(ctx, tree)
    target_seconds = timed(device, begin) - draft_seconds
    include_root = len(seq.token_ids) > seq.prompt_len
    verdict = verify_step(tree, logits, seq.params, seq.output_counts, seq.prompt_mask, include_root, seq.generator)
    ctx.target_cache.commit(ctx.target_cache.length + verdict.path)
    ctx.drafter.commit(tree, verdict.path)
    num_new = verdict.path.shape[0]
    new_id_tensor = torch.cat([tree.token_ids[verdict.path[1:]], verdict.bonus_id.reshape(1)])  # [num_new]
    seq.output_counts.index_add_(0, new_id_tensor, torch.ones(num_new, device=device))
    summary = torch.cat([new_id_tensor.double(), step_curve(ctx, seq, tree, verdict).double()]).tolist()
    # ^ the step's last host sync (verification's path is the other)
    new_ids = [int(t) for t in summary[:num_new]]
    seq.acceptance_curve = summary[num_new:] if ctx.track_acceptance else None
    seq.token_ids.extend(new_ids)
    stats = StepStats(
        tree_size=tree.num_nodes,
        num_accepted=len(new_ids) - 1,
        num_emitted=len(new_ids),
        draft_seconds=draft_seconds,
        target_seconds=target_seconds,
        step_seconds=time.perf_counter() - begin,
    )
    return new_ids, stats
