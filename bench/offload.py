"""`specexec bench offload [--target PATH]`: is streaming hidden behind compute?

For 1, 32 and 256 tokens it times back-to-back target passes with every decoder layer resident,
streamed from RAM and streamed from disk with its pages evicted, plus a plain copy (RAM) or read
(disk) of the same bytes with the same buffers. Overlap works when a streamed pass takes about
max(copy time, compute time); the goal is within 15%. Without --target it uses the seeded random
Llama with four 117 MB fp32 layers that bench quant builds (built once, cached under
~/.cache/specexec/quant-bench).

    python -m bench.offload [--target PATH] [--tokens 1 32 256] [--passes 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from bench.pad_target import cache_base
from bench.target import DEFAULT_SHAPE, cached_float_target
from engine.config import EngineConfig, ModelConfig, OffloadConfig
from engine.model import checkpoint
from engine.model.runner import DecoderRunner
from engine.offload.build import build_offloaded_runner, open_disk_store
from engine.offload.device import empty_buffer, empty_host, synchronize
from engine.offload.disk_store import DiskStore
from engine.offload.layout import layout_of
from engine.offload.ram_store import RamStore
from engine.offload.ring import LayerStreamer
from engine.speculation.tree import causal_mask

GOAL = 1.15  # streamed pass time / max(copy time, compute time)


@dataclass
class Row:
    source: str
    num_tokens: int
    resident_s: float  # compute time: one pass with every layer resident
    streamed_s: float
    streamed_cores: float  # CPU seconds / wall seconds during the streamed passes
    copy_s: float  # plain copy (ram) or evicted read (disk) of the bytes one pass streams
    bytes_per_pass: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        help="target checkpoint folder (default: bench quant's 470 MB fp32 target, built once and cached)",
    )
    add_timing_arguments(parser, tokens=[1, 32, 256], passes=3, rounds=3)


def add_timing_arguments(parser: argparse.ArgumentParser, tokens: list[int], passes: int, rounds: int) -> None:
    """The flags `measure` reads (shared with bench quant)."""
    parser.add_argument("--tokens", type=int, nargs="+", default=tokens, help="tokens per pass")
    parser.add_argument("--passes", type=int, default=passes, help="back-to-back passes per timing")
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds; the best round counts")
    parser.add_argument("--ring-size", type=int, default=2, help="device ring buffers")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: all cores but one on CPU, for the loader)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--sources", nargs="+", default=["ram", "disk"], choices=["ram", "disk"])


def time_passes(runner: DecoderRunner, num_tokens: int, num_passes: int) -> tuple[float, float]:
    """Seconds per pass over `num_tokens` causal tokens, back to back, after one warm-up pass, and
    the CPU cores the process kept busy meanwhile (CPU seconds / wall seconds: overlap on a CPU
    device needs a second core for the loader thread).

    A streamed runner's loader then refills the ring before returning, so no load is in flight
    while the next measurement runs."""
    device = runner.device
    token_ids = torch.arange(num_tokens, device=device) % runner.vocab_size
    positions = torch.arange(num_tokens, device=device)
    mask = causal_mask(num_tokens, 0, device)
    cache = runner.new_cache(num_tokens)
    runner.forward(token_ids, positions, cache, 0, mask)
    synchronize(device)
    begin, cpu_begin = time.perf_counter(), time.process_time()
    for _ in range(num_passes):
        runner.forward(token_ids, positions, cache, 0, mask)
    synchronize(device)
    wall, cpu = time.perf_counter() - begin, time.process_time() - cpu_begin
    if isinstance(runner.layers, LayerStreamer):
        runner.layers.wait_prefetched()
    return wall / num_passes, cpu / wall


def plain_copy_seconds(store: RamStore | DiskStore, dst: torch.Tensor) -> float:
    """Seconds to move every streamed layer into `dst` (one slot-sized buffer), with no compute."""
    host = dst if dst.device.type == "cpu" else empty_host(dst.numel())  # disk reads land on the host
    begin = time.perf_counter()
    for idx in sorted(store.rest):
        if isinstance(store, RamStore):
            dst[: store.buffers[idx].numel()].copy_(store.buffers[idx])
        else:
            store.read_into(idx, host)
            if host is not dst:
                dst.copy_(host)
    synchronize(dst.device)
    return time.perf_counter() - begin


def load_unmapped(
    target: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    gptq_kernel: str = "dequantize",
    compute_device: torch.device | None = None,
) -> torch.nn.Module:
    """The model with its weights copied off the checkpoint's memory map: pages touched through a
    mapping stay in the page cache, which would turn the disk source's evicted reads into cached ones.
    A GPTQ checkpoint's layers run on `gptq_kernel` for `compute_device` (default: `device`)."""
    model = checkpoint.load_model(target, dtype, device, gptq_kernel, compute_device)
    for param in model.parameters():
        param.data = param.data.clone()
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.clone()
    return model


