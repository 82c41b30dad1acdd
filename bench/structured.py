"""`specexec bench structured`: SpecExec with and without a JSON schema, same pair, prompts and seeds.

For every budget and temperature each prompt runs twice: free text, then under --schema (a JSON
schema; the default asks for a small config object). Prints a markdown table of tokens per target
pass, per-step milliseconds of the draft phase (which, under a schema, includes the grammar's masks
for the draft and for every tree node), of the target pass and of the whole step, the grammar's own
milliseconds per step (masks and accepting committed tokens), and tokens per second. One request at
a time; free-text requests ignore EOS, so both rows decode about --max-tokens tokens unless the
grammar completes first.

    specexec bench structured --budgets 64,256 --temperatures 0,0.6 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.cli import DEFAULT_MODELS, CliError, comma_list
from engine.config import EngineConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation.grammar import GrammarState
from engine.types import Request, SamplingParams, StructuredOutput

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "version": {"type": "integer", "minimum": 0},
        "debug": {"type": "boolean"},
        "paths": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 3},
    },
    "required": ["name", "version", "debug", "paths"],
}
PROMPTS = ("DEFAULTS = ", "def load_config():\n    return ", "settings = json.loads(", "CONFIG = dict(**")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"), help="target checkpoint folder")
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"), help="draft checkpoint folder")
    parser.add_argument("--budgets", type=comma_list(int), default=[64, 256], help="comma list")
    parser.add_argument("--temperatures", type=comma_list(float), default=[0.0, 0.6], help="comma list")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt at most")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS), help=f"at most {len(PROMPTS)}")
    parser.add_argument("--schema", type=Path, default=None, help="JSON schema file (default: a config object)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


@dataclass
class Row:
    budget: int
    temperature: float
    schema: bool
    tokens: int = 0
    passes: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    step_seconds: float = 0.0
    grammar_seconds: float = 0.0
    draft_forwards: int = 0
    unfinished: list[int] = field(default_factory=list)  # prompts whose schema output hit max_tokens

    def cells(self) -> list[str]:
        per_step = 1000.0 / max(self.passes, 1)
        return [str(self.budget), f"{self.temperature:g}", "json_schema" if self.schema else "none",
                f"{self.tokens / max(self.passes, 1):.2f}", f"{self.draft_seconds * per_step:.1f}",
                f"{self.target_seconds * per_step:.1f}", f"{self.step_seconds * per_step:.1f}",
                f"{self.grammar_seconds * per_step:.2f}", f"{self.draft_forwards / max(self.passes, 1):.1f}",
                f"{self.tokens / max(self.step_seconds, 1e-9):.1f}"]


HEADER = ["budget", "temperature", "schema", "tokens/pass", "draft ms/step", "target ms/step", "step ms/step",
          "grammar ms/step", "draft forwards/step", "tokens/s"]


class GrammarClock:
    """Seconds spent in GrammarState.bitmask and .accept while installed (class attributes patched)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved = {name: getattr(GrammarState, name) for name in ("bitmask", "accept")}

    def __enter__(self) -> GrammarClock:
        for name, inner in self._saved.items():
            setattr(GrammarState, name, self._timed(inner))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, inner in self._saved.items():
            setattr(GrammarState, name, inner)

    def _timed(self, inner):
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - begin

        return timed


class ForwardCounter:
    """Calls of a runner's forward while installed (an instance attribute shadows the method)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.count = 0

    def __enter__(self) -> ForwardCounter:
        inner = self.runner.forward

        def counted(*args, **kwargs):
            self.count += 1
            return inner(*args, **kwargs)

        self.runner.forward = counted
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.forward


def run_row(engine: Engine, row: Row, prompts: list[list[int]], spec: StructuredOutput, args) -> Row:
    with GrammarClock() as clock, ForwardCounter(engine.pair.draft) as forwards:
        for idx, prompt_ids in enumerate(prompts):
            params = SamplingParams(temperature=row.temperature, seed=args.seed + idx, max_tokens=args.max_tokens,
                                    ignore_eos=not row.schema, structured_output=spec if row.schema else None)
            finish = None
            for delta in engine.generate(Request(f"bench-structured-{idx}", prompt_ids, params)):
                stats = delta.stats
                row.tokens += len(delta.token_ids)
                if stats is not None:
                    row.passes += 1
                    row.draft_seconds += stats.draft_seconds
                    row.target_seconds += stats.target_seconds
                    row.step_seconds += stats.step_seconds
                finish = delta.finish_reason
            if row.schema and finish is not None and finish.value == "length":
                row.unfinished.append(idx)
    row.grammar_seconds = clock.seconds
    row.draft_forwards = forwards.count  # catch-up forwards included (one per step)
    return row


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    schema = json.loads(args.schema.read_text()) if args.schema else DEFAULT_SCHEMA
    spec = StructuredOutput("json_schema", json.dumps(schema))
    base = Engine.load(EngineConfig(model=ModelConfig(target=args.target, draft=args.draft),
                                    speculation=SpeculationConfig(budget=max(args.budgets))))
    if base.pair.draft is None:
        raise CliError("bench structured measures speculation: give a --draft")
    base.validate_structured_output(spec)  # compiled once, before any timing
    prompts = [base.tokenizer.encode(text) for text in PROMPTS[: args.num_prompts]]
    rows = []
    for budget in args.budgets:
        engine = base.with_speculation(SpeculationConfig(budget=budget))
        for temperature in args.temperatures:
            run_row(engine, Row(budget, temperature, True), prompts[:1], spec, args)  # warm-up, not counted
            for schema_on in (False, True):
                rows.append(run_row(engine, Row(budget, temperature, schema_on), prompts, spec, args))
    print(markdown(rows))
    unfinished = [(r.budget, r.temperature, r.unfinished) for r in rows if r.unfinished]
    if unfinished:
        print(f"\nschema outputs cut at --max-tokens (budget, temperature, prompt indices): {unfinished}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
