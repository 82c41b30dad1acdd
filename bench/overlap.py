"""`specexec bench overlap`: the draft beside the target pass, and long prompts in slices.

Three tables, each on the same (padded) target streamed from disk or RAM, overlap off and on:
1. per budget, one stream: per step the draft's serial growth, the target pass, the draft's work
   during the pass, the step; tokens per pass and tokens/s; step / max(draft off, pass);
2. 1/2/4/8 streams at one budget: aggregate tokens/s;
3. a running stream while a long prompt joins: its longest gap between tokens against its median gap
   before the join, with the prompt written in slices (auto) and in one pass.
Every text is compared between overlap off and on (they must be identical: greedy and seeded).

    specexec bench overlap --pad-to-gb 1 --source disk --budgets 64,256,1024 --out docs/bench/overlap
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.decode import resolve_target
from bench.prompts import encode_prompt, select_prompts
from bench.serve_report import markdown_table
from engine.cli import DEFAULT_MODELS, auto_threads, comma_list
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model.checkpoint import load_tokenizer
from engine.runtime import Engine
from engine.types import Request, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"), help="target checkpoint folder")
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"), help="draft checkpoint folder")
    parser.add_argument("--pad-to-gb", type=float, default=1.0, help="pad the target to about this many GB (0: off)")
    parser.add_argument("--source", choices=("disk", "ram"), default="disk", help="where the target streams from")
    parser.add_argument("--budgets", type=comma_list(int), default=[64, 256, 1024], help="comma list (table 1)")
    parser.add_argument("--streams", type=comma_list(int), default=[1, 2, 4, 8], help="comma list (table 2)")
    parser.add_argument("--streams-budget", type=int, default=256, help="the step's budget in table 2")
    parser.add_argument("--temperatures", type=comma_list(float), default=[0.0, 0.6], help="comma list")
    parser.add_argument("--num-prompts", type=int, default=3, help="prompts per row")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per stream")
    parser.add_argument("--join-tokens", type=int, default=900, help="table 3: the joining prompt's tokens")
    parser.add_argument("--max-context", type=int, default=0,
                        help="context of the engine (0: the model's); beyond trained positions it is allowed "
                             "(timing only: the text past them is not meaningful)")
    parser.add_argument("--tables", type=comma_list(str), default=["budgets", "streams", "join"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's auto)")
    parser.add_argument("--slow-pass-ms", type=float, default=0.0,
                        help="every target pass takes at least this long, the rest a host sleep: a copy-bound pass "
                             "whose copy leaves the CPU to the draft, as on a GPU (0: off)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/overlap"), help="output folder")


def load(args: argparse.Namespace, target: str, overlap: bool, budget: int, **limits) -> Engine:
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=target, draft=args.draft),
        speculation=SpeculationConfig(budget=budget, overlap=overlap),
        offload=OffloadConfig(enabled=True, source=args.source, resident_layers=0),
        limits=LimitsConfig(max_context=args.max_context or None, allow_long_context=bool(args.max_context),
                            prefix_cache_slots=0, **limits),
    ))
    if args.slow_pass_ms > 0:
        slow_passes(engine, args.slow_pass_ms / 1000)
    return engine


def slow_passes(engine: Engine, seconds: float) -> None:
    """Every target pass of `engine` lasts at least `seconds`: its compute, then a host sleep (the CPU
    is free meanwhile, as while a GPU waits on a copy)."""
    forward_groups = engine.pair.target.forward_groups

    def slow(groups):
        begin = time.perf_counter()
        out = forward_groups(groups)
        time.sleep(max(0.0, seconds - (time.perf_counter() - begin)))
        return out

    engine.pair.target.forward_groups = slow


def sampling(temperature: float, seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def run_streams(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """All prompts as concurrent requests until done: texts, per-step timings, tokens/s."""
    texts: dict[str, list[int]] = {}
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(Request(f"s{index}", prompt, param))
        texts[f"s{index}"] = []
    steps = []
    while engine.num_running:
        output = engine.step()
        assert not output.failures, output.failures
        for delta in output.deltas:
            texts[delta.request_id] += delta.token_ids
        if output.stats is not None and output.deltas:
            s = output.stats
            steps.append((s.draft_seconds, s.target_seconds, s.overlap_seconds, s.step_seconds,
                          s.num_emitted, len(output.deltas), s.draft_forwards, s.extension_forwards))
    decode = steps[1:] or steps  # the first step also writes the prompts
    seconds = sum(s[3] for s in decode)
    return {"texts": [texts[f"s{i}"] for i in range(len(prompts))], "steps": steps,
            "draft_ms": 1000 * statistics.mean(s[0] for s in decode),
            "pass_ms": 1000 * statistics.mean(s[1] for s in decode),
            "overlap_ms": 1000 * statistics.mean(s[2] for s in decode),
            "step_ms": 1000 * statistics.mean(s[3] for s in decode),
            "draft_forwards_pass": statistics.mean(s[6] for s in decode),  # before the pass ("_pass": averaged)
            "extension_forwards_pass": statistics.mean(s[7] for s in decode),
            "tokens_per_pass": sum(s[4] for s in decode) / sum(s[5] for s in decode),
            "tokens_per_s": sum(s[4] for s in decode) / seconds}


def budget_rows(args, target, prompts) -> list[dict]:
    rows = []
    for budget in args.budgets:
        for overlap in (False, True):
            engine = load(args, target, overlap, budget, max_running=1)
            for temperature in args.temperatures:
                runs = [run_streams(engine, [p], [sampling(temperature, 7 + i, args.max_tokens)])
                        for i, p in enumerate(prompts)]
                rows.append({"budget": budget, "overlap": overlap, "temperature": temperature,
                             **{k: statistics.mean(r[k] for r in runs) for k in runs[0] if k.endswith(("ms", "pass", "_s"))},
                             "texts": [r["texts"][0] for r in runs]})
            engine.close()
            print(f"budget {budget} overlap {overlap}: done", file=sys.stderr)
    return rows


def stream_rows(args, target, prompts) -> list[dict]:
    rows = []
    for overlap in (False, True):
        engine = load(args, target, overlap, args.streams_budget, max_running=max(args.streams))
        for temperature in args.temperatures:
            for num in args.streams:
                chosen = [prompts[i % len(prompts)] for i in range(num)]
                result = run_streams(engine, chosen, [sampling(temperature, 11 + i, args.max_tokens) for i in range(num)])
                rows.append({"streams": num, "overlap": overlap, "temperature": temperature,
                             "tokens_per_s": result["tokens_per_s"], "step_ms": result["step_ms"], "texts": result["texts"]})
        engine.close()
    return rows


def join_rows(args, target, prompts, tokenizer) -> list[dict]:
    """A greedy stream runs; after a few steps a long prompt joins. Gaps between the stream's tokens."""
    text = "".join(open(__file__).read() for _ in range(8))
    long_prompt = tokenizer.encode(text)[: args.join_tokens]
    rows = []
    for overlap in (False, True):
        for label, slice_len in (("slices (auto)", 0), ("one pass", 10**9)):
            engine = load(args, target, overlap, args.streams_budget, max_running=2, prefill_slice=slice_len)
            engine.add_request(Request("stream", prompts[0], sampling(0.0, 0, 400)))
            times, step, joined_at = [], 0, None
            while engine.num_running:
                if step == 6:
                    engine.add_request(Request("long", long_prompt, sampling(0.0, 0, 8)))
                    joined_at = len(times)
                output = engine.step()
                assert not output.failures, output.failures
                if any(d.request_id == "stream" and d.token_ids for d in output.deltas):
                    times.append(time.perf_counter())
                if joined_at is not None and not any(r.request_id == "long" for r in engine.scheduler.running):
                    break
                step += 1
            engine.close()
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            before, after = gaps[1 : joined_at - 1], gaps[joined_at - 1 :]
            rows.append({"overlap": overlap, "prefill": label, "median_gap_before_s": statistics.median(before),
                         "longest_gap_after_s": max(after), "ratio": max(after) / statistics.median(before),
                         "join_steps": len(after)})
    return rows