def streamed_runner(
    target: str,
    source: str,
    ring_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    gptq_kernel: str = "dequantize",
) -> DecoderRunner:
    offload = OffloadConfig(enabled=True, source=source, resident_layers=0, ring_size=ring_size)
    config = EngineConfig(model=ModelConfig(target=target), offload=offload)
    return build_offloaded_runner(load_unmapped(target, "cpu", dtype, gptq_kernel, device), config, device)


def measure(
    target: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    gptq_kernel: str = "dequantize",
) -> list[Row]:
    """Best of `rounds` alternating timings, so slow phases of a shared machine hit every variant alike.
    A GPTQ target's layers run on `gptq_kernel` (the int4 kernel streams from RAM only)."""
    runners = {"resident": DecoderRunner(load_unmapped(target, device, dtype, gptq_kernel))}
    runners.update(
        {source: streamed_runner(target, source, args.ring_size, device, dtype, gptq_kernel) for source in args.sources}
    )
    streamers = {source: runners[source].layers for source in args.sources}
    copy_stores: dict[str, RamStore | DiskStore] = {}  # the same copies or reads, without a loader thread
    for source, streamer in streamers.items():
        if source == "disk":
            streamed = {idx: streamer.layers[idx] for idx in streamer.layouts}
            packed = {idx: layout_of(layer) for idx, layer in streamed.items()}
            copy_stores[source] = open_disk_store(target, runners[source].config, streamed, packed, evict=True)
        else:
            copy_stores[source] = streamer.store
    dst = empty_buffer(max(s.slot_bytes for s in streamers.values()), device).fill_(0)
    best: dict[tuple[str, int], tuple[float, float]] = {}  # (seconds, cores) of the fastest round
    inf = (float("inf"), 0.0)
    for _ in range(args.rounds):
        for source in args.sources:
            seconds = plain_copy_seconds(copy_stores[source], dst)
            best[source, 0] = min(best.get((source, 0), inf), (seconds, 0.0))
        for num_tokens in args.tokens:
            for name, runner in runners.items():
                timing = time_passes(runner, num_tokens, args.passes)
                best[name, num_tokens] = min(best.get((name, num_tokens), inf), timing)
    bytes_per_pass = {s: sum(layout.nbytes for layout in streamers[s].layouts.values()) for s in streamers}
    for source in args.sources:
        copy_stores[source].close()
    for streamer in streamers.values():
        streamer.close()
    return [
        Row(source, n, best["resident", n][0], *best[source, n], best[source, 0][0], bytes_per_pass[source])
        for source in args.sources
        for n in args.tokens
    ]


def print_table(rows: list[Row]) -> None:
    """One row per source and token count; `overlap` is 1 when the streamed pass costs max(copy,
    compute) (fully hidden) and 0 when it costs copy + compute (no overlap at all)."""
    head = (
        f"{'source':<7}{'tokens':>7}{'resident ms':>13}{'copy ms':>9}{'streamed ms':>13}{'cores':>7}{'MB/pass':>9}"
        f"{'stream GB/s':>13}{'copy GB/s':>11}{'overlap':>9}{'vs max(copy,compute)':>22}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        hidden, serial = max(r.copy_s, r.resident_s), r.copy_s + r.resident_s
        overlap = (serial - r.streamed_s) / (serial - hidden)
        ratio = r.streamed_s / hidden
        print(
            f"{r.source:<7}{r.num_tokens:>7}{r.resident_s * 1e3:>13.1f}{r.copy_s * 1e3:>9.1f}"
            f"{r.streamed_s * 1e3:>13.1f}{r.streamed_cores:>7.2f}{r.bytes_per_pass / 1e6:>9.3g}"
            f"{r.bytes_per_pass / r.streamed_s / 1e9:>13.2f}{r.bytes_per_pass / r.copy_s / 1e9:>11.2f}"
            f"{overlap:>9.2f}{ratio:>17.2f} {'ok' if ratio <= GOAL else 'MISS':>4}"
        )
    print(f"goal: streamed pass <= {GOAL:.2f} x max(copy, compute). copy: a plain copy (ram) or read (disk,")
    print("O_DIRECT or page-evicted, cold every pass) of the same bytes, no compute alongside. cores: CPU")
    print("seconds per wall second during the streamed passes (compute and loader need one core each).")


def set_threads(threads: int, device: torch.device) -> None:
    """`threads`, or on CPU all cores but one: the loader thread needs a core to overlap compute."""
    if threads or device.type == "cpu":
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))


def run(args: argparse.Namespace) -> int:
    device = checkpoint.resolve_device(args.device)
    set_threads(args.threads, device)
    target = args.target
    if target is None:
        root = cache_base() / "quant-bench"  # shared with `specexec bench quant`
        target = str(cached_float_target(root, DEFAULT_SHAPE, "fp32", torch.float32))
        print(f"target: the random Llama bench quant builds at its default shape, {target}")
    rows = measure(target, args, device)
    print(
        f"device {device}, torch threads {torch.get_num_threads()}, ring {args.ring_size}, "
        f"best of {args.rounds} rounds x {args.passes} back-to-back passes"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="specexec bench offload", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
