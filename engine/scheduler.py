"""Which sequences run in the next step and with what tree budgets; what each step's tokens mean for them.

    batch = scheduler.schedule()            # every running sequence, budgets split, joiners' prefills
    results = run_batch(target, batch)      # engine.speculation.batch: trees, ONE target pass, verification
    output = scheduler.postprocess(batch, results)  # stop / length checks, deltas, slots released

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
from engine.speculation.batch import BatchItem
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

    def batch_item(self) -> BatchItem:
        item = BatchItem(self.ctx, self.seq, self.prefill_ids, self.draft_prefill_ids)
        self.prefill_ids, self.draft_prefill_ids = [], []
        return item


def update_curve(old: np.ndarray | None, new: list[float], size: int) -> np.ndarray:
    """Moving average (CURVE_ALPHA) of E[accepted] per budget 1..len(new); entries beyond stay as they were."""
    curve = np.full(size + 1, np.nan) if old is None else old.copy()
    curve[0] = 0.0
    values = np.asarray(new[:size], dtype=np.float64)
    seen = curve[1 : values.shape[0] + 1]
    seen[:] = np.where(np.isnan(seen), values, (1.0 - CURVE_ALPHA) * seen + CURVE_ALPHA * values)
    return curve


class Scheduler:
    def __init__(self, pool: KVPool, max_running: int, max_context: int, max_budget: int):
        self.pool = pool
        self.max_budget = max_budget  # the largest total budget (per-sequence curves' length)
        self.max_running = max_running
        self.max_context = max_context
        self.running: list[Running] = []
        self.num_steps = 0

    @property
    def free_running_slots(self) -> int:
        return min(self.max_running - len(self.running), self.pool.num_free)

    def add(self, running: Running) -> None:
        assert len(self.running) < self.max_running, "admit only below max_running"
        self.running.append(running)

    def schedule(self, total_budget: int) -> list[Running]:
        """Every running sequence, each with its share of the pass's tree nodes in ctx.budget."""
        budgets = split_budget([r.curve for r in self.running], total_budget)
        for running, budget in zip(self.running, budgets, strict=True):
            running.ctx.budget = budget
        return list(self.running)

    def postprocess(
        self, batch: list[Running], results: list[tuple[list[int], StepStats]], step_begin: float
    ) -> StepOutput:
        """Finish checks and deltas; finished sequences leave and release their slots."""
        self.num_steps += 1
        output = StepOutput()
        for running, (new_ids, stats) in zip(batch, results, strict=True):
            seq = running.seq
            if running.ctx.track_acceptance and seq.acceptance_curve:
                running.curve = update_curve(running.curve, seq.acceptance_curve, self.max_budget)
            new_ids, finish = self.finish(running, new_ids)
            seq.emitted += len(new_ids)
            stats = dataclasses.replace(stats, num_emitted=len(new_ids))  # after stop / max_tokens truncation
            running.totals.add_step(stats, decode=not running.first_step)
            if running.first_step:  # the prompt's prefill and the first tokens: admission to now
                running.first_step = False
                running.totals.prefill_seconds = time.perf_counter() - running.admitted_at
            logprobs = None if seq.step_logprobs is None else seq.step_logprobs[: len(new_ids)]
            totals = running.totals if finish else None
            output.deltas.append(TokenDelta(running.request_id, new_ids, finish, stats, totals, logprobs))
            if finish is not None:
                self.release(running)
        if results:
            stats = results[0][1]
            output.stats = PassStats(
                num_requests=len(batch),
                num_tree_nodes=sum(s.tree_size for _, s in results),
                num_prefill_tokens=stats.pass_tokens - sum(s.tree_size for _, s in results),
                num_emitted=sum(len(d.token_ids) for d in output.deltas),
                draft_seconds=stats.draft_seconds,
                target_seconds=stats.target_seconds,
                step_seconds=time.perf_counter() - step_begin,
            )
        return output

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
