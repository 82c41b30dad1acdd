"""`specexec bench hybrid`: tree speculation on a Gated DeltaNet hybrid against a standard pair of its shape.

Two pairs of one shape, built here (cached under ~/.cache/specexec/hybrid-bench): a Qwen3.5-shaped hybrid
(qwen3_5_text: three Gated DeltaNet layers to one gated full-attention layer) and a Qwen3 (every layer full
attention), with the same hidden size, layers, heads, MLP and the built-in pair's tokenizer. Neither is
trained: each draft is its target with Gaussian noise on every weight (`--noise` x the weight's std), one
recipe for both, so the two pairs' drafts agree with their targets alike and the tables compare the
engine's work, not two models' quality. Per budget, greedy requests over code prompts, the two pairs taking
turns request by request: tokens per target pass, tree nodes per pass, target pass time (median over
steps), draft time per step, tokens per second. Then the memory a tree node costs: the
hybrid's pending rows of its linear layers (k, u, gamma, the convolution input: engine.model.linear_state)
and KV of its attention layers, against the standard model's KV; the same arithmetic for the hub shapes
of configs/shapes/models.toml.

    python -m bench.hybrid [--budgets 1 4 16 64 256] [--new-tokens 48] [--num-prompts 4] [--noise 0.02]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from bench.pad_target import cache_base
from bench.prompts import select_prompts
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.model import config_shapes, memory_plan
from engine.runtime import Engine
from engine.types import Request, SamplingParams

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1536, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.1)
LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4)  # Qwen3.5's value heads per key head (1:2 to 1:3), scaled down
HUB_PAIRS = (("Qwen/Qwen3.5-27B", "Qwen/Qwen3-32B"), ("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3-30B-A3B"))
MB = 10**6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budgets", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per request")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.02, help="draft = target + noise x each weight's std")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/hybrid"))


def configs(vocab_size: int, token_ids: dict) -> dict[str, object]:
    common = dict(SHAPE, vocab_size=vocab_size, **token_ids)
    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(SHAPE["num_hidden_layers"])]
    return {
        "hybrid": Qwen3_5TextConfig(**common, **LINEAR, layer_types=layer_types,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                     "partial_rotary_factor": 0.25}),
        "standard": Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    }


def build_pair(name: str, config, tokenizer, noise: float, root: Path) -> tuple[str, str]:
    """target/ and draft/ (the target plus noise) under root/name, built once."""
    folder = root / f"{name}-noise{noise}"
    if not (folder / "draft" / "config.json").is_file():
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        draft.load_state_dict(target.state_dict())
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in draft.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
        for model, part in ((target, "target"), (draft, "draft")):
            model.save_pretrained(folder / part)
            tokenizer.save_pretrained(folder / part)
    return str(folder / "target"), str(folder / "draft")


def budget_rows(pairs: dict[str, tuple[str, str]], budgets: list[int], prompts: list[list[int]],
                new_tokens: int) -> dict[str, list[dict]]:
    """Per pair, per budget: the step means of greedy requests over `prompts`. The pairs take turns request by
    request (order alternating), so a shared machine's slow phases hit both alike."""
    bases = {name: Engine.load(EngineConfig(model=ModelConfig(target=pair[0], draft=pair[1]),
                                            speculation=SpeculationConfig(budget=max(budgets), overlap=False),
                                            limits=LimitsConfig(max_context=1024, max_running=1, prefix_cache_slots=0)))
             for name, pair in pairs.items()}
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rows: dict[str, list[dict]] = {name: [] for name in pairs}
    for budget in budgets:
        engines = {name: base.with_speculation(SpeculationConfig(budget=budget, overlap=False))
                   for name, base in bases.items()}
        stats: dict[str, list] = {name: [] for name in pairs}
        seconds = dict.fromkeys(pairs, 0.0)
        for engine in engines.values():  # warm-up
            engine.generate_ids(prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for index, prompt in enumerate(prompts):
            for name in (list(pairs) if index % 2 == 0 else list(pairs)[::-1]):
                begin = time.perf_counter()
                deltas = list(engines[name].generate(Request("b", prompt, params)))
                seconds[name] += time.perf_counter() - begin
                stats[name] += [d.stats for d in deltas if d.stats is not None][1:]  # the first step writes the prompt
        for name, steps in stats.items():
            rows[name].append({
                "budget": budget,
                "tokens_per_pass": statistics.mean(s.num_emitted for s in steps),
                "nodes_per_pass": statistics.mean(s.tree_size for s in steps),
                "target_ms": 1000 * statistics.median(s.target_seconds for s in steps),
                "draft_ms": 1000 * statistics.median(s.draft_seconds for s in steps),
                "tokens_per_s": len(prompts) * new_tokens / seconds[name],
            })
        print(budget, json.dumps({name: rows[name][-1] for name in pairs}), flush=True)
    for base in bases.values():
        base.close()
    return rows


def node_bytes(config: dict, dtype_bytes: int) -> dict:
    """Per tree node: pending linear-attention rows and KV (bytes), a full per-node state; per sequence: the
    committed state."""
    shape = config_shapes.shape_from_config(config, dtype_bytes)
    kv = memory_plan.kv_cache_bytes(shape, 1) - memory_plan.KV_POSITION_BYTES
    rows = memory_plan.linear_state_bytes(shape, 1) - memory_plan.linear_state_bytes(shape, 0)
    full = shape.num_linear_layers * shape.linear.node_state_bytes() if shape.linear else 0
    return {"linear_layers": shape.num_linear_layers, "attention_layers": shape.num_layers - shape.num_linear_layers,
            "kv": kv, "rows": rows, "full_state": full, "committed": memory_plan.linear_state_bytes(shape, 0)}


def memory_rows(local: dict[str, dict]) -> list[dict]:
    rows = [{"model": f"bench {name} target (fp32)", **node_bytes(config, 4)} for name, config in local.items()]
    known = config_shapes.known_models()
    for hybrid, standard in HUB_PAIRS:
        for name in (hybrid, standard):
            rows.append({"model": f"{name} (bf16)", **node_bytes(known[name], 2)})
    return rows


def report(args: argparse.Namespace, tables: dict) -> str:
    lines = [f"Budgets {args.budgets}, {args.num_prompts} code prompts x {args.new_tokens} greedy tokens, draft = "
             f"target + {args.noise} x std noise, {args.threads} torch thread(s), fp32, overlap off.", "",
             "| pair | budget | tokens / pass | nodes / pass | target pass ms | draft ms / step | tok/s |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for name in ("hybrid", "standard"):
        for row in tables[name]:
            lines.append(f"| {name} | {row['budget']} | {row['tokens_per_pass']:.2f} | {row['nodes_per_pass']:.1f} | "
                         f"{row['target_ms']:.1f} | {row['draft_ms']:.1f} | {row['tokens_per_s']:.1f} |")
    lines += ["", "| model | linear / attention layers | per node: KV | per node: linear rows | per node: a full "
              "state instead | per sequence: committed state |", "|---|--:|--:|--:|--:|--:|"]
    for row in tables["memory"]:
        lines.append(f"| {row['model']} | {row['linear_layers']} / {row['attention_layers']} | {row['kv'] / MB:.3f} MB | "
                     f"{row['rows'] / MB:.3f} MB | {row['full_state'] / MB:.1f} MB | {row['committed'] / MB:.1f} MB |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODELS / "target")
    token_ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    local = configs(len(tokenizer), token_ids)
    prompts = [tokenizer.encode(text) for _, text in select_prompts("code", args.num_prompts)]
    root = cache_base() / "hybrid-bench"
    pairs = {name: build_pair(name, config, tokenizer, args.noise, root) for name, config in local.items()}
    tables: dict = budget_rows(pairs, args.budgets, prompts, args.new_tokens)
    tables["memory"] = memory_rows({name: config.to_dict() | {"model_type": config.model_type}
                                    for name, config in local.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(args, tables)
    (args.out / "hybrid.md").write_text(text)
    (args.out / "hybrid.json").write_text(json.dumps(tables, indent=1))
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specexec bench hybrid", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
