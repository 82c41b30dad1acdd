"""`specexec bench quant`: bytes streamed per pass and pass time, fp32 vs fp16 vs GPTQ 4-bit.

One architecture (the offload benchmark's seeded random Llama: 4 decoder layers, hidden 1024, MLP
8192) saved three ways: fp32, fp16, and GPTQ 4-bit (group 128, symmetric, quantized by gptqmodel
from the fp32 weights, calibrated on seeded random token ids; needs the `gptq` extra). For each,
the bytes one pass streams (what the layer ring moves: packed qweight/qzeros/scales/g_idx for
GPTQ), a plain copy (RAM) or cold read (disk) of those bytes, and the time of a pass with every
layer resident and streamed from RAM and from disk, as `specexec bench offload` measures them.

The checkpoints are built once and cached (quantizing takes about 100 s on a 2-core CPU). fp32 and
GPTQ run with fp32 activations, fp16 with fp16 ones (its bytes must stay fp16 to stream half).

gptq-4bit runs the 4-bit layers on torch's int4 matmul (the engine's choice on CPU; RAM source and
resident only: the disk source streams the checkpoint's own packing), gptq-4bit-dequantize on
gptqmodel's torch kernel, which dequantises each matrix on every call (every source).

    specexec bench quant [--tokens 1 32] [--precisions fp32,fp16,gptq-4bit,gptq-4bit-dequantize] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import multiprocessing
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import offload as bench_offload
from bench.pad_target import cache_base
from bench.target import cache_key, cached_float_target, is_built, mark_built
from engine.cli import comma_list
from engine.model import gptq
from engine.model.checkpoint import resolve_device

PRECISIONS = ("fp32", "fp16", "gptq-4bit", "gptq-4bit-dequantize")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "gptq-4bit": torch.float32,
          "gptq-4bit-dequantize": torch.float32}  # load (activation) dtype
# GPTQ kernel per precision: int4 (torch's int4 matmul; streams from RAM only) or gptqmodel's dequantize
KERNELS = {"gptq-4bit": "int4", "gptq-4bit-dequantize": "dequantize"}
CHECKPOINTS = {"gptq-4bit-dequantize": "gptq-4bit"}  # the same checkpoint, another kernel
CALIBRATION_SAMPLES = 16
CALIBRATION_TOKENS = 64


@dataclass
class QuantRow:
    precision: str
    activations: str
    num_tokens: int
    bytes_per_pass: int
    resident_s: float
    ram_copy_s: float | None = None
    ram_streamed_s: float | None = None
    disk_read_s: float | None = None
    disk_streamed_s: float | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precisions", type=comma_list(str), default=list(PRECISIONS), help=f"comma list of {PRECISIONS}"
    )
    bench_offload.add_timing_arguments(parser, tokens=[1, 32], passes=2, rounds=2)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the built target")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the built target")
    parser.add_argument("--mlp", type=int, default=8192, help="MLP width of the built target")
    parser.add_argument("--group-size", type=int, default=128, help="GPTQ group size")
    parser.add_argument("--seed", type=int, default=0, help="weights and calibration seed")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where built checkpoints are kept (default: ~/.cache/specexec/quant-bench)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def cache_dir(args: argparse.Namespace) -> Path:
    return args.cache_dir or cache_base() / "quant-bench"


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    return {"num_layers": args.layers, "hidden": args.hidden, "mlp": args.mlp, "seed": args.seed}


def calibration_data(seed: int, vocab_size: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (CALIBRATION_SAMPLES, CALIBRATION_TOKENS), generator=gen)
    return [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids.tolist()]


def quantize_gptq(
    source: Path, folder: Path, group_size: int, seed: int, bits: int = 4, desc_act: bool = False
) -> Path:
    """GPTQ-quantize checkpoint `source` into `folder` with gptqmodel on this machine's CPU
    (`desc_act`: act-order, as many published checkpoints are; g_idx is then not trivial)."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default, (cores + 1) // 2, fails on 2 cores
    from gptqmodel import GPTQModel, QuantizeConfig

    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    config = QuantizeConfig(bits=bits, group_size=group_size, desc_act=desc_act, sym=True, offload_to_disk=False)
    folder.mkdir(parents=True, exist_ok=True)
    previous = Path.cwd()
    os.chdir(folder)  # gptqmodel writes a quantization log to ./logs (contextlib.chdir needs Python 3.11)
    try:
        model = GPTQModel.load(str(source), config)
        model.quantize(calibration_data(seed, vocab_size), batch_size=4)
        model.save(str(folder))
    finally:
        os.chdir(previous)
    return folder


