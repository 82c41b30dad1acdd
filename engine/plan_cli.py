"""`specexec plan`: the device memory plan of a pair on a GPU of a given size, with no GPU and no weights.

    specexec plan --config configs/llama3.1-70b-instruct.toml --gpu-memory-total 24
    specexec plan --gpu-memory-total 24 --table configs/*.toml  # the README's "What fits a 24 GB card"
    specexec plan --gpu-memory-total 24 --table Qwen/Qwen3-32B openai/gpt-oss-20b  # known models, streamed
    specexec plan --gpu-memory-total 24 --self-draft-table  # where --draft self fits, for the known targets

The arithmetic is engine.model.pair_plan (the server's startup plan from config.json shapes); this
prints it: each item, the total, the KV slots, and when the pair does not fit the server's refusal
and the changes that fit. Exit status: 0 when the pair fits, 1 when it does not, 2 for bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.config import SELF_DRAFT, EngineConfig, engine_config_from, read_config_file
from engine.model import config_shapes, host_plan, memory_plan, plan_estimate, self_draft_fit, self_draft_plan
from engine.model.pair_plan import CUDA_CONTEXT_BYTES, GB, PairPlan, alternatives, load_dtype, plan_pair

MB = 10**6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--gpu-memory-total", type=float, required=True, metavar="GB",
                        help="the GPU's memory in GB (10^9 bytes; a '24 GB' card has 24 GiB = 25.8 GB, less what "
                             "the desktop uses)")
    parser.add_argument("--self-draft-table", nargs="*", metavar="MODEL", default=None,
                        help="instead of one plan, a markdown table of where --draft self fits this GPU: for each "
                             "model (default: the models of configs/shapes/models.toml too large for the GPU) the largest budget and "
                             "context, the resident layers and the flags")
    parser.add_argument("--table", nargs="+", metavar="CONFIG", default=None,
                        help="instead of one plan, a markdown table of these config files' pairs and, where they do "
                             "not fit, the changes that fit (the README's 24 GB table); an entry that is no file is "
                             "a model of configs/shapes/models.toml, streamed (--offload) with its draft there")
    parser.add_argument("--link-gbps", type=float, default=None, metavar="GB/s",
                        help="for the speed estimate: GB/s the streamed layers arrive at (default, assumed: 25 from "
                             "RAM, PCIe 4.0 x16; 3.5 from disk, an NVMe SSD)")
    parser.add_argument("--tokens-per-pass", type=float, default=None, metavar="N",
                        help="for the speed estimate: tokens per target pass (default, assumed: the SpecExec paper's "
                             "70B targets with 7B drafts, 13.5 at budget 256 and about 20 at 2048)")


def slots(result: PairPlan) -> str:
    return f"{result.running} running + {result.cache_slots} prefix cache"


def print_plan(result: PairPlan, total_bytes: int) -> None:
    config, inputs = result.config, result.inputs
    print(f"target {config.model.target} ({result.sources[0]})")
    if inputs.draft is not None:
        print(f"draft  {config.model.draft} ({result.sources[1]})")
    if config.model.draft == SELF_DRAFT and inputs.draft is not None:
        copies = result.num_layers - result.resident_layers or result.num_layers
        print(f"self-draft: 4-bit copies of {copies} layers ({inputs.loaded['draft weights'] / GB:.2f} GB, 'draft "
              f"weights'); shared with the target, counted once under it: the embeddings, final norm, head, "
              f"rotary tables and {result.num_layers - copies} resident layers; KV caches of the target's shape")
    print(f"device: a {total_bytes / GB:.2f} GB CUDA GPU less {CUDA_CONTEXT_BYTES / GB:.2f} GB for the CUDA context "
          f"(estimate); {load_dtype(config, config_shapes.read_model_config(config.model.target)[0])}, budget "
          f"{inputs.budget}, max context {inputs.max_context}; {result.resident_layers} of {result.num_layers} "
          f"target layers resident" + (f", the rest streamed (ring of {config.offload.ring_size})" if inputs.streamed else ""))
    print(f"KV slots: {slots(result)} (asked: {config.limits.max_running} + {config.limits.prefix_cache_slots})")
    for name, shape in (("target", inputs.target), ("draft", inputs.draft)):
        if shape is not None and shape.linear is not None:
            print(f"{name} linear-attention state: {node_state(shape)}")
    print("\n| item | GB | |\n|---|--:|---|")
    for item in sorted(result.plan.items, key=lambda item: (not item.loaded, -item.nbytes)):
        if item.nbytes:
            print(f"| {item.name} | {item.nbytes / GB:.2f} | {'loaded' if item.loaded else 'allocated at start'} |")
    print(f"| total | {result.plan.total / GB:.2f} | of {(total_bytes - CUDA_CONTEXT_BYTES) / GB:.2f} GB |\n")


def node_state(shape: memory_plan.ModelShape) -> str:
    """A hybrid model's state memory: per tree node (every linear layer's pending row) and per sequence."""
    layers, linear = shape.num_linear_layers, shape.linear
    assert linear is not None
    per_node = layers * linear.pending_bytes(shape.dtype_bytes)
    full = layers * linear.node_state_bytes()
    committed = layers * linear.committed_bytes(shape.dtype_bytes)
    return (f"{per_node / MB:.2f} MB a tree node ({layers} layers; a full recurrent state per node would be "
            f"{full / MB:.0f} MB), {committed / MB:.1f} MB a sequence's committed state")


def print_estimates(result: PairPlan, link_gbps: float | None, tokens_per_pass: float | None) -> None:
    """The host RAM the plan needs and its tokens/s estimate (engine.model.plan_estimate)."""
    need, items = plan_estimate.host_ram(result)
    print(f"host RAM: {need / GB:.2f} GB at the load's peak, margin included ({host_plan.describe(items)}); the "
          "server checks it against the available memory before loading")
    speed = plan_estimate.estimate_speed(result, link_gbps, tokens_per_pass)
    print(speed.describe() if speed is not None else
          "speed estimate: none (no layer streams: a pass is compute-bound, which the plan does not know)")


def run(args: argparse.Namespace) -> int:
    total = int(args.gpu_memory_total * GB)
    if args.table:
        print_table(args.table, total)
        return 0
    if args.self_draft_table is not None:
        self_draft_fit.print_table(args.self_draft_table or self_draft_targets(total), total)
        return 0
    config, _ = engine_config_from_args(args, require_folders=False)
    config = with_draft(config, total)
    result = plan_pair(config, total)
    print_plan(result, total)
    print_estimates(result, args.link_gbps, args.tokens_per_pass)
    if result.fits:
        spare = total - CUDA_CONTEXT_BYTES - result.plan.total
        print(f"fits, {spare / GB:.2f} GB to spare")
        suggest_self_draft(config, total)
        return 0
    print(f"does not fit; the server refuses at start with:\n  {result.refusal}")
    found = alternatives(config, total)
    print("what fits instead:" if found else "nothing of the kind the refusal names fits this GPU")
    for flags, alternative in found:
        print(f"  {flags}: resident layers {alternative.resident_layers}, KV slots {slots(alternative)}, "
              f"{alternative.plan.total / GB:.2f} GB")
    suggest_self_draft(config, total)
    return 1


def self_draft_targets(total_bytes: int) -> list[str]:
    """The models of configs/shapes/models.toml whose weights at 2 bytes each exceed the GPU: the targets
    that stream, which is where a self-draft shares the resident part."""
    known = config_shapes.known_models()
    return [name for name, fields in known.items()
            if config_shapes.weight_bytes(fields, 2).total > total_bytes - CUDA_CONTEXT_BYTES]


def suggest_self_draft(config: EngineConfig, total_bytes: int) -> None:
    """Under a streamed target's plan: the self-draft that fits this GPU, if one does (one line)."""
    if not config.offload.enabled or config.model.draft == SELF_DRAFT or config.speculation.method == "autoregressive":
        return
    fit = self_draft_fit.self_draft_fit(config.model.target, total_bytes)
    if fit.fits:
        print(self_draft_fit.describe_fit(fit))


