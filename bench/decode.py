"""`specexec bench`: autoregressive, SpecInfer and SpecExec side by side, in one run.

Same pair, prompts, seeds and machine for every method. For each mode (target resident, streamed
from RAM, streamed from disk with its pages evicted) and temperature, every budget runs every
prompt; `--budget auto` runs too. Writes a markdown table, JSON with every raw figure and PNG plots
(tokens per target pass and tokens/s against the budget, one line per method) to --out.

With --pad-to-gb the target is a padded copy (bench.pad_target): extra no-op layers and zero MLP
units make it stream and compute like a large model while its outputs, so acceptance, stay those of
the trained pair. Figures measured on it are labelled so.

    specexec bench --pad-to-gb 1.5 --modes resident,disk --budgets 16,64,256,1024 --out bench-out
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.pad_target import cache_root, pad_checkpoint
from bench.prompts import PROMPT_SETS, encode_prompt, select_prompts
from bench.report import RunResult, write_outputs
from engine.cli import DEFAULT_MODELS, CliError, check_paths, comma_list
from engine.config import EngineConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model.checkpoint import load_tokenizer
from engine.model.runner import DecoderRunner
from engine.offload.device import synchronize
from engine.offload.disk_store import read_span
from engine.offload.safetensors_index import read_index
from engine.runtime import Engine
from engine.types import Request, SamplingParams

NAMED_TREES = 3.0  # speculation.specinfer_temperature above the API's largest temperature: no switch
DEFAULT_BUDGETS = "16,32,64,128,256,512,1024"
MODES = ("resident", "ram", "disk")
METHODS = ("autoregressive", "specinfer", "specexec", "rrs")
WARMUP_TOKENS = 8  # --budget auto's warm-up request per temperature (explores the largest budget first)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"), help="target checkpoint folder")
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"), help="draft checkpoint folder")
    parser.add_argument(
        "--pad-to-gb", type=float, default=0.0, help="pad the target to about this many GB (0: off)"
    )
    parser.add_argument("--modes", type=comma_list(str), default=["resident", "disk"], help=f"comma list of {MODES}")
    parser.add_argument("--budgets", type=comma_list(int), default=comma_list(int)(DEFAULT_BUDGETS), help="comma list")
    parser.add_argument("--no-auto", action="store_true", help="skip the --budget auto rows")
    parser.add_argument("--methods", type=comma_list(str), default=list(METHODS), help=f"comma list of {METHODS}")
    parser.add_argument("--temperatures", type=comma_list(float), default=[0.0, 0.6], help="comma list")
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, default="mixed")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per configuration")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument(
        "--seeds", type=int, default=3, help="sampled runs per prompt (trajectories; greedy runs once)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="run k of prompt i uses seed + i + k * num_prompts, for every method"
    )
    parser.add_argument("--max-expand", type=int, default=SpeculationConfig.max_expand)
    parser.add_argument("--max-children", type=int, default=SpeculationConfig.max_children)
    parser.add_argument("--max-depth", type=int, default=SpeculationConfig.max_depth)
    parser.add_argument(
        "--greedy-tree-temperature",
        type=float,
        default=SpeculationConfig.greedy_tree_temperature,
        help="SpecExec, greedy requests: temperature of the draft log-probs that rank tree nodes",
    )
    parser.add_argument(
        "--sampled-tree-temperature-scale",
        type=float,
        default=SpeculationConfig.sampled_tree_temperature_scale,
        help="SpecExec, sampled requests: draft scoring temperature = the request's times this",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder")


class ForwardClock:
    """Wall time spent inside a runner's passes during decoding (passes that only prefill excluded)."""

    def __init__(self, runner: DecoderRunner):
        self.runner = runner
        self.seconds = 0.0
        inner = runner.forward_groups

        def timed_forward_groups(groups: list) -> list:
            begin = time.perf_counter()
            out = inner(groups)
            synchronize(runner.device)
            if any(part is not None for group in out for part in group):  # prefill-only passes ask for no logits
                self.seconds += time.perf_counter() - begin
            return out

        runner.forward_groups = timed_forward_groups  # instance attribute shadows the method (forward uses it)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def remove(self) -> None:
        del self.runner.forward_groups


def engine_config(args: argparse.Namespace, target: str, mode: str) -> EngineConfig:
    spec = SpeculationConfig(
        method="specexec",
        budget=max(args.budgets),
        max_expand=args.max_expand,
        max_children=args.max_children,
        max_depth=args.max_depth,
        greedy_tree_temperature=args.greedy_tree_temperature,
        sampled_tree_temperature_scale=args.sampled_tree_temperature_scale,
        specinfer_temperature=NAMED_TREES,  # each row's trees are the ones its method names
    )
    offload = OffloadConfig(
        enabled=mode != "resident",
        source="disk" if mode == "disk" else "ram",
        resident_layers=0,
        evict_page_cache=True,
    )
    return EngineConfig(model=ModelConfig(target=target, draft=args.draft), speculation=spec, offload=offload)


