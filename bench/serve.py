"""`specexec bench serve`: concurrent streams of code prompts through the real HTTP server.

For each source (target resident, streamed from RAM, streamed from disk) and server variant (the
server's defaults, plus any `--variant NAME="FLAGS"`, e.g. `--variant serial="--max-running 1"`), one
server process (`python -m specexec serve ...`) runs every temperature at 1, 2, 4, 8 concurrent
streams, then a short request arriving during a long one, then a two-turn chat. A further server
per source with `--cache-off-flags` repeats the chat, so turn 2 is measured with and without the
prefix cache. Writes serve.md (tables and goals), serve.json (raw timings and rows) and serve.png
to --out. By default the target is the built-in one padded to --pad-to-gb (bench.pad_target).

    specexec bench serve --sources ram,disk --variant serial="--max-running 1" --out docs/bench
    specexec bench serve --quick   # built-in pair resident, 1 and 2 streams, a few tokens
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from bench.serve_client import new_client
from bench.serve_process import SOURCE_FLAGS, FlagsRejected, ServerFailed, running_server, split_flags
from bench.serve_report import write_report
from bench.serve_workloads import BenchError, Target, run_interrupt, run_streams, run_turns, warm_up
from engine.cli import DEFAULT_MODELS, CliError, comma_list

FULL = {  # defaults of a full run; --quick replaces those the command line leaves out
    "sources": ["ram", "disk"], "pad_to_gb": 1.0, "streams": [1, 2, 4, 8], "temperatures": [0.0, 0.6],
    "max_tokens": 24, "long_tokens": 200, "short_tokens": 8, "turn_tokens": 32,
    "cache_off_flags": "--prefix-cache-slots 0",
}
QUICK = {
    "sources": ["resident"], "pad_to_gb": 0.0, "streams": [1, 2], "temperatures": [0.0],
    "max_tokens": 8, "long_tokens": 24, "short_tokens": 4, "turn_tokens": 8, "cache_off_flags": "",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"), help="target checkpoint folder")
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"), help="draft checkpoint folder")
    parser.add_argument("--pad-to-gb", type=float, help="serve the target padded to about this many GB "
                        f"(0: as given; default {FULL['pad_to_gb']:g}, --quick 0)")
    parser.add_argument("--sources", type=comma_list(str), help=f"comma list of {tuple(SOURCE_FLAGS)} (default ram,disk)")
    parser.add_argument("--streams", type=comma_list(int), help="comma list of concurrent streams (default 1,2,4,8)")
    parser.add_argument("--temperatures", type=comma_list(float), help="comma list (default 0,0.6)")
    parser.add_argument("--max-tokens", type=int, help=f"tokens per stream (default {FULL['max_tokens']})")
    parser.add_argument("--long-tokens", type=int, help=f"the long request's tokens (default {FULL['long_tokens']})")
    parser.add_argument("--short-tokens", type=int, help="the short request's tokens (default 8)")
    parser.add_argument("--turn-tokens", type=int, help="tokens of the chat's first reply (default 32)")
    parser.add_argument("--server-flags", default="",
                        help='flags for every server, e.g. "--budget 64" (one flag alone: --server-flags=--flag)')
    parser.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                        help='another server per source with these flags added, e.g. serial="--max-running 1"')
    parser.add_argument("--cache-off-flags", help="flags that turn the prefix cache off, for the chat's comparison "
                        f"('': skip it; default {FULL['cache_off_flags']!r})")
    parser.add_argument("--no-interrupt", action="store_true", help="skip the short-during-long measurement")
    parser.add_argument("--no-turns", action="store_true", help="skip the two-turn chat measurement")
    parser.add_argument("--seed", type=int, default=0, help="stream i is seeded seed + i")
    parser.add_argument("--quick", action="store_true", help="built-in pair resident, 1 and 2 streams, few tokens")
    parser.add_argument("--out", type=Path, default=Path("bench-out/serve"), help="output folder")


def resolve_options(args: argparse.Namespace) -> SimpleNamespace:
    """Flags given on the command line, else the --quick or full-run defaults; variants parsed."""
    defaults = QUICK if args.quick else FULL
    options = {name: getattr(args, name) if getattr(args, name) is not None else value
               for name, value in defaults.items()}
    bad = [s for s in options["sources"] if s not in SOURCE_FLAGS]
    if bad:
        raise CliError(f"--sources: unknown {bad}; choose from {tuple(SOURCE_FLAGS)}")
    variants = {"default": []}
    for text in args.variant:
        name, sep, flags = text.partition("=")
        if not sep or not name or name in variants:
            raise CliError(f'--variant {text!r}: expected a new NAME="FLAGS" (e.g. serial="--max-running 1")')
        variants[name] = split_flags(flags)
    for name in ("max_tokens", "long_tokens", "short_tokens", "turn_tokens"):
        if options[name] < 1:
            raise CliError(f"--{name.replace('_', '-')}: must be >= 1, got {options[name]}")
    if not options["streams"] or min(options["streams"]) < 1:
        raise CliError("--streams: a comma list of integers >= 1")
    return SimpleNamespace(**options, variants=variants, server_flags=split_flags(args.server_flags),
                           seed=args.seed, interrupt=not args.no_interrupt, turns=not args.no_turns)


@dataclass
class Run:
    """What one benchmark run has measured so far (the raw entries of serve.json)."""

    options: SimpleNamespace
    target: str
    draft: str
    raw: list[dict] = field(default_factory=list)
    servers: dict[str, dict[str, str]] = field(default_factory=dict)  # source -> variant -> command
    skipped: list[str] = field(default_factory=list)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def describe(entry: dict) -> str:
    """One progress line per finished setting."""
    from bench.serve_report import cell, summarize_interrupt, summarize_streams, summarize_turn

    head = f"{entry['source']} {entry['variant']}"
    if entry["kind"] == "streams":
        r = summarize_streams(entry)
        return (f"{head} T={r['temperature']:g} x{r['num_streams']}: {r.get('aggregate_tokens_per_s') or 0:.2f} "
                f"tok/s aggregate, TTFT mean {r.get('ttft_mean') or 0:.2f} s, failed {r['failed']}")
    if entry["kind"] == "interrupt":
        r = summarize_interrupt(entry)
        return f"{head} short during long: TTFT {cell(r['short_ttft'])} s, passes waited {cell(r['passes_waited'])}"
    r = summarize_turn(entry)
    return (f"{head} chat turn 2, prefix cache {r['prefix_cache']}: cached {cell(r['cached_tokens'])} of "
            f"{r['turn2_prompt_tokens']}, prefill {cell(r['turn2_prefill_seconds'], '.3f')} s, "
            f"TTFT {cell(r['turn2_ttft'], '.3f')} s")


def keep(run: Run, entry: dict) -> None:
    run.raw.append(entry)
    log(describe(entry))


async def measure_server(run: Run, source: str, variant: str, flags: list[str]) -> None:
    """One server process: every temperature and stream count, then the interrupt and the chat."""
    o = run.options
    async with serving(run, source, variant, [*o.server_flags, *flags], max(o.streams)) as server:
        if server is None:
            return
        for temperature in o.temperatures:
            for num_streams in o.streams:
                keep(run, await run_streams(server, temperature, num_streams, o.max_tokens, o.seed))
        if o.interrupt:
            keep(run, await run_interrupt(server, o.long_tokens, o.short_tokens, o.seed))
        if o.turns:
            keep(run, await run_turns(server, o.turn_tokens, "on", o.seed))


async def measure_cache_off(run: Run, source: str) -> None:
    """The chat again on a server with the prefix cache off (--cache-off-flags)."""
    o = run.options
    flags = [*o.server_flags, *split_flags(o.cache_off_flags)]
    async with serving(run, source, "default", flags, 1, record=False) as server:
        if server is not None:
            keep(run, await run_turns(server, o.turn_tokens, "off", o.seed))


@contextlib.asynccontextmanager
async def serving(
    run: Run, source: str, variant: str, flags: list[str], num_streams: int, record: bool = True
) -> AsyncIterator[Target | None]:
    """A warmed-up server for the workloads; None (and a note) when it refuses its flags."""
    try:
        with running_server(run.target, run.draft, source, flags) as (process, startup):
            if record:
                run.servers.setdefault(source, {})[variant] = shlex.join(["specexec", "serve", *SOURCE_FLAGS[source],
                                                                          *flags])
            log(f"{source} {variant} ({shlex.join(flags) or 'no extra flags'}): healthy after {startup:.1f} s")
            async with new_client(num_streams) as client:
                server = Target(client, process.url, source, variant)
                await warm_up(server)
                yield server
    except FlagsRejected as exc:
        reason = str(exc).strip().splitlines()[-1]
        run.skipped.append(f"{source} {variant}, server flags `{shlex.join(flags)}`: refused by this server ({reason})")
        log(f"skipped: {run.skipped[-1]}")
        yield None
    except (ServerFailed, BenchError) as exc:
        raise CliError(f"{source} {variant}: {exc}") from exc


async def measure_all(run: Run) -> None:
    o = run.options
    for source in o.sources:
        for variant, flags in o.variants.items():
            await measure_server(run, source, variant, flags)
        if o.turns and o.cache_off_flags:
            await measure_cache_off(run, source)


def shown(path: str) -> str:
    """A path for the report: relative to the working folder when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else str(resolved)


