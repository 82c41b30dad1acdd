"""Serving paths on the device: the built-in pair resident in float32 (so equality tests the engine's
logic, not rounding), autoregressive alone as the reference.

Exactness rows (a difference fails the run): greedy SpecExec alone, with every prompt in one
target pass, and beside unseeded T=1 requests (which grow SpecInfer trees); seeded sampling (top_p,
penalties) alone, in a batch and autoregressive, which the position-keyed noise makes identical; a
prompt served again from the prefix cache; a JSON-schema grammar (skipped without xgrammar). Then the draft phase of a step with 1 and 4 requests (their
trees grow in lockstep, sharing draft passes), and the cost of the per-step acceptance curve
(`StepContext.track_acceptance`): step times at the largest budget with it on and off, in the run's
dtype."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from bench.gpu_check.context import CheckContext
from bench.prompts import encode_prompt, select_prompts
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams, StructuredOutput, TokenDelta

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
    "required": ["name", "size"],
}
TIMED_STEPS = 12  # per setting of track_acceptance; the median counts


def load(ctx: CheckContext, dtype: str, budget: int, max_running: int) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(
            target=str(DEFAULT_MODELS / "target"), draft=str(DEFAULT_MODELS / "draft"),
            device=str(ctx.device), dtype=dtype,
        ),
        speculation=SpeculationConfig(method="specexec", budget=budget),
        limits=LimitsConfig(max_context=1024, max_running=max_running),
    ))  # fmt: skip


def run_together(engine: Engine, requests: list[Request]) -> tuple[dict[str, list[int]], list[TokenDelta]]:
    """Admit every request, step until none runs: each one's tokens, and every delta."""
    for request in requests:
        engine.add_request(request)
    out: dict[str, list[int]] = {request.request_id: [] for request in requests}
    deltas: list[TokenDelta] = []
    while engine.num_running:
        step = engine.step()
        if step.failures:
            raise step.failures[0][1]
        for delta in step.deltas:
            out[delta.request_id].extend(delta.token_ids)
            deltas.append(delta)
    return out, deltas


def first_difference(got: list[int], want: list[int]) -> str:
    index = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"differs from token {index} ({len(got)} vs {len(want)} tokens)"