def layer_ranges(folder: str) -> list[tuple[str, int, int]]:
    """(file, offset, nbytes) of every decoder-layer tensor in a checkpoint's safetensors files."""
    index = read_index(folder)
    layers = (loc for name, loc in index.items() if name.startswith("model.layers."))
    return sorted((loc.path, loc.file_offset, loc.nbytes) for loc in layers)


def measure_link(mode: str, folder: str, ram_layer_bytes: list[int], reps: int = 2) -> dict[str, float]:
    """The link's plain bandwidth for the bytes one streamed pass moves (best of `reps`): reads of the
    checkpoint's layer tensors from disk with the file's pages evicted first, or RAM-to-RAM copies of
    the loaded layers (`ram_layer_bytes`: the streamer's per-layer sizes, which differ from the file's
    when the loaded dtype does); no compute alongside."""
    if mode == "resident":
        return {}
    ranges = layer_ranges(folder) if mode == "disk" else [("", 0, size) for size in ram_layer_bytes]
    nbytes = sum(size for _, _, size in ranges)
    largest = max(size for _, _, size in ranges)
    dst = torch.empty(largest, dtype=torch.uint8)
    src = torch.empty(largest, dtype=torch.uint8).fill_(1) if mode == "ram" else None
    fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _, _ in ranges} if path}
    best = float("inf")
    try:
        for _ in range(reps):
            for fd in fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            begin = time.perf_counter()
            for path, offset, size in ranges:
                if src is not None:
                    dst[:size].copy_(src[:size])
                    continue
                read_span(fds[path], path, dst[:size], offset, size)
            best = min(best, time.perf_counter() - begin)
    finally:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    return {"bytes_per_pass": nbytes, "link_seconds": best, "link_bytes_per_s": nbytes / best}


def run_config(
    engine: Engine, result: RunResult, prompts: list[list[int]], args: argparse.Namespace, bar: tqdm
) -> RunResult:
    clocks = [ForwardClock(engine.pair.target)]
    if engine.pair.draft is not None and engine.pair.draft is not engine.pair.target:
        clocks.append(ForwardClock(engine.pair.draft))
    try:
        for idx, run, prompt_ids in trajectories(prompts, runs_per_prompt(args, result.temperature)):
            seed = args.seed + idx + run * len(prompts)
            params = SamplingParams(
                temperature=result.temperature,
                seed=seed,
                max_tokens=args.max_tokens,
                ignore_eos=True,
            )
            sizes, accepted, expected, steps, totals = [], [], [], [], None
            for delta in engine.generate(Request(f"bench-{idx}-{run}", prompt_ids, params)):
                stats = delta.stats
                sizes.append(stats.tree_size)
                accepted.append(stats.num_accepted)
                expected.append(stats.expected_accepted)
                steps.append((stats.draft_seconds, stats.target_seconds, stats.step_seconds))
                totals = delta.totals or totals
            result.prompt_index.append(idx)
            result.seeds.append(seed)
            result.expected.append(expected)
            result.completion_tokens.append(totals.completion_tokens)
            result.target_passes.append(totals.target_passes)
            result.decode_seconds.append(totals.decode_seconds)
            result.prefill_seconds.append(totals.prefill_seconds)
            result.draft_seconds.append(totals.draft_seconds)
            result.target_seconds.append(totals.target_seconds)
            result.target_forward_seconds.append(clocks[0].take())
            result.draft_forward_seconds.append(clocks[1].take() if len(clocks) > 1 else 0.0)
            result.tree_sizes.append(sizes)
            result.accepted.append(accepted)
            result.steps.append(steps)
            bar.update(1)
    finally:
        for clock in clocks:
            clock.remove()
    return result


def runs_per_prompt(args: argparse.Namespace, temperature: float) -> int:
    """Seeds per prompt: greedy decoding gives the same trajectory whatever the seed."""
    return 1 if SamplingParams(temperature=temperature).greedy else max(1, args.seeds)


def trajectories(prompts: list[list[int]], runs: int) -> list[tuple[int, int, list[int]]]:
    """(prompt index, run, prompt ids) for every run of every prompt."""
    return [(idx, run, prompt) for run in range(runs) for idx, prompt in enumerate(prompts)]


def speculation_for(base: Engine, method: str, budget: int | str) -> SpeculationConfig:
    return dataclasses.replace(base.config.speculation, method=method, budget=budget)


