"""Which sequences run in the next step and with what tree budgets; what each step's tokens mean for them.

    batch = scheduler.schedule(budget)      # every running sequence: budgets split, joiners' prompt slices
    outcome = run_batch(target, items)      # engine.speculation.batch: trees, ONE target pass, verification
    output = scheduler.postprocess(batch, outcome)  # stop / length checks, deltas, slots released

Sequences join between steps (`admit`, up to max_running, each taking a KV slot from the pool with
the longest cached prefix of its prompt) and leave after the step that finishes them or on `abort`.
The tree budget is shared: one pass scores at most `budget` draft nodes in all (plus each tree's
root), split by each sequence's marginal expected accepted tokens (budget.split_budget over a
per-sequence moving average of its acceptance curve).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from engine.model.kv_pool import Acquired, KVPool
from engine.pass_times import PassTimes
from engine.speculation.batch import BatchItem, BatchResult
from engine.speculation.budget import split_budget
from engine.speculation.step import SequenceState, StepContext
from engine.types import FinishReason, GenerationStats, PassStats, Request, StepOutput, StepStats, TokenDelta

CURVE_ALPHA = 0.3  # per-sequence acceptance curve: weight of the newest step


@dataclass
class Running:
    """One admitted request: its sequence, its step context (caches, drafter) and bookkeeping."""

    request: Request
    seq: SequenceState
    ctx: StepContext
    acquired: Acquired
    stop_ids: frozenset[int]
    totals: GenerationStats
    prefill_ids: list[int]  # target prompt tokens still to write (before the first step)
    draft_prefill_ids: list[int]
    admitted_at: float
    curve: np.ndarray | None = None  # [budget + 1] E[accepted] per budget, moving average; NaN unseen
    first_step: bool = True

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def batch_item(self, slice_len: int | None) -> BatchItem:
        """This step's part: up to `slice_len` more prompt tokens (None: all), and a tree once the
        prompt is all written (the draft's prompt follows the target's, the rest with the tree)."""
        take = len(self.prefill_ids) if slice_len is None else min(slice_len, len(self.prefill_ids))
        target_ids, self.prefill_ids = self.prefill_ids[:take], self.prefill_ids[take:]
        decode = not self.prefill_ids
        draft_take = len(self.draft_prefill_ids) if decode else min(take, len(self.draft_prefill_ids))
        draft_ids, self.draft_prefill_ids = self.draft_prefill_ids[:draft_take], self.draft_prefill_ids[draft_take:]
        return BatchItem(self.ctx, self.seq, target_ids, draft_ids, decode)


def update_curve(old: np.ndarray | None, new: list[float], size: int) -> np.ndarray:
    """Moving average (CURVE_ALPHA) of E[accepted] per budget 1..len(new); entries beyond stay as they were."""
    curve = np.full(size + 1, np.nan) if old is None else old.copy()
    curve[0] = 0.0
    values = np.asarray(new[:size], dtype=np.float64)
    seen = curve[1 : values.shape[0] + 1]
    seen[:] = np.where(np.isnan(seen), values, (1.0 - CURVE_ALPHA) * seen + CURVE_ALPHA * values)
    return curve


class Scheduler:
    def __init__(self, pool: KVPool, max_running: int, max_context: int, max_budget: int, prefill_slice: int = 0):
        self.pool = pool
        self.max_budget = max_budget  # the largest total budget (per-sequence curves' length)
        self.max_running = max_running
        self.max_context = max_context
        self.running: list[Running] = []
        self.num_steps = 0
        self.pass_times = PassTimes()  # what prompt slices may add to a pass
        self.prefill_slice = prefill_slice  # fixed prompt tokens per pass while others decode; 0: pass_times

    @property
    def free_running_slots(self) -> int:
        return min(self.max_running - len(self.running), self.pool.num_free)

    def add(self, running: Running) -> None:
        assert len(self.running) < self.max_running, "admit only below max_running"
        self.running.append(running)

    def schedule(self, total_budget: int) -> list[tuple[Running, BatchItem]]:
        """Every running sequence and its part of the step. While some sequences decode, joining ones
        write their prompts in slices (pass_times.slice_tokens in all, first come first served), so the
        decoding ones' steps stay short; the decoding ones share the pass's tree nodes (ctx.budget)."""
        decoding = [r for r in self.running if not r.prefill_ids]
        room = None
        if decoding:
            room = self.prefill_slice or self.pass_times.slice_tokens(total_budget + len(decoding))
        items = []
        for running in self.running:
            slice_len = None if room is None or not running.prefill_ids else room
            item = running.batch_item(slice_len)
            if room is not None:
                room = max(0, room - len(item.prefill_ids))
            items.append((running, item))
        # autoregressive requests (their own method) grow no tree: the others share the nodes
        trees = [running for running, item in items if item.decode and running.ctx.spec.method != "autoregressive"]
        budgets = split_budget([r.curve for r in trees], total_budget) if trees else []
        for running, budget in zip(trees, budgets, strict=True):
            running.ctx.budget = budget
        return items

    def postprocess(self, batch: list[Running], outcome: BatchResult, step_begin: float) -> StepOutput:
        """Finish checks and deltas of the sequences that decoded (none for one that only prefilled;
        failed ones are the caller's); finished sequences leave and release their slots."""
        self.num_steps += 1
        self.pass_times.observe(outcome.pass_tokens, outcome.target_seconds)
        output = StepOutput()
        for running, result in zip(batch, outcome.results, strict=True):
            if result is None or isinstance(result, Exception):
                continue
            output.deltas.append(self._delta(running, *result))
        num_tree_nodes = sum(r[1].tree_size for r in outcome.results if isinstance(r, tuple))
        output.stats = PassStats(
            num_requests=len(output.deltas),
            num_tree_nodes=num_tree_nodes,
            num_prefill_tokens=outcome.pass_tokens - num_tree_nodes,
            num_emitted=sum(len(d.token_ids) for d in output.deltas),
            draft_seconds=outcome.draft_seconds,
            target_seconds=outcome.target_seconds,
            step_seconds=time.perf_counter() - step_begin,
            overlap_seconds=outcome.overlap_seconds,
            extension_forwards=outcome.extension_forwards,
            draft_forwards=outcome.draft_forwards,
            seeded_trees=outcome.seeded_trees,
        )
        return output

    def _delta(self, running: Running, new_ids: list[int], stats: StepStats) -> TokenDelta:
        seq = running.seq
        if running.ctx.track_acceptance and seq.acceptance_curve:
            running.curve = update_curve(running.curve, seq.acceptance_curve, self.max_budget)
        new_ids, finish = self.finish(running, new_ids)
        seq.emitted += len(new_ids)
        # after stop / max_tokens truncation: the draft's tokens among those kept
        stats = dataclasses.replace(stats, num_emitted=len(new_ids), num_accepted=min(stats.num_accepted, len(new_ids)))
        running.totals.add_step(stats, decode=not running.first_step)
        if running.first_step:  # the prompt's prefill and the first tokens: admission to now
            running.first_step = False
            running.totals.prefill_seconds = time.perf_counter() - running.admitted_at
        logprobs = None if seq.step_logprobs is None else seq.step_logprobs[: len(new_ids)]
        totals = running.totals if finish else None
        if finish is not None and seq.prediction is not None:
            running.totals.prediction_tokens = len(seq.prediction.token_ids)
            running.totals.accepted_prediction_tokens = seq.prediction.accepted
        if finish is not None:
            self.release(running)
        return TokenDelta(running.request_id, new_ids, finish, stats, totals, logprobs)

    def finish(self, running: Running, new_ids: list[int]) -> tuple[list[int], FinishReason | None]:
        seq = running.seq
        for idx, token_id in enumerate(new_ids):
            if token_id in running.stop_ids:
                return new_ids[:idx], FinishReason.STOP
        room = seq.params.max_tokens - seq.emitted
        grammar = seq.grammar  # terminated: its stop token (EOS) was output, so ignore_eos was set
        if grammar is not None and grammar.terminated and grammar.num_consumed <= room:
            return new_ids[: grammar.num_consumed], FinishReason.STOP
        if len(new_ids) >= room:
            return new_ids[:room], FinishReason.LENGTH
        if len(seq.token_ids) >= self.max_context:
            return new_ids, FinishReason.LENGTH
        return new_ids, None

    def release(self, running: Running, reusable: bool = True) -> None:
        """The sequence leaves; its slot keeps its KV for the prefix cache (unless not `reusable`:
        a failed step may have left the caches half written)."""
        self.running.remove(running)
        tokens = running.seq.token_ids if reusable else []
        if not reusable:
            running.acquired.slot.target.reset()
            if running.acquired.slot.draft is not None:
                running.acquired.slot.draft.reset()
        self.pool.release(running.acquired.slot, tokens)

    def abort(self, request_id: str) -> TokenDelta | None:
        """Drop a running sequence between steps; its final delta (ABORT, totals so far)."""
        for running in self.running:
            if running.request_id == request_id:
                self.release(running)
                return TokenDelta(request_id, [], FinishReason.ABORT, totals=running.totals)
        return None