def with_draft(config: EngineConfig, total_bytes: int) -> EngineConfig:
    """The draft a plan uses: one named; `auto` chosen as the server would where the target's tokenizer can
    be had (its folder, the hub cache, or, when models.toml names no draft for it, a download of its
    tokenizer files); else models.toml's draft for the target, or no speculation."""
    if config.model.draft == "auto" and config.speculation.method != "autoregressive":
        from engine.model import hub

        target = config.model.target
        known = None if hub.is_local(target) else config_shapes.read_model_config(target)[0].get("draft")
        at_hand = hub.is_local(target) or hub.cached_snapshot(target, config.model.revision) is not None
        chosen = with_auto_draft(config, total_bytes) if at_hand or not known else None
        if chosen is not None:
            return chosen
        config = config.replace("model", draft="")
    return with_known_draft(config)


def with_known_draft(config: EngineConfig, say: bool = True) -> EngineConfig:
    """A target named without a draft plans with the draft models.toml names for it (one of its token
    ids); a streamed target with none, with its own layers in 4-bit (--draft self) where it can have them,
    as `--draft auto` would choose; else without speculation. `say`: which, on stdout."""
    if config.model.draft or config.speculation.method == "autoregressive":
        return config
    target, _ = config_shapes.read_model_config(config.model.target)
    draft = target.get("draft")
    if draft:
        if say:
            print(f"draft: {draft} ({config_shapes.KNOWN_SHAPES.name}'s draft for the target: it shares its token ids)")
        return config.replace("model", draft=draft)
    if config.offload.enabled and self_draft_plan.target_refusal(target) is None:
        if say:
            print("draft: the target's own layers in 4-bit (--draft self: no other model is known to share its "
                  "token ids)")
        return config.replace("model", draft=SELF_DRAFT)
    if say:
        print("no draft given and none known to share the target's token ids: planned without speculation "
              "(--method autoregressive)")
    return config.replace("speculation", method="autoregressive")