def compare(ctx: CheckContext, check: str, got: list[list[int]], want: list[list[int]], detail: str = "") -> None:
    same = sum(g == w for g, w in zip(got, want, strict=True))
    notes = [detail] if detail else []
    notes += [f"prompt {i}: {first_difference(g, w)}" for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    if same != len(want):
        ctx.report.mismatch(f"{check}: {same}/{len(want)} identical")
    ctx.report.row(check, f"{same}/{len(want)} identical", "; ".join(notes) or "-")


def serving_section(ctx: CheckContext) -> None:
    plan = ctx.plan
    n, budget = plan.serving_prompts, plan.bench_budget
    engine = load(ctx, "float32", budget, max_running=n)
    auto = engine.with_speculation(SpeculationConfig(method="autoregressive"))
    tokenizer = engine.tokenizer
    prompts = [encode_prompt(tokenizer, kind, text) for kind, text in select_prompts("code", n)]
    greedy = SamplingParams(temperature=0.0, max_tokens=plan.serving_tokens, ignore_eos=True)
    sampled = [
        SamplingParams(temperature=0.6, top_p=0.9, presence_penalty=0.3, repetition_penalty=1.1, seed=plan.seed + i,
                       max_tokens=plan.serving_tokens, ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip
    ctx.report.line(
        f"Built-in pair (`{DEFAULT_MODELS}`) resident, float32, SpecExec budget {budget} (shared by the requests "
        f"in a pass), {n} code prompts x {plan.serving_tokens} tokens, EOS ignored."
    )
    ctx.report.table("check", "result", "detail")
    reference = [auto.generate_ids(p, greedy) for p in prompts]
    compare(ctx, "greedy, SpecExec alone = autoregressive", [engine.generate_ids(p, greedy) for p in prompts], reference)
    together, deltas = run_together(engine, [Request(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
    sizes = [d.stats.batch_size for d in deltas if d.stats is not None]
    compare(
        ctx, f"greedy, {n} requests per target pass = autoregressive",
        [together[f"g{i}"] for i in range(n)], reference,
        f"mean requests per pass {statistics.fmean(sizes):.2f}, max {max(sizes)}",
    )  # fmt: skip
    hot = SamplingParams(temperature=1.0, max_tokens=plan.serving_tokens, ignore_eos=True)  # unseeded: SpecInfer trees
    mixed, deltas = run_together(
        engine, [Request(f"m{i}", p, greedy if i % 2 == 0 else hot) for i, p in enumerate(prompts)]
    )
    hot_steps = [d.stats for d in deltas if d.request_id == "m1" and d.stats is not None and d.stats.tree_size > 1]
    hot_trees = [stats.expected_accepted is None for stats in hot_steps]  # no sample-and-match expectation
    compare(
        ctx, "greedy beside unseeded T=1 requests (SpecInfer trees) = autoregressive",
        [mixed[f"m{i}"] for i in range(0, n, 2)], reference[::2],
        f"{sum(hot_trees)}/{len(hot_trees)} of a hot request's steps grew SpecInfer trees",
    )  # fmt: skip
    seeded_auto = [auto.generate_ids(p, s) for p, s in zip(prompts, sampled, strict=True)]
    seeded_alone = [engine.generate_ids(p, s) for p, s in zip(prompts, sampled, strict=True)]
    compare(ctx, "seeded T=0.6, top_p, penalties: SpecExec alone = autoregressive", seeded_alone, seeded_auto)
    together, _ = run_together(engine, [Request(f"s{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sampled, strict=True))])
    compare(ctx, f"seeded: {n} requests per pass = alone", [together[f"s{i}"] for i in range(n)], seeded_alone)
    again = list(engine.generate(Request("again", prompts[0], greedy)))
    cached = again[-1].totals.cached_tokens if again[-1].totals else 0
    compare(
        ctx, "greedy prompt 0 again (prefix cache)", [[t for d in again for t in d.token_ids]], reference[:1],
        f"cached prompt tokens {cached} of {len(prompts[0])}",
    )  # fmt: skip
    if cached == 0:
        ctx.report.mismatch("prefix cache: the repeated prompt reused no KV")
    grammar_rows(ctx, engine, auto, prompts[0])
    draft_sharing_rows(ctx, prompts)
    track_acceptance_rows(ctx)


def grammar_rows(ctx: CheckContext, engine: Engine, auto: Engine, prompt: list[int]) -> None:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        ctx.report.row("JSON schema, greedy: SpecExec = autoregressive", "skipped", "xgrammar not installed")
        return
    params = SamplingParams(
        temperature=0.0, max_tokens=96, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA))
    )
    got, want = engine.generate_ids(prompt, params), auto.generate_ids(prompt, params)
    text = engine.tokenizer.decode(got, skip_special_tokens=True)
    try:
        parsed = json.loads(text)
        valid = f"parses, keys {sorted(parsed)}"
    except ValueError:
        valid = f"does not parse ({len(got)} tokens, max_tokens 96)"
    compare(ctx, "JSON schema, greedy: SpecExec = autoregressive", [got], [want], valid)


def draft_sharing_rows(ctx: CheckContext, prompts: list[list[int]]) -> None:
    """Median draft and target seconds per step (after the admission step) with 1 and 4 greedy requests
    at the shared budget, in the run's dtype."""
    plan = ctx.plan
    engine = load(ctx, str(ctx.dtype).removeprefix("torch."), plan.bench_budget, max_running=4)
    params = SamplingParams(temperature=0.0, max_tokens=plan.serving_tokens, ignore_eos=True)
    ctx.report.table("requests per pass", "budget (shared)", "draft ms per step", "target ms per step", "steps")
    for k in (1, 4):
        _, deltas = run_together(engine, [Request(f"d{k}-{i}", prompts[i % len(prompts)], params) for i in range(k)])
        # the first request's steps with all k running (a step's phases are shared); the first also prefills
        timings = [d.stats for d in deltas if d.request_id == f"d{k}-0" and d.stats and d.stats.batch_size == k][1:]
        draft = statistics.median(s.draft_seconds for s in timings) if timings else float("nan")
        target = statistics.median(s.target_seconds for s in timings) if timings else float("nan")
        ctx.report.row(k, plan.bench_budget, f"{1e3 * draft:.1f}", f"{1e3 * target:.1f}", len(timings))


def track_acceptance_rows(ctx: CheckContext) -> None:
    """Median step seconds at the largest budget with the acceptance curve tracked and not."""
    plan, budget = ctx.plan, max(ctx.plan.budgets)
    dtype = str(ctx.dtype).removeprefix("torch.")
    engine = load(ctx, dtype, budget, max_running=1)
    prompt = encode_prompt(engine.tokenizer, *select_prompts("code", 1)[0])
    params = SamplingParams(temperature=0.6, seed=plan.seed, max_tokens=TIMED_STEPS * 16, ignore_eos=True)
    make_context = engine._step_context
    times: dict[bool, list[float]] = {}
    for track in (True, False, True, False):
        engine._step_context = lambda p, a, s, track=track: dataclasses.replace(make_context(p, a, s), track_acceptance=track)
        steps = engine.generate(Request(f"track-{track}", prompt, params))
        next(steps)  # the prefill step
        for _ in range(TIMED_STEPS):
            begin = time.perf_counter()
            if next(steps, None) is None:
                break
            times.setdefault(track, []).append(time.perf_counter() - begin)
        steps.close()
    on, off = (statistics.median(times[t]) for t in (True, False))
    ctx.report.table("acceptance curve per step", "budget", "dtype", "median step ms", "steps timed")
    for label, track, value in (("tracked (the default)", True, on), ("not tracked", False, off)):
        ctx.report.row(label, budget, dtype, f"{1e3 * value:.2f}", len(times[track]))
    ctx.report.line()
    ctx.report.line(f"Tracking costs {1e3 * (on - off):+.2f} ms per step ({100 * (on / off - 1):+.1f}%).")
