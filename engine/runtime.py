"""The script API: load a target/draft pair once, then generate token ids from token ids.

    engine = Engine.load(EngineConfig(model=ModelConfig(target=..., draft=...)))
    for delta in engine.generate(Request("r1", prompt_ids, SamplingParams(temperature=0))):
        ...

Several requests run at once (the server's AsyncEngine drives `add_request` / `step` / `abort_request`;
`generate` runs one request alone): each step grows every running request's tree and scores them all
in one target pass (engine.scheduler, engine.speculation.batch). KV caches for max_running requests plus
the prefix cache are allocated at load, after a memory plan (engine.model.memory_plan) checked that
they and a step's workspaces fit. A CUDA runtime error raises EngineFault (the engine is down);
running out of device memory fails that step's requests alone with OutOfMemory.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from engine.config import EngineConfig, Method, SpeculationConfig
from engine.model import checkpoint, faults, memory, memory_plan
from engine.model.draft_graphs import DraftGraphs, graphable
from engine.model.kv_pool import Acquired, KVPool, KVSlot
from engine.model.pair import LoadedPair, load_pair
from engine.offload.device import PassStreams
from engine.scheduler import Running, Scheduler
from engine.speculation.batch import run_batch
from engine.speculation.budget import BudgetTracker, budget_grid, calibration_budgets, largest_budget
from engine.speculation.drafter import Drafter
from engine.speculation.grammar import GrammarCache
from engine.speculation.prediction import Prediction
from engine.speculation.rrs_shape import ShapeBook
from engine.speculation.sampling import logits_workspace_bytes, make_generator
from engine.speculation.step import PREFILL_CHUNK, SequenceState, StepContext
from engine.types import (
    ConfigError,
    ContextLengthError,
    EngineFault,
    GenerationStats,
    OutOfMemory,
    Request,
    SamplingParams,
    StepOutput,
    StructuredOutput,
    TokenDelta,
)

log = logging.getLogger("specexec.engine")

CALIBRATION_TEXT = "def main(argv):\n    for index, value in enumerate(argv):\n        print(index, value)\n"


class Engine:
    def __init__(self, pair: LoadedPair, config: EngineConfig):
        self.pair = pair
        spec = config.speculation
        hybrid_draft = pair.draft is not None and any(pair.draft.linear_layers)
        config = dataclasses.replace(config, speculation=spec.resolved(
            pair.target.device.type, hybrid_draft, largest_budget(spec.budget), config.limits.max_running))
        self.config = config
        self.tokenizer = pair.tokenizer
        self.eos_token_ids = pair.eos_token_ids
        self.max_context = pair.max_context
        self.model_name = config.model.name or config.model.target.rstrip("/").split("/")[-1]
        self.device = pair.target.device
        spec = config.speculation
        auto = spec.budget == "auto" and spec.method != "autoregressive"
        self.budget_tracker: BudgetTracker | None = BudgetTracker() if auto else None
        self.grammars = GrammarCache(self.tokenizer, pair.target.vocab_size, sorted(self.eos_token_ids))
        self.max_running = config.limits.max_running
        overlap = spec.overlap and pair.draft is not None and spec.method != "autoregressive"
        self.pass_streams = PassStreams(self.device) if overlap else None  # the draft beside the target pass
        self._use_draft_graphs(bool(spec.draft_graphs) and spec.method != "autoregressive")
        self.pool: KVPool | None = None  # allocated by reserve_memory (or the first request)
        self.shape_book = ShapeBook(self.device, config.speculation.decay)  # RRS trees' evidence across requests
        self.scheduler: Scheduler | None = None

    def _use_draft_graphs(self, wanted: bool) -> None:
        """The draft's tree forwards as CUDA graphs (a static pass, uncaptured on a CPU) where its pass has a
        static form; graphs already captured are kept across engines over the same pair."""
        draft = self.pair.draft
        if draft is None:
            return
        if not (wanted and graphable(draft)):
            draft.graphs = None
        elif draft.graphs is None:
            draft.graphs = DraftGraphs(draft, capture=draft.device.type == "cuda")

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Load the pair, check the memory plan and allocate the KV caches, calibrate --budget auto."""
        try:
            pair = load_pair(config)
        except torch.OutOfMemoryError as exc:
            message = faults.first_line(exc)
        else:
            engine = cls(pair, config)
            engine.reserve_memory()
            if engine.budget_tracker is not None:
                engine.calibrate_budget()
            return engine
        gc.collect()  # the failed load's frames (and the weights they hold) went with the exception
        faults.release_device_memory(checkpoint.resolve_device(config.model.device))
        raise memory.weights_do_not_fit(config, message)

    def close(self) -> None:
        """Stop the target's layer streamer; the engine serves no more steps. Idempotent."""
        self.pair.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def with_speculation(self, spec: SpeculationConfig) -> Engine:
        """The same loaded models under other speculation settings (benchmarks); shares the KV pool
        (grown if this budget needs larger caches). Not while requests run."""
        engine = Engine(self.pair, dataclasses.replace(self.config, speculation=spec))
        engine.max_running = self.max_running
        if self.pool is not None:
            engine._use_pool(self.pool)
        return engine

    # -- memory ------------------------------------------------------------------------------
    def memory_plan_inputs(self, budget: int | None = None) -> memory_plan.PlanInputs:
        """What the device must hold for this pair at max_context with trees of `budget` (default: ours),
        for max_running requests and as many KV slots (reserve_memory adds the prefix cache's)."""
        limits = (self.max_context, budget or self.budget, PREFILL_CHUNK)
        workspace = logits_workspace_bytes(self.pair.target.vocab_size)
        inputs = memory.plan_inputs(self.pair.target, self.pair.draft, self.config.speculation, limits, workspace)
        return dataclasses.replace(inputs, max_running=self.max_running, kv_slots=self.max_running)

    def reserve_memory(self) -> memory_plan.MemoryPlan:
        """Size the KV pool to what fits (up to max_running + prefix_cache_slots slots; fewer running
        requests and cache slots when short, logged), check the plan against free device memory,
        then allocate the pool. Raises ConfigError saying what does not fit and what to change."""
        limits = self.config.limits
        self.cap_budget_for_states()
        inputs = self.memory_plan_inputs()
        fit = memory_plan.kv_slots_that_fit(inputs, memory.free_device_memory(self.device))
        self.max_running = max(1, min(limits.max_running, fit))
        cache_slots = max(0, min(limits.prefix_cache_slots, fit - self.max_running))
        if self.max_running < limits.max_running or cache_slots < limits.prefix_cache_slots:
            log.warning("device memory holds KV caches for %d running requests and %d prefix cache slots "
                        "(asked: --max-running %d, --prefix-cache-slots %d); lower --max-context or --budget "
                        "for more", self.max_running, cache_slots, limits.max_running, limits.prefix_cache_slots)
        inputs = dataclasses.replace(self.memory_plan_inputs(), kv_slots=self.max_running + cache_slots)
        plan = memory_plan.plan_memory(inputs)
        memory_plan.check_fits(inputs, plan, memory.free_device_memory(self.device), str(self.device))
        log.info("device memory plan on %s: %s in all (%s)", self.device, memory_plan.gb(plan.total), plan.describe())
        if inputs.target.linear is not None and limits.prefix_cache_slots > 0:
            log.info("prefix cache: the target's linear-attention state cannot be cut at a shared prefix, so a "
                     "cached sequence is reused only when a prompt extends all of it (a conversation's next turn)")
        try:
            self._use_pool(self._new_pool(inputs.kv_slots, reuse=limits.prefix_cache_slots > 0))
        except torch.OutOfMemoryError as exc:
            message = faults.first_line(exc)
        else:
            return plan
        self.pool = self.scheduler = None
        gc.collect()
        faults.release_device_memory(self.device)
        raise ConfigError("limits.max_context", f"the KV caches do not fit on {self.device} ({message}); lower "
                          f"--max-context (now {self.max_context}), --max-running or --budget, or use a smaller draft")

    def cap_budget_for_states(self) -> None:
        """A hybrid model keeps every tree node's linear-attention rows until the commit (memory_plan:
        linear-attention states): where one KV slot's no longer fits beside the rest, the budget is capped
        to the largest that fits, with a log line (check_fits refuses when none does)."""
        inputs = self.memory_plan_inputs()
        if inputs.target.linear is None and (inputs.draft is None or inputs.draft.linear is None):
            return
        free = memory.free_device_memory(self.device)
        if memory_plan.kv_slots_that_fit(inputs, free) > 0:
            return
        low, high, best = 1, self.budget - 1, None
        while low <= high:
            mid = (low + high) // 2
            if memory_plan.kv_slots_that_fit(self.memory_plan_inputs(mid), free) > 0:
                best, low = mid, mid + 1
            else:
                high = mid - 1
        if best is None:
            return
        per_node = memory_plan.linear_state_bytes(inputs.target, 1) - memory_plan.linear_state_bytes(inputs.target, 0)
        log.warning("the linear-attention rows of a %d-node tree (%s a node) do not fit on %s beside the rest: "
                    "budget capped to %d", self.budget + 1, memory_plan.gb(per_node), self.device, best)
        spec = self.config.speculation
        if isinstance(spec.budget, int):
            self.config = dataclasses.replace(self.config, speculation=dataclasses.replace(spec, budget=best))
        else:
            self.budget_tracker = BudgetTracker(grid=budget_grid(best))

    def _new_pool(self, num_slots: int, reuse: bool) -> KVPool:
        spec = self.config.speculation
        target_capacity, draft_capacity = memory_plan.cache_capacities(
            self.max_context, self.budget, spec.max_depth, spec.max_expand
        )
        draft, target = self.pair.draft, self.pair.target
        # a hybrid model's caches: rows of its uncommitted tokens (tree nodes, expanded draft nodes)
        target_pending, draft_pending = memory_plan.pending_slots(self.max_context, self.budget, spec.max_depth,
                                                                  spec.max_expand, spec.extension_factor)
        drafts = draft.new_caches(num_slots, draft_capacity, draft_pending) if draft else [None] * num_slots
        slots = [KVSlot(target.new_cache(target_capacity, target_pending), draft_cache) for draft_cache in drafts]
        if draft is not None and draft.graphs is not None:
            draft.graphs.forget()  # graphs over an earlier pool's caches
        return KVPool(slots, reuse)

    def _use_pool(self, pool: KVPool) -> None:
        """Serve from `pool`, replaced by a fresh one of the same size if its caches are too small."""
        spec = self.config.speculation
        target_capacity, draft_capacity = memory_plan.cache_capacities(
            self.max_context, self.budget, spec.max_depth, spec.max_expand
        )
        slot = pool.slots[0]
        if slot.target.capacity < target_capacity or (slot.draft is not None and slot.draft.capacity < draft_capacity):
            pool = self._new_pool(len(pool.slots), pool.reuse)
        self.pool = pool
        self.scheduler = Scheduler(pool, self.max_running, self.max_context, self.budget,
                                   self.config.limits.prefill_slice)

    @property
    def budget(self) -> int:
        """The fixed budget, or with --budget auto the largest the tracker may choose (sizes caches)."""
        budget = self.config.speculation.budget
        if isinstance(budget, int):
            return budget
        return self.budget_tracker.max_budget if self.budget_tracker is not None else 1

    def calibrate_budget(self) -> None:
        """--budget auto: time a few real steps at fixed budgets (after one warm-up step)."""
        tracker = self.budget_tracker
        assert tracker is not None, "calibrate_budget needs --budget auto"
        budgets = calibration_budgets(tracker.grid)
        tracker.force([budgets[0], *budgets])
        text_ids = self.tokenizer.encode(CALIBRATION_TEXT) if self.tokenizer is not None else []
        prompt = text_ids or list(range(1, 33))
        max_steps_tokens = (self.config.speculation.max_depth + 1) * (len(budgets) + 1)
        max_tokens = min(self.max_context - len(prompt), max_steps_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for num_steps, _delta in enumerate(self.generate(Request("calibration", prompt, params)), start=1):
            if num_steps == len(budgets) + 1:
                break
        tracker.force([])

    # -- requests ----------------------------------------------------------------------------
    def validate_request(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        if prompt_len + max_tokens > self.max_context:
            raise ContextLengthError(prompt_len, max_tokens, self.max_context)

    def validate_structured_output(self, spec: StructuredOutput) -> None:
        self.grammars.compile(spec)

    def validate_method(self, method: Method | None) -> None:
        """A request's own speculation method: autoregressive always runs; the others need the draft."""
        if method not in (None, "autoregressive") and self.pair.draft is None:
            raise ValueError(f"method {method} needs a draft model; this engine runs without one")

    def request_speculation(self, request: Request) -> SpeculationConfig:
        """The speculation settings a request runs under: the engine's, with the request's own method."""
        spec = self.config.speculation
        return spec if request.method in (None, spec.method) else dataclasses.replace(spec, method=request.method)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """Token ids that end the request: its stop ids, and EOS unless ignored."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return frozenset(params.stop_token_ids) | eos

    @property
    def num_running(self) -> int:
        return 0 if self.scheduler is None else len(self.scheduler.running)

    @property
    def can_add(self) -> bool:
        """Whether add_request would take another request now."""
        return self.scheduler is None or self.scheduler.free_running_slots > 0

    def add_request(self, request: Request) -> None:
        """Admit a request: a KV slot (with the longest cached prefix of its prompt) and its sequence
        state; its prompt is prefilled by the next step's target pass. Raises ValueError /
        ContextLengthError for a request that cannot run; needs can_add."""
        self.validate_request(len(request.prompt_ids), request.params.max_tokens)
        self.validate_method(request.method)
        if self.scheduler is None:
            self._use_pool(self._new_pool(self.max_running, self.config.limits.prefix_cache_slots > 0))
        assert self.scheduler is not None and self.pool is not None
        assert self.can_add, "add_request needs can_add"
        acquired = self.pool.acquire(list(request.prompt_ids))
        try:
            self.scheduler.add(self._running(request, acquired))
        except BaseException:
            self.pool.release(acquired.slot, [])
            raise

    def _running(self, request: Request, acquired: Acquired) -> Running:
        params = request.params
        vocab = self.pair.target.vocab_size
        prompt = list(request.prompt_ids)
        prompt_mask = None
        if params.repetition_penalty != 1.0:
            prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            prompt_mask[torch.tensor([i for i in prompt if i < vocab], dtype=torch.long)] = True
        structured = params.structured_output
        seq = SequenceState(
            token_ids=prompt,
            prompt_len=len(prompt),
            params=params,
            generator=make_generator(params.seed, self.device),
            output_counts=torch.zeros(vocab, device=self.device),
            prompt_mask=prompt_mask,
            grammar=None if structured is None else self.grammars.new_state(structured, self.device),
            prediction=Prediction(list(request.prediction_ids)) if request.prediction_ids else None,
        )
        spec = self.request_speculation(request)
        speculative_draft = self.pair.draft is not None and spec.method != "autoregressive"
        totals = GenerationStats(prompt_tokens=len(prompt), cached_tokens=acquired.cached_tokens)
        return Running(
            request=request,
            seq=seq,
            ctx=self._step_context(params, acquired, spec),
            acquired=acquired,
            stop_ids=self.stop_ids(params),
            totals=totals,
            prefill_ids=prompt[acquired.cached_tokens : -1],
            draft_prefill_ids=prompt[acquired.draft_cached_tokens : -1] if speculative_draft else [],
            admitted_at=time.perf_counter(),
        )

    def _step_context(self, params: SamplingParams, acquired: Acquired, spec: SpeculationConfig) -> StepContext:
        draft_runner = self.pair.draft or self.pair.target
        draft_cache = acquired.slot.draft if acquired.slot.draft is not None else draft_runner.new_cache(1)
        vocab = self.pair.target.vocab_size
        method = spec.tree_method(params.greedy, params.temperature, params.seed is not None)
        # where the trees grow (the growths read the stop mask there): the host for SpecExec trees with host_trees
        tree_device = torch.device("cpu") if spec.host_trees and method == "specexec" else self.device
        stop_mask = torch.zeros(max(vocab, draft_runner.vocab_size), dtype=torch.bool, device=tree_device)
        stop_mask[[i for i in self.stop_ids(params) if i < stop_mask.shape[0]]] = True
        return StepContext(
            target_cache=acquired.slot.target,
            drafter=Drafter(draft_runner, draft_cache, vocab, tree_device),
            spec=spec if method == spec.method else dataclasses.replace(spec, method=method),
            budget=self.budget,
            stop_mask=stop_mask,
            max_context=self.max_context,
            track_acceptance=True,  # budget auto and shared budgets use the curve; StepStats its expectation
            shape_book=self.shape_book,
        )

    def abort_request(self, request_id: str) -> TokenDelta | None:
        """Drop a running request between steps: its slot is freed (its KV kept for the prefix cache).
        Returns its final delta (FinishReason.ABORT, totals so far), None if it is not running."""
        return None if self.scheduler is None else self.scheduler.abort(request_id)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """schedule -> run -> postprocess: one target pass over every running request's tree.

        Raises EngineFault on a CUDA runtime error (the engine is down). An error that belongs to one
        request (its grammar, its sampling, running out of memory in its tree) fails that request alone
        (StepOutput.failures; its slot is freed) and the others go on; a failing target pass fails
        every request in it, and the engine goes on."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.running:
            return StepOutput()
        begin = time.perf_counter()
        tracker = self.budget_tracker
        # --budget auto: the pass's total, from the oldest running request's sampling regime
        total = self.budget if tracker is None else tracker.choose(scheduler.running[0].seq.params.acceptance_key)
        scheduled = scheduler.schedule(total)
        batch = [running for running, _ in scheduled]
        try:
            outcome = run_batch(self.pair.target, [item for _, item in scheduled], self.pass_streams)
        except Exception as exc:
            error = self._step_error(batch, exc)  # EngineFault raises from here
            del scheduled  # with the exception's frames cleared, the step's tensors are free
            return StepOutput(failures=self._fail(batch, [error] * len(batch)))
        failed = [(r, e) for r, e in zip(batch, outcome.results, strict=True) if isinstance(e, Exception)]
        failures = self._fail([r for r, _ in failed], [self._request_failure(r, e) for r, e in failed])
        if tracker is not None:
            self._observe(tracker, batch, outcome.results)
        output = scheduler.postprocess(batch, outcome, begin)
        output.failures = failures
        return output

    def _fail(self, batch: list[Running], errors: list[BaseException]) -> list[tuple[str, BaseException]]:
        """The requests leave; their slots are not reused (their caches may be half written). No full
        garbage collection here (it would hold the interpreter for the event loop too): the errors'
        frames are cleared, so what they held is freed when they are."""
        for running, error in zip(batch, errors, strict=True):
            self.scheduler.release(running, reusable=False)  # type: ignore[union-attr]
            traceback.clear_frames(error.__traceback__)
        if any(faults.is_out_of_memory(error) or isinstance(error, OutOfMemory) for error in errors):
            faults.release_device_memory(self.device)
        return [(running.request_id, error) for running, error in zip(batch, errors, strict=True)]

    def _observe(self, tracker: BudgetTracker, batch: list[Running], results: list) -> None:
        """--budget auto learns step times from single-request steps, acceptance from every request."""
        decoded = [(running, result) for running, result in zip(batch, results, strict=True) if isinstance(result, tuple)]
        for running, (_ids, stats) in decoded:
            key, curve = running.seq.params.acceptance_key, running.seq.acceptance_curve
            if len(batch) == 1:
                timings = (stats.draft_seconds, stats.target_seconds, stats.step_seconds)
                tracker.observe(key, stats.tree_size, timings, curve)
            else:
                tracker.observe_curve(key, curve)

    def _step_error(self, batch: list[Running], exc: Exception) -> BaseException:
        """What a failed pass's requests get: OutOfMemory (with what to change) or the error itself.
        A CUDA runtime error raises EngineFault instead."""
        if faults.is_device_fault(exc):
            raise EngineFault(f"device error while generating: {faults.first_line(exc)}") from exc
        if not faults.is_out_of_memory(exc):
            log.error("a step of %d request(s) failed", len(batch), exc_info=exc)
            return exc
        prompts = ", ".join(str(len(r.request.prompt_ids)) for r in batch)
        return OutOfMemory(
            f"out of device memory on {self.device} during a step of {len(batch)} request(s) (prompt tokens "
            f"{prompts}, tree budget {self.budget}): {faults.first_line(exc)}; the step's requests were dropped "
            "and their memory freed. Retry with a shorter prompt, or restart with a lower --budget, "
            "--max-running or --max-context"
        )

    def _request_failure(self, running: Running, exc: Exception) -> BaseException:
        """What a request that failed alone gets: its own error (StructuredOutputError and other
        ValueErrors say what about the request is wrong), OutOfMemory if it ran out of memory."""
        if faults.is_out_of_memory(exc):
            return self._step_error([running], exc)
        if not isinstance(exc, ValueError):
            log.error("request %s failed in a step", running.request_id, exc_info=exc)
        return exc

    # -- one request alone (scripts, benchmarks) -----------------------------------------------
    def generate(
        self, request: Request, should_abort: Callable[[], bool] | None = None
    ) -> Iterator[TokenDelta]:
        """Run one request alone: one TokenDelta per step, the last with finish_reason and totals.

        Raises EngineFault on a CUDA runtime error (the engine is down), and OutOfMemory when the
        device ran out of memory (this request's tensors are freed; the engine goes on)."""
        assert self.num_running == 0, "generate runs one request alone (the AsyncEngine serves several)"
        self.add_request(request)
        request_id = request.request_id
        try:
            while True:
                if should_abort is not None and should_abort():
                    delta = self.abort_request(request_id)
                    assert delta is not None
                    yield delta
                    return
                output = self.step()
                for failed_id, error in output.failures:
                    if failed_id == request_id:
                        raise error
                for delta in output.deltas:
                    yield delta
                    if delta.finish_reason is not None:
                        return
        finally:
            self.abort_request(request_id)  # a consumer that stopped early frees the slot

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """Convenience: the whole completion's token ids."""
        out: list[int] = []
        for delta in self.generate(Request("script", prompt_ids, params)):
            out.extend(delta.token_ids)
        return out
