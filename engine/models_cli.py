"""`specexec models`: the models in the local Hugging Face cache and the pairs they make on a GPU.

    specexec models                          # the cached models; pairs for this machine's GPU
    specexec models --gpu-memory-total 24    # pairs for a 24 GB GPU

One row per cached model the engine can load (engine.model.hub_cache): family (config.json's
model_type), size on disk, quantization, trained context, and the cached models that can draft for it
on that GPU: a share of its token ids (the same vocabulary and special tokens, compared on the
tokenizers: engine.model.draft_auto), at most half its parameters, and a plan that fits beside it
(engine.model.pair_plan, the target streamed with as many resident layers as fit). Engine flags
(--config, --max-context, --budget, ...) shape the plans as they would the server's. No network.
"""

from __future__ import annotations

import argparse

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.model import draft_auto, hub_cache
from engine.model.hub_cache import CachedModel
from engine.model.pair import trained_positions

GB = 10**9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--gpu-memory-total", type=float, default=None, metavar="GB",
                        help="the GPU's memory in GB (10^9 bytes) to plan pairs for (default: this machine's CUDA "
                             "GPU; without one no pairs are planned)")


def quantization(config: dict) -> str:
    """What a config's quantization is, in a few words ("-": none, its dtype)."""
    from engine.model import int4_formats

    quant = config.get("quantization_config") or {}
    if not quant:
        return str(config.get("dtype") or config.get("torch_dtype") or "-").removeprefix("torch.")
    method = str(quant.get("quant_method") or "?").lower()
    if method == "mxfp4":  # engine.model.mxfp4
        return "mxfp4 experts (dequantized at load)"
    if method == "fp8":  # engine.model.fp8
        block = quant.get("weight_block_size")
        return f"fp8 {quant.get('fmt') or 'e4m3'}" + (f", blocks of {block[0]} x {block[1]}" if block else ", per tensor")
    try:
        fmt = int4_formats.format_of(config)
    except Exception as exc:  # a variant the engine refuses: say so, keep listing
        return f"{method} (unsupported: {str(exc)[:60]})"
    if fmt is not None:
        kind = "W4A16 " + ("symmetric" if fmt.symmetric else "asymmetric") if fmt.method != "awq" else "4-bit GEMM"
        return f"{fmt.method} {kind}, groups of {fmt.group_size}"
    group = quant.get("group_size")
    return f"{method} {quant.get('bits', '?')}-bit" + (f", groups of {group}" if group and group > 0 else "") + \
        (", act-order" if quant.get("desc_act") else "")


def gpu_bytes(args: argparse.Namespace) -> tuple[int | None, str]:
    if args.gpu_memory_total is not None:
        return int(args.gpu_memory_total * GB), f"a {args.gpu_memory_total:g} GB GPU"
    import torch

    if torch.cuda.is_available():  # CUDA-only
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name} ({props.total_memory / GB:.1f} GB)"
    return None, "no GPU here (--gpu-memory-total GB plans for one)"


def drafts_for(target: CachedModel, models: list[CachedModel], tokens: dict, config, total: int) -> list[str]:
    """The cached models that can draft for `target` on a GPU of `total` bytes (module doc)."""
    from engine.model.pair_plan import most_resident_that_fit

    found = []
    limit = draft_auto.MAX_DRAFT_FRACTION * draft_auto.num_params(target.config)
    for draft in models:
        if draft is target or tokens[draft.repo_id] is None or tokens[draft.repo_id] != tokens[target.repo_id]:
            continue
        if draft_auto.num_params(draft.config) > limit:
            continue
        pair = config.replace("model", target=str(target.folder), draft=str(draft.folder))
        try:
            result = most_resident_that_fit(pair, total)
        except Exception as exc:  # a shape the plan cannot read: say so in the row
            found.append(f"{draft.repo_id} (not planned: {str(exc)[:60]})")
            continue
        if result is not None:
            found.append(f"{draft.repo_id} ({result.resident_layers}/{result.num_layers} layers resident, "
                         f"{result.plan.total / GB:.1f} GB)")
    return found


def run(args: argparse.Namespace) -> int:
    models = hub_cache.cached_models()
    from engine.model import hub

    if not models:
        print(f"no models the engine can load in the Hugging Face cache ({hub.cache_dir()}); "
              "`specexec serve --target org/name` downloads one")
        return 0
    config, _ = engine_config_from_args(args, require_folders=False)
    total, gpu = gpu_bytes(args)
    tokens = {m.repo_id: draft_auto.token_table(str(m.folder)) for m in models}
    print(f"Hugging Face cache: {hub.cache_dir()}; pairs for {gpu}\n")
    print("| model | family | size on disk | quantization | context | drafts that fit |")
    print("|---|---|--:|---|--:|---|")
    for model in models:
        pairs = "-" if total is None else ", ".join(drafts_for(model, models, tokens, config, total)) or "none"
        context = trained_positions(model.config)
        print(f"| {model.repo_id} | {model.config.get('model_type', '?')} | {model.size_on_disk / GB:.2f} GB "
              f"| {quantization(model.config)} | {context if context else '?'} | {pairs} |")
    return 0
