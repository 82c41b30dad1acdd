"""Resident memory per new JSON schema (issue 29): in this process, GrammarCache compiles of new
schemas with xgrammar's compile threads and the heap trim set by hand; `bench/hardening.py memory`
measures the server the same way over HTTP.

    python -m bench.hardening_memory [--threads 1,2,8] [--trim on,off] [--compiles 3000]

RSS is read after WARMUP new schemas (the cache is full, the arenas in use), then every EVERY;
the figure is (RSS now - RSS after warm-up) / schemas since warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from engine.cli import DEFAULT_MODELS, comma_list

WARMUP = 300
EVERY = 500


def rss_kb(pid: int | str = "self") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def new_schema(i: int) -> dict[str, Any]:
    """A small schema of its own for each i (what a client sending per-request schemas does)."""
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"}, "name": {"type": "string"}},
            "required": [f"field_{i}"]}


def schema_memory(step: Callable[[int], None], rss: Callable[[], int], num: int) -> dict[str, Any]:
    """step(i) for WARMUP + num new schemas; RSS (KiB) after warm-up and every EVERY after."""
    begin = time.monotonic()
    for i in range(WARMUP):
        step(i)
    base = rss()
    trace = []
    for i in range(1, num + 1):
        step(WARMUP + i)
        if i % EVERY == 0 or i == num:
            trace.append((i, rss()))
    last = trace[-1][1]
    return {"requests_after_warmup": num, "rss_after_warmup_kib": base, "rss_end_kib": last,
            "rss_max_kib": max(kib for _, kib in trace), "bytes_per_request": round((last - base) * 1024 / num),
            "trace_kib": trace, "seconds": round(time.monotonic() - begin, 1)}


def compile_memory(threads: int, trim: bool, num: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    import engine.speculation.grammar as grammar
    from engine.types import StructuredOutput

    grammar.compile_threads = lambda: threads  # module globals: what GrammarCache calls
    if not trim:
        grammar.release_free_heap = lambda: None
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODELS / "target")
    cache = grammar.GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def step(i: int) -> None:
        cache.compile(StructuredOutput("json_schema", json.dumps(new_schema(i))))

    return {"check": "compile_memory", "threads": threads, "trim": trim, **schema_memory(step, rss_kb, num)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=comma_list(int), default=[1, 2, 8])
    parser.add_argument("--trim", type=comma_list(str), default=["on", "off"])
    parser.add_argument("--compiles", type=int, default=3000)
    args = parser.parse_args()
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # each setting in a fresh process: its own arenas
    with context.Pool(1, maxtasksperchild=1) as pool:
        for threads in args.threads:
            for trim in args.trim:
                print(json.dumps(pool.apply(compile_memory, (threads, trim == "on", args.compiles))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
