"""The script API: load a target/draft pair once, then generate token ids from token ids.

    engine = Engine.load(EngineConfig(model=ModelConfig(target=..., draft=...)))
    for delta in engine.generate(Request("r1", prompt_ids, SamplingParams(temperature=0))):
        ...

One sequence runs at a time; its KV caches are allocated at load for the context plus the largest
tree, after a memory plan (engine.model.memory_plan) checked that they and a step's workspaces fit.
A CUDA runtime error while generating raises EngineFault (the engine is down); running out of device
memory fails that request alone with OutOfMemory.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator

import torch

from engine.config import EngineConfig, SpeculationConfig
from engine.model import checkpoint, faults, memory, memory_plan
from engine.model.kv_cache import KVCache
from engine.model.pair import LoadedPair, load_pair
from engine.model.runner import DecoderRunner
from engine.offload.device import synchronize_stream
from engine.spec.budget import BudgetTracker, calibration_budgets
from engine.spec.draft import Drafter
from engine.spec.sampling import logits_workspace_bytes, make_generator
from engine.spec.step import PREFILL_CHUNK, SequenceState, StepContext, prefill, run_step
from engine.types import (
    ConfigError,
    ContextLengthError,
    EngineFault,
    FinishReason,
    GenerationStats,
    OutOfMemory,
    Request,
    SamplingParams,
    TokenDelta,
)

log = logging.getLogger("specexec.engine")

CALIBRATION_TEXT = "def main(argv):\n    for index, value in enumerate(argv):\n        print(index, value)\n"


class Engine:
    def __init__(self, pair: LoadedPair, config: EngineConfig):
        self.pair = pair
        self.config = config
        self.tokenizer = pair.tokenizer
        self.eos_token_ids = pair.eos_token_ids
        self.max_context = pair.max_context
        self.model_name = config.model.name or config.model.target.rstrip("/").split("/")[-1]
        self.device = pair.target.device
        self._caches: dict[str, KVCache] = {}
        spec = config.speculation
        auto = spec.budget == "auto" and spec.method != "autoregressive"
        self.budget_tracker: BudgetTracker | None = BudgetTracker() if auto else None

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

    def with_speculation(self, spec: SpeculationConfig) -> Engine:
        """The same loaded models under other speculation settings (benchmarks); shares the KV caches."""
        engine = Engine(self.pair, dataclasses.replace(self.config, speculation=spec))
        engine._caches = self._caches  # one set of device buffers, grown if this budget needs more
        return engine

    def memory_plan_inputs(self, budget: int | None = None) -> memory_plan.PlanInputs:
        """What the device must hold for this pair at max_context with trees of `budget` (default: ours)."""
        limits = (self.max_context, budget or self.budget, PREFILL_CHUNK)
        workspace = logits_workspace_bytes(self.pair.target.vocab_size)
        return memory.plan_inputs(self.pair.target, self.pair.draft, self.config.speculation, limits, workspace)

    def reserve_memory(self) -> memory_plan.MemoryPlan:
        """Check the memory plan against free device memory, then allocate both KV caches (the first
        request allocates none). Raises ConfigError saying what does not fit and what to change."""
        inputs = self.memory_plan_inputs()
        plan = memory_plan.plan_memory(inputs)
        memory_plan.check_fits(inputs, plan, memory.free_device_memory(self.device), str(self.device))
        log.info("device memory plan on %s: %s in all (%s)", self.device, memory_plan.gb(plan.total), plan.describe())
        try:
            self._caches_for_request()
        except torch.OutOfMemoryError as exc:
            message = faults.first_line(exc)
        else:
            return plan
        self._caches.clear()
        gc.collect()
        faults.release_device_memory(self.device)
        raise ConfigError("limits.max_context", f"the KV caches do not fit on {self.device} ({message}); lower "
                          f"--max-context (now {self.max_context}) or --budget, or use a smaller draft")

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

    def validate_request(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        if prompt_len + max_tokens > self.max_context:
            raise ContextLengthError(prompt_len, max_tokens, self.max_context)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """Token ids that end the request: its stop ids, and EOS unless ignored."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return frozenset(params.stop_token_ids) | eos

    def _caches_for_request(self) -> tuple[KVCache, KVCache]:
        """The target and draft caches, emptied (allocated once, or again for a larger budget)."""
        spec = self.config.speculation
        target_capacity, draft_capacity = memory_plan.cache_capacities(
            self.max_context, self.budget, spec.max_depth, spec.max_expand
        )
        target_cache = self._cache("target", self.pair.target, target_capacity)
        draft_runner = self.pair.draft or self.pair.target
        draft_cache = self._cache("draft", draft_runner, draft_capacity if self.pair.draft else 1)
        return target_cache, draft_cache

    def _step_context(self, params: SamplingParams) -> StepContext:
        spec = self.config.speculation
        budget = self.budget
        target_cache, draft_cache = self._caches_for_request()
        draft_runner = self.pair.draft or self.pair.target
        vocab = self.pair.target.vocab_size
        stop_mask = torch.zeros(max(vocab, draft_runner.vocab_size), dtype=torch.bool, device=self.device)
        stop_mask[[i for i in self.stop_ids(params) if i < stop_mask.shape[0]]] = True
        return StepContext(
            target=self.pair.target,
            target_cache=target_cache,
            drafter=Drafter(draft_runner, draft_cache, vocab),
            spec=spec,
            budget=budget,
            stop_mask=stop_mask,
            max_context=self.max_context,
            track_acceptance=self.budget_tracker is not None,
        )

    def _cache(self, name: str, runner: DecoderRunner, capacity: int) -> KVCache:
        cache = self._caches.get(name)
        if cache is None or cache.capacity < capacity:
            cache = runner.new_cache(capacity)
            self._caches[name] = cache
        cache.reset()
        return cache

    def _start(self, request: Request, ctx: StepContext) -> SequenceState:
        vocab = self.pair.target.vocab_size
        prompt = list(request.prompt_ids)
        prompt_mask = None
        if request.params.repetition_penalty != 1.0:
            prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            prompt_mask[torch.tensor([i for i in prompt if i < vocab], dtype=torch.long)] = True
        prefill(ctx.target, ctx.target_cache, prompt[:-1])
        if self.pair.draft is not None and self.config.speculation.method != "autoregressive":
            prefill(ctx.drafter.runner, ctx.drafter.cache, prompt[:-1])
        synchronize_stream(self.device)  # prefill's tail is billed to prefill, not to the first draft
        return SequenceState(
            token_ids=prompt,
            prompt_len=len(prompt),
            params=request.params,
            generator=make_generator(request.params.seed, self.device),
            output_counts=torch.zeros(vocab, device=self.device),
            prompt_mask=prompt_mask,
        )

    def generate(
        self, request: Request, should_abort: Callable[[], bool] | None = None
    ) -> Iterator[TokenDelta]:
        """Yield one TokenDelta per step; the last has finish_reason and totals.

        Raises EngineFault on a CUDA runtime error (the engine is down), and OutOfMemory when the
        device ran out of memory (this request's tensors are freed; the engine goes on)."""
        try:
            yield from self._generate(request, should_abort)
            return
        except Exception as exc:
            if faults.is_device_fault(exc):
                raise EngineFault(f"device error while generating: {faults.first_line(exc)}") from exc
            if not faults.is_out_of_memory(exc):
                raise
            message = faults.first_line(exc)
        gc.collect()  # the request's frames and tensors went with the exception
        faults.release_device_memory(self.device)
        raise OutOfMemory(
            f"out of device memory on {self.device} during this request ({len(request.prompt_ids)} prompt "
            f"tokens, tree budget {self.budget}): {message}; the request was dropped and its memory freed. "
            "Retry with a shorter prompt, or restart with a lower --budget or --max-context"
        )

    def _generate(self, request: Request, should_abort: Callable[[], bool] | None) -> Iterator[TokenDelta]:
        params = request.params
        self.validate_request(len(request.prompt_ids), params.max_tokens)
        totals = GenerationStats(prompt_tokens=len(request.prompt_ids))
        begin = time.perf_counter()
        ctx = self._step_context(params)
        seq = self._start(request, ctx)
        totals.prefill_seconds = time.perf_counter() - begin
        stop_ids = self.stop_ids(params)
        while True:
            if should_abort is not None and should_abort():
                yield TokenDelta(request.request_id, [], FinishReason.ABORT, totals=totals)
                return
            tracker = self.budget_tracker
            if tracker is not None:
                ctx.budget = tracker.choose(params.acceptance_key)
            new_ids, stats = run_step(ctx, seq)
            if tracker is not None:
                timings = (stats.draft_seconds, stats.target_seconds, stats.step_seconds)
                tracker.observe(params.acceptance_key, stats.tree_size, timings, seq.acceptance_curve)
            new_ids, finish = self._finish(seq, new_ids, stop_ids)
            seq.emitted += len(new_ids)
            stats = dataclasses.replace(stats, num_emitted=len(new_ids))  # after stop / max_tokens truncation
            totals.add_step(stats)
            logprobs = None if seq.step_logprobs is None else seq.step_logprobs[: len(new_ids)]
            yield TokenDelta(request.request_id, new_ids, finish, stats, totals if finish else None, logprobs)
            if finish is not None:
                return

    def _finish(self, seq: SequenceState, new_ids: list[int], stop_ids: frozenset[int]) -> tuple[list[int], FinishReason | None]:
        for idx, token_id in enumerate(new_ids):
            if token_id in stop_ids:
                return new_ids[:idx], FinishReason.STOP
        room = seq.params.max_tokens - seq.emitted
        if len(new_ids) >= room:
            return new_ids[:room], FinishReason.LENGTH
        if len(seq.token_ids) >= self.max_context:
            return new_ids, FinishReason.LENGTH
        return new_ids, None

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """Convenience: the whole completion's token ids."""
        out: list[int] = []
        for delta in self.generate(Request("script", prompt_ids, params)):
            out.extend(delta.token_ids)
        return out