def report(args, padding: dict, tables: dict) -> str:
    slowed = f"; every target pass at least {args.slow_pass_ms:g} ms (a host sleep)" if args.slow_pass_ms else ""
    parts = [f"# bench overlap\n\n`{' '.join(['specexec bench overlap', *sys.argv[3:]])}`  \n"
             f"target {args.target} padded to {args.pad_to_gb} GB ({padding.get('folder', '-')}), streamed from "
             f"{args.source}; draft {args.draft}; torch threads {torch.get_num_threads()}, load average at the end "
             f"{os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{slowed}\n"]
    if "budgets" in tables:
        rows = tables["budgets"]
        off = {(r["budget"], r["temperature"]): r for r in rows if not r["overlap"]}
        body = []
        for r in rows:
            base = off[(r["budget"], r["temperature"])]
            bound = max(base["draft_ms"], r["pass_ms"])
            body.append([str(r["budget"]), f"{r['temperature']:g}", "on" if r["overlap"] else "off",
                         f"{r['draft_ms']:.0f}", f"{r.get('draft_forwards_pass', 0):.1f}", f"{r['pass_ms']:.0f}",
                         f"{r['overlap_ms']:.0f}", f"{r.get('extension_forwards_pass', 0):.1f}", f"{r['step_ms']:.0f}",
                         f"{r['step_ms'] / bound:.2f}", f"{r['tokens_per_pass']:.2f}", f"{r['tokens_per_s']:.2f}",
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                         "same" if r["texts"] == base["texts"] else "DIFFERENT"])
        parts.append("## One stream, by budget\n\n" + markdown_table(
            ["budget", "T", "overlap", "draft ms (serial)", "draft forwards (serial)", "pass ms",
             "draft ms during the pass", "draft forwards during the pass", "step ms",
             "step / max(draft off, pass)", "tokens/pass", "tokens/s", "vs off", "texts vs off"], body))
    if "streams" in tables:
        rows = tables["streams"]
        off = {(r["streams"], r["temperature"]): r for r in rows if not r["overlap"]}
        one = {(r["overlap"], r["temperature"]): r for r in rows if r["streams"] == 1}
        body = [[str(r["streams"]), f"{r['temperature']:g}", "on" if r["overlap"] else "off", f"{r['step_ms']:.0f}",
                 f"{r['tokens_per_s']:.2f}", f"{r['tokens_per_s'] / one[(r['overlap'], r['temperature'])]['tokens_per_s']:.2f}x",
                 "same" if r["texts"] == off[(r["streams"], r["temperature"])]["texts"] else "DIFFERENT"] for r in rows]
        parts.append(f"## Streams at budget {args.streams_budget}\n\n" + markdown_table(
            ["streams", "T", "overlap", "step ms", "aggregate tokens/s", "vs one stream", "texts vs off"], body))
    if "join" in tables:
        body = [["on" if r["overlap"] else "off", r["prefill"], f"{r['median_gap_before_s']:.2f}",
                 f"{r['longest_gap_after_s']:.2f}", f"{r['ratio']:.2f}", str(r["join_steps"])] for r in tables["join"]]
        parts.append(f"## A {args.join_tokens}-token prompt joins a running stream\n\n" + markdown_table(
            ["overlap", "prompt written", "median gap before (s)", "longest gap after (s)", "ratio",
             "stream's steps until the prompt ran"], body))
    return "\n\n".join(parts) + "\n"


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or auto_threads("cpu"))
    target, padding = resolve_target(args)
    tokenizer = load_tokenizer(args.target)
    prompts = [encode_prompt(tokenizer, kind, text) for kind, text in select_prompts("code", args.num_prompts)]
    tables = {}
    if "budgets" in args.tables:
        tables["budgets"] = budget_rows(args, target, prompts)
    if "streams" in args.tables:
        tables["streams"] = stream_rows(args, target, prompts)
    if "join" in args.tables:
        tables["join"] = join_rows(args, target, prompts, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(args, padding, tables)
    (args.out / "overlap.md").write_text(text)
    (args.out / "overlap.json").write_text(json.dumps(tables, indent=1))
    print(text)
    return 0