def built_target(args: argparse.Namespace, precision: str) -> Path:
    """The cached checkpoint for `precision`, built first if absent."""
    shape = shape_of(args)
    if precision != "gptq-4bit":
        return cached_float_target(cache_dir(args), shape, precision, DTYPES[precision])
    extra = (args.group_size, CALIBRATION_SAMPLES, CALIBRATION_TOKENS, importlib.metadata.version("gptqmodel"))
    folder = cache_dir(args) / cache_key(shape, precision, extra)
    if is_built(folder):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    source = built_target(args, "fp32")
    print(f"quantizing {source} to GPTQ 4-bit (group {args.group_size}) ...", file=sys.stderr, flush=True)
    # In a child process: gptqmodel's leftover state slows this process's later passes.
    child = multiprocessing.get_context("spawn").Process(
        target=quantize_gptq, args=(source, folder, args.group_size, args.seed)
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"quantizing {source} with gptqmodel failed (exit code {child.exitcode}); see above")
    return mark_built(folder, precision, shape)


def measure_all(precisions: list[str], args: argparse.Namespace, device: torch.device) -> list[QuantRow]:
    """Every precision once per round, rounds alternating (disk and CPU speed drift on a shared
    machine hits every precision alike); per figure, the best round counts."""
    targets = {precision: str(built_target(args, CHECKPOINTS.get(precision, precision))) for precision in precisions}
    one_round = argparse.Namespace(**{**vars(args), "rounds": 1})
    best: dict[tuple[str, int], QuantRow] = {}
    for _ in range(args.rounds):
        for precision in precisions:
            dtype = DTYPES[precision]
            kernel = KERNELS.get(precision, "dequantize")
            sources = [s for s in args.sources if kernel != "int4" or s == "ram"]
            rounds = argparse.Namespace(**{**vars(one_round), "sources": sources})
            for row in bench_offload.measure(targets[precision], rounds, device, dtype, kernel):
                out = best.setdefault(
                    (precision, row.num_tokens),
                    QuantRow(
                        precision,
                        str(dtype).removeprefix("torch."),
                        row.num_tokens,
                        row.bytes_per_pass,
                        row.resident_s,
                    ),
                )
                out.resident_s = min(out.resident_s, row.resident_s)
                copy_field = "ram_copy_s" if row.source == "ram" else "disk_read_s"
                for name, value in ((copy_field, row.copy_s), (f"{row.source}_streamed_s", row.streamed_s)):
                    current = getattr(out, name)
                    setattr(out, name, value if current is None else min(current, value))
            gc.collect()
    return [best[p, n] for p in precisions for n in args.tokens]


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def print_table(rows: list[QuantRow]) -> None:
    """A markdown table: per precision and token count, bytes and pass times, and the streamed pass
    time relative to fp32 at the same token count."""
    base = {r.num_tokens: r for r in rows if r.precision == "fp32"}
    print(
        "| precision | activations | MB/pass | bytes vs fp32 | tokens | resident ms | RAM copy ms "
        "| RAM streamed ms | vs fp32 | disk read ms | disk streamed ms | vs fp32 |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        ref = base.get(r.num_tokens)
        print(
            f"| {r.precision} | {r.activations} | {r.bytes_per_pass / 1e6:.1f} "
            f"| {ratio(r.bytes_per_pass, ref and ref.bytes_per_pass)} | {r.num_tokens} | {ms(r.resident_s)} "
            f"| {ms(r.ram_copy_s)} | {ms(r.ram_streamed_s)} | {ratio(r.ram_streamed_s, ref and ref.ram_streamed_s)} "
            f"| {ms(r.disk_read_s)} | {ms(r.disk_streamed_s)} | {ratio(r.disk_streamed_s, ref and ref.disk_streamed_s)} |"
        )


def run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.precisions) - set(PRECISIONS))
    if unknown:
        print(
            f"specexec bench quant: unknown precision {', '.join(unknown)}; choose from {PRECISIONS}",
            file=sys.stderr,
        )
        return 2
    device = resolve_device(args.device)
    bench_offload.set_threads(args.threads, device)
    precisions = [p for p in PRECISIONS if p in args.precisions]
    skipped = []
    if any(p in KERNELS for p in precisions) and gptq.missing_modules():
        precisions = [p for p in precisions if p not in KERNELS]
        skipped.append(
            f"gptq-4bit: skipped, the gptq extra is not installed ({', '.join(gptq.missing_modules())} "
            f"missing): {gptq.GPTQ_PIP}"
        )
    rows = measure_all(precisions, args, device)
    print(
        f"target: random Llama, {args.layers} layers, hidden {args.hidden}, MLP {args.mlp}; device {device}, "
        f"torch threads {torch.get_num_threads()}, ring {args.ring_size}, best of {args.rounds} rounds x "
        f"{args.passes} passes"
    )
    print_table(rows)
    for line in skipped:
        print(line)
    print(
        "resident: every layer on the device (compute only). copy/read: the same bytes moved with no compute\n"
        "(disk: cold, O_DIRECT or pages evicted). streamed: a pass with every layer streamed through the ring.\n"
        "vs fp32: streamed pass time over fp32's at the same token count (below 1: faster)."
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "skipped": skipped}, indent=2))
    return 0