def configs_for(args: argparse.Namespace) -> list[tuple[str, int | str]]:
    """(method, budget) in run order: autoregressive, each budget for SpecInfer and SpecExec, then auto."""
    out: list[tuple[str, int | str]] = []
    if "autoregressive" in args.methods:
        out.append(("autoregressive", 1))
    for budget in args.budgets:
        out += [(m, budget) for m in ("specinfer", "specexec", "rrs") if m in args.methods]
    if not args.no_auto and "specexec" in args.methods:
        out.append(("specexec", "auto"))
    return out


def auto_engine(base: Engine, args: argparse.Namespace, warmup_prompt: list[int]) -> tuple[Engine, dict]:
    """The --budget auto engine over the benchmark's budgets: calibrated, then one warm-up request
    per temperature (a served engine has learned from earlier requests)."""
    engine = base.with_speculation(speculation_for(base, "specexec", "auto"))
    engine.budget_tracker.grid = sorted(args.budgets)
    begin = time.perf_counter()
    engine.calibrate_budget()
    calibration = time.perf_counter() - begin
    for temperature in args.temperatures:
        params = SamplingParams(
            temperature=temperature, seed=10_000, max_tokens=WARMUP_TOKENS, ignore_eos=True
        )
        engine.generate_ids(warmup_prompt, params)
    return engine, {"calibration_seconds": calibration, "after_warmup": engine.budget_tracker.snapshot()}


def run_mode(
    mode: str, target: str, args: argparse.Namespace, prompts: list[list[int]], bar: tqdm
) -> tuple[list[RunResult], dict]:
    begin = time.perf_counter()
    base = Engine.load(engine_config(args, target, mode))
    streamer = base.pair.target.layers
    ram_layer_bytes = [layout.nbytes for layout in getattr(streamer, "layouts", {}).values()]
    info: dict = {"load_seconds": time.perf_counter() - begin, **measure_link(mode, target, ram_layer_bytes)}
    base.with_speculation(speculation_for(base, "autoregressive", 1)).generate_ids(
        prompts[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )  # warm-up: first-pass allocations, ring start
    results = []
    auto = None
    for method, budget in configs_for(args):
        if budget == "auto":
            bar.set_description(f"{mode} auto calibration")
            auto, info["auto"] = auto_engine(base, args, prompts[-1])
        engine = auto or base.with_speculation(speculation_for(base, method, budget))
        for temperature in args.temperatures:
            bar.set_description(f"{mode} T={temperature:g} {method} {budget}")
            results.append(
                run_config(engine, RunResult(mode, temperature, method, budget), prompts, args, bar)
            )
    if auto is not None:
        info["auto"]["final"] = auto.budget_tracker.snapshot()
    if hasattr(streamer, "close"):
        streamer.close()
    del base, auto, engine
    gc.collect()
    return results, info


def resolve_target(args: argparse.Namespace) -> tuple[str, dict]:
    check_paths(EngineConfig(model=ModelConfig(target=args.target, draft=args.draft)))
    if args.pad_to_gb <= 0:
        return args.target, {}
    begin = time.perf_counter()
    try:
        folder, plan = pad_checkpoint(args.target, cache_root(), args.pad_to_gb)
    except ValueError as exc:
        raise CliError(f"--pad-to-gb: {exc}") from exc
    info = {**dataclasses.asdict(plan), "folder": str(folder), "seconds": time.perf_counter() - begin}
    return str(folder), info


def run(args: argparse.Namespace) -> int:
    for name, allowed in (("modes", MODES), ("methods", METHODS)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            raise CliError(f"--{name}: unknown {bad}; choose from {allowed}")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    target, padding = resolve_target(args)
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise CliError(f"{args.target}: no tokenizer files; bench needs one")
    prompts = [
        encode_prompt(tokenizer, kind, text)
        for kind, text in select_prompts(args.prompt_set, args.num_prompts)
    ]
    runs = sum(runs_per_prompt(args, t) for t in args.temperatures)
    total = len(args.modes) * len(configs_for(args)) * runs * len(prompts)
    results, modes = [], {}
    with tqdm(total=total, unit="run", dynamic_ncols=True) as bar:
        for mode in args.modes:
            mode_results, modes[mode] = run_mode(mode, target, args, prompts, bar)
            results += mode_results
    meta = {
        "command": "specexec bench " + " ".join(sys.argv[2:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "target": args.target,
        "draft": args.draft,
        "padding": padding,
        "modes": modes,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "wall_seconds": time.time() - started,
        "prompt_lens": [len(p) for p in prompts],
    }
    paths = write_outputs(args.out, meta, results)
    print(open(paths["table"]).read())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