def resolve_target(target: str, pad_to_gb: float) -> tuple[str, str, dict]:
    """The served target folder, its label for the report, and the padding plan (empty: as given)."""
    from bench.pad_target import cache_root, pad_checkpoint

    if not Path(target).is_dir():
        raise CliError(f"--target {target}: no such model folder")
    if pad_to_gb <= 0:
        return str(Path(target).resolve()), f"`{shown(target)}` as given", {}
    try:
        folder, plan = pad_checkpoint(target, cache_root(), pad_to_gb)
    except ValueError as exc:
        raise CliError(f"--pad-to-gb: {exc}") from exc
    label = (f"heavy padded target, {plan.total_bytes / 1e9:.2f} GB of decoder layers ({plan.num_layers} layers), "
             f"outputs equal to `{shown(target)}`'s")
    return str(folder), label, {**asdict(plan), "folder": str(folder)}


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"  # CUDA-only: the name
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "memory_gb": memory / 1e9, "device": device}


def command_line() -> str:
    if sys.argv[1:3] == ["bench", "serve"]:
        return shlex.join(["specexec", *sys.argv[1:]])
    return shlex.join(["python", "-m", "bench.serve", *sys.argv[1:]])


def run_meta(run: Run, label: str, padding: dict, started: float) -> dict:
    o = run.options
    return {
        "command": command_line(),
        "options": dict(vars(o)),
        "target": run.target, "target_label": label, "draft": shown(run.draft), "padding": padding,
        "machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "wall_seconds": time.time() - started, "loadavg_end": os.getloadavg(),
        "servers": run.servers, "skipped": run.skipped, "max_tokens": o.max_tokens, "seed": o.seed,
    }


def run(args: argparse.Namespace) -> int:
    options = resolve_options(args)
    started = time.time()
    target, label, padding = resolve_target(args.target, options.pad_to_gb)
    if not Path(args.draft).is_dir():
        raise CliError(f"--draft {args.draft}: no such model folder")
    bench = Run(options, target, str(Path(args.draft).resolve()))
    try:
        asyncio.run(measure_all(bench))
    finally:
        if bench.raw:
            paths = write_report(args.out, run_meta(bench, label, padding, started), bench.raw)
            print(paths["table"].read_text())
            print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="specexec bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
