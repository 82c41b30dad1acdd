"""`specexec bench load`: peak host memory (RSS) while loading an offloaded target.

Builds (once, cached) seeded random bf16 checkpoints of a Mixtral shape (8 experts, fused on load)
and a Llama shape, then loads each in a fresh child process, as the server does (`load_pair`,
target only), with the RAM and the disk source and a load dtype (float16 by default: a bf16 -> fp16
conversion). The child reports its resident set before the load (VmHWM after importing the engine and the
model's transformers module, about 0.4 GB), the peak during it (VmHWM) and after it (VmRSS), so the
growth is what the load itself held. With
--available-gb the child's host-memory figure is faked (engine.offload.host_memory), to show a
refusal and the memory held up to it.

    specexec bench load [--gb 2] [--archs mixtral,llama] [--sources ram,disk] [--dtype float16]
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import queue as queue_module
import sys
from pathlib import Path

from bench.pad_target import cache_base
from engine.cli import comma_list

GB = 10**9
SHAPES = {  # per arch: config fields, and the bf16 bytes of one decoder layer
    "mixtral": dict(hidden_size=1024, intermediate_size=3072, num_local_experts=8, num_experts_per_tok=2),
    "llama": dict(hidden_size=2048, intermediate_size=8192),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (bf16), about")
    parser.add_argument("--archs", type=comma_list(str), default=list(SHAPES), help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--sources", type=comma_list(str), default=["ram", "disk"], help="offload sources")
    parser.add_argument("--dtype", default="float16", help="load dtype (the checkpoints are bfloat16)")
    parser.add_argument("--available-gb", type=float, default=None,
                        help="fake the host's available memory (GB) in the loading process")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where built checkpoints are kept (default: ~/.cache/specexec/load-bench)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def model_config(arch: str, gb: float):
    from transformers import LlamaConfig, MixtralConfig

    fields = SHAPES[arch]
    hidden, inter = fields["hidden_size"], fields["intermediate_size"]
    experts = fields.get("num_local_experts", 1)
    layer_bytes = 2 * (3 * hidden * inter * experts + 4 * hidden * hidden)
    common = dict(vocab_size=32000, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  num_hidden_layers=max(1, round((gb * GB - 2 * 2 * 32000 * hidden) / layer_bytes)), **fields)
    return MixtralConfig(**common) if arch == "mixtral" else LlamaConfig(**common)


def built_checkpoint(cache: Path, arch: str, gb: float) -> Path:
    """A seeded random bf16 checkpoint of `arch` at about `gb` GB, built once."""
    folder = cache / f"{arch}-{gb:g}gb-bf16"
    if (folder / "built.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    print(f"building {folder} ...", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(arch, gb), dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size="1GB")
    (folder / "built.json").write_text(json.dumps({"arch": arch, "gb": gb}))
    return folder


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def load_in_child(target: str, source: str, dtype: str, available: float | None, out) -> None:
    """Runs in a fresh process: load the target as the server does; report RSS figures (KB)."""
    import torch

    from engine.config import EngineConfig, ModelConfig, OffloadConfig, SpeculationConfig
    from engine.model.pair import load_pair

    torch.set_num_threads(1)
    model_type = json.loads((Path(target) / "config.json").read_text())["model_type"]
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")  # ~190 MB of code, not the load's
    if available is not None:
        from engine.offload import host_memory

        host_memory.host_memory_available = lambda: int(available * GB)
    config = EngineConfig(model=ModelConfig(target=target, dtype=dtype),
                          speculation=SpeculationConfig(method="autoregressive"),
                          offload=OffloadConfig(enabled=True, source=source, resident_layers=0))
    before = status_kb("VmHWM")
    refused = None
    try:
        pair = load_pair(config)
    except Exception as exc:  # noqa: BLE001 - reported, the parent prints it
        refused = f"{type(exc).__name__}: {exc}"
    else:
        pair.close()
    out.put({"before_kb": before, "peak_kb": status_kb("VmHWM"), "after_kb": status_kb("VmRSS"), "refused": refused})


def measure(target: Path, source: str, dtype: str, available: float | None) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=load_in_child, args=(str(target), source, dtype, available, queue))
    child.start()
    while True:  # a child the kernel's OOM killer ends sends nothing
        try:
            result = queue.get(timeout=1.0)
            break
        except queue_module.Empty:
            if not child.is_alive():
                return {"before_kb": 0, "peak_kb": 0, "after_kb": 0,
                        "refused": f"the loading process died (exit code {child.exitcode}; -9: killed, e.g. out of memory)"}
    child.join()
    return result


def checkpoint_gb(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) / GB


def run(args: argparse.Namespace) -> int:
    cache = args.cache_dir or cache_base() / "load-bench"
    rows = []
    for arch in args.archs:
        target = built_checkpoint(cache, arch, args.gb)
        for source in args.sources:
            result = measure(target, source, args.dtype, args.available_gb)
            rows.append({"arch": arch, "source": source, "dtype": args.dtype, "checkpoint_gb": checkpoint_gb(target),
                         "available_gb": args.available_gb, **result})
    print(f"load dtype {args.dtype}; peak growth = VmHWM during the load minus VmHWM before it")
    print("| target | checkpoint GB (bf16) | source | peak growth GB | of the checkpoint | RSS after GB | refused |")
    print("|---|--:|---|--:|--:|--:|---|")
    for row in rows:
        if not row["peak_kb"]:
            print(f"| {row['arch']} | {row['checkpoint_gb']:.2f} | {row['source']} | - | - | - | {row['refused']} |")
            continue
        growth = (row["peak_kb"] - row["before_kb"]) * 1024 / GB
        after = (row["after_kb"] * 1024) / GB
        refused = (row["refused"] or "no").replace("|", "/")
        print(f"| {row['arch']} | {row['checkpoint_gb']:.2f} | {row['source']} | {growth:.2f} "
              f"| {growth / row['checkpoint_gb']:.0%} | {after:.2f} | {refused} |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