def table_config(entry: str) -> tuple[EngineConfig, str]:
    """A --table entry's config and name: a config file, or a known model streamed with its known draft."""
    if Path(entry).is_file():
        return engine_config_from(read_config_file(entry), {}, entry), Path(entry).name
    config = engine_config_from({}, {"model": {"target": entry}, "offload": {"enabled": True}})
    return with_known_draft(config, say=False), f"`{entry}`"


def with_auto_draft(config: EngineConfig, total_bytes: int) -> EngineConfig | None:
    """`--draft auto` for a plan: chosen as the server would choose it on this GPU, without weights
    (the target's tokenizer from its folder or the hub cache, else its tokenizer files downloaded);
    None when the tokenizer cannot be had."""
    import sys

    from engine.model import draft_auto, hub

    target = config.model.target
    tokens = target if hub.is_local(target) else hub.tokenizer_folder(target)
    if tokens is None:
        print(f"specexec: --draft auto: {target}'s tokenizer is not in the cache and cannot be downloaded now",
              file=sys.stderr)
        return None
    draft, why = draft_auto.choose_draft(config, target, total_bytes, f"a {total_bytes / GB:g} GB GPU",
                                         tokens_folder=str(tokens), fetch=False)
    print(f"specexec: {why}", file=sys.stderr)
    return config.replace("model", draft=draft)


def table_row(name: str, flags: str, result: PairPlan) -> str:
    speed = plan_estimate.estimate_speed(result)
    estimate = f"{speed.tokens_per_second:.1f} ({speed.tokens_per_pass:.1f} x {1 / speed.pass_seconds:.2f})" if speed else "-"
    return (f"| {name} | {result.config.model.target} | {result.config.model.draft or '-'} | {flags or 'as configured'} "
            f"| {result.resident_layers} / {result.num_layers} | {slots(result)} | {result.plan.total / GB:.2f} "
            f"| {'yes' if result.fits else 'no'} | {plan_estimate.host_ram(result)[0] / GB:.0f} | {estimate} |")


def print_table(paths: list[str], total_bytes: int) -> None:
    """A markdown table: each config's (or known model's) pair as configured, and when it does not fit
    the alternatives; with the host RAM each needs and its speed estimate at the assumed link and tokens per
    pass."""
    usable = (total_bytes - CUDA_CONTEXT_BYTES) / GB
    print(f"| config | target | draft | changed | resident layers | KV slots | GB (of {usable:g}) | fits | host RAM GB "
          "| est. tokens/s (tokens per pass x passes/s) |")
    print("|---|---|---|---|--:|---|--:|---|--:|--:|")
    for path in paths:
        config, name = table_config(path)
        result = plan_pair(config, total_bytes)
        print(table_row(name, "", result))
        if not result.fits:
            for flags, alternative in alternatives(config, total_bytes):
                print(table_row(name, f"`{flags}`", alternative))
