"""Offloaded target: streamed layers (RAM or disk source, through the device ring) give the resident
target's logits exactly, greedy generation is unchanged, the ring bounds what is materialised, the
loader thread overlaps compute, and failures are loud."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import checkpoint, gptq
from engine.model.runner import DecoderRunner
from engine.offload import build as offload_build
from engine.offload.build import build_offloaded_runner, plan_resident
from engine.offload.device import empty_buffer
from engine.offload.disk_store import DiskStore, open_direct
from engine.offload.layout import constant_buffers, layer_tensors, layout_of
from engine.offload.ram_store import RamStore
from engine.offload.ring import LayerStreamer
from engine.runtime import Engine
from engine.types import ConfigError, OffloadError, SamplingParams
from tests.helpers.offload_passes import (
    CPU,
    assert_same_logits,
    reference_greedy,
    run_passes,
    streamed_runner,
)
from tests.helpers.tiny_models import build_model, make_tiny_pair

ARCHS = ["llama", "mistral", "qwen2", "mixtral"]
NUM_LAYERS = 4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict[str, tuple[str, str]] = {}

    def get(arch: str) -> tuple[str, str]:
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            target, draft = make_tiny_pair(folder, arch=arch, draft="noisy", seed=3, layers=NUM_LAYERS)
            cache[arch] = (str(target), str(draft))
        return cache[arch]

    return get


@pytest.mark.parametrize("source", ["ram", "disk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_logits_equal_resident(pairs, arch, source):
    target, _ = pairs(arch)
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    for resident, ring in ((0, 2), (1, 3)):
        runner = streamed_runner(target, source=source, resident_layers=resident, ring_size=ring)
        try:
            assert isinstance(runner.layers, LayerStreamer)
            assert len(runner.layers.streamed) == NUM_LAYERS - resident
            assert_same_logits(run_passes(runner), want)
            assert_same_logits(run_passes(runner), want)  # the ring wrapped into the next passes
        finally:
            runner.layers.close()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("source", ["ram", "disk"])
def test_streamed_logits_equal_resident_cuda(pairs, source):
    target, _ = pairs("llama")
    device = torch.device("cuda")
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32, device)), device)
    runner = streamed_runner(target, device, source=source, resident_layers=1)
    try:
        host = runner.layers.store.buffers.values() if source == "ram" else runner.layers.staging
        assert host and all(buf.is_pinned() for buf in host)  # the host side of every async copy
        assert_same_logits(run_passes(runner, device), want)
        assert_same_logits(run_passes(runner, device), want)
    finally:
        runner.layers.close()




@pytest.mark.parametrize(("arch", "source"), [(a, s) for a in ARCHS for s in ("ram", "disk")])
def test_greedy_generation_with_offload_equals_target_alone(pairs, arch, source):
    target, draft = pairs(arch)
    prompt = [5, 17, 42, 9, 77, 130, 64]
    want = reference_greedy(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), prompt, 24)
    config = EngineConfig(
        model=ModelConfig(target=target, draft=draft),
        speculation=SpeculationConfig(budget=16),
        offload=OffloadConfig(enabled=True, source=source, resident_layers=1),
    )
    engine = Engine.load(config)
    try:
        got = engine.generate_ids(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    finally:
        engine.pair.target.layers.close()
    assert got == want


class Recorder:
    """Instrumentation: the streamer's events in one global order, plus checks run during compute."""

    def __init__(self, streamer: LayerStreamer, block_until_next_load: bool = False):
        self.streamer = streamer
        self.trace: list[tuple[str, int, int]] = []  # (event, layer, slot), in happening order
        self.block = block_until_next_load
        self.cond = threading.Condition()
        self.loads_started = 0
        self.uses = 0
        self.overlapped: list[bool] = []
        self.bound_to_ring: list[int] = []  # per compute: streamed layers whose tensors live in the ring
        streamer.instrument(self.on_event)  # from the first load on

    def on_event(self, event: str, idx: int, slot: int) -> None:
        with self.cond:
            self.trace.append((event, idx, slot))
            if event == "load_start":
                self.loads_started += 1
                self.cond.notify_all()
        if event == "compute_start":
            self.bound_to_ring.append(self.count_bound_to_ring())
            use, self.uses = self.uses, self.uses + 1
            if self.block:  # compute of use k does not end before load k + 1 starts
                with self.cond:
                    ok = self.cond.wait_for(lambda: self.loads_started >= use + 2, timeout=30)
                self.overlapped.append(ok)

    def count_bound_to_ring(self) -> int:
        ranges = [(buf.data_ptr(), buf.data_ptr() + buf.numel()) for buf in self.streamer.ring]
        bound = 0
        for binding in self.streamer.bindings.values():
            ptrs = binding.data_ptrs()
            bound += any(lo <= p < hi for p in ptrs for lo, hi in ranges)
        return bound


@pytest.mark.parametrize(("ring", "resident"), [(2, 0), (3, 1)])
def test_at_most_ring_size_layers_materialised(pairs, ring, resident):
    target, _ = pairs("qwen2")
    runner = streamed_runner(target, source="disk", resident_layers=resident, ring_size=ring)
    streamer = runner.layers
    recorder = Recorder(streamer)
    try:
        for _ in range(3):
            run_passes(runner)
    finally:
        streamer.close()
    assert len(streamer.ring) == ring  # the only device memory streamed layers ever use
    assert recorder.bound_to_ring == [1] * (6 * (NUM_LAYERS - resident))  # only the computing layer
    occupied: dict[int, int] = {}  # slot -> layer whose bytes it holds (loading, loaded or in use)
    peak = 0
    for event, idx, slot in recorder.trace:
        if event == "load_start":
            assert slot not in occupied, "a slot was overwritten before its layer was released"
            occupied[slot] = idx
        elif event == "compute_start":
            assert occupied.get(slot) == idx
        elif event == "release":
            assert occupied.pop(slot) == idx
        peak = max(peak, len(occupied))
    assert peak == ring


def test_prefetch_overlaps_compute_and_wraps_across_passes(pairs):
    target, _ = pairs("llama")
    runner = streamed_runner(target, source="ram", ring_size=2)
    recorder = Recorder(runner.layers, block_until_next_load=True)
    try:
        run_passes(runner)
    finally:
        runner.layers.close()
    assert recorder.overlapped == [True] * (2 * NUM_LAYERS)
    loads = [i for i, (event, _, _) in enumerate(recorder.trace) if event == "load_start"]
    releases = [i for i, (event, _, _) in enumerate(recorder.trace) if event == "release"]
    # (so layer i+1's load began before layer i's compute ended: the recorder holds compute until then)
    next_first = recorder.trace[loads[len(releases)]]
    assert next_first[1] == 0  # the load after the last pass's layers is the next pass's layer 0


def test_ram_store_params_are_views_into_one_buffer_per_layer(pairs):
    target, _ = pairs("mixtral")
    runner = streamed_runner(target, source="ram", resident_layers=2)
    store = runner.layers.store
    try:
        assert isinstance(store, RamStore)
        assert sorted(store.buffers) == [1, 3]  # resident layers 0 and 2 are spread evenly
        for idx, buffer in store.buffers.items():
            lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
            assert all(lo <= p < hi for p in runner.layers.bindings[idx].data_ptrs())
            assert buffer.is_pinned() == torch.cuda.is_available()
    finally:
        runner.layers.close()


class ReadRedirect:
    """Points the disk store's descriptors for `path` at another file (the checkpoint stays intact:
    transformers may have it memory-mapped), and back."""

    def __init__(self, store, path: str):
        self.fds = [fd for fd in (store.fds[path], store.direct_fds.get(path)) if fd is not None]
        self.saved = [os.dup(fd) for fd in self.fds]

    def redirect(self, other: Path) -> None:
        other_fd = os.open(other, os.O_RDONLY)
        for fd in self.fds:
            os.dup2(other_fd, fd)
        os.close(other_fd)

    def restore(self) -> None:
        for fd, saved in zip(self.fds, self.saved, strict=True):
            os.dup2(saved, fd)

    def close(self) -> None:
        for saved in self.saved:
            os.close(saved)


def test_disk_read_error_stops_the_pass_and_the_next_pass_recovers(pairs, tmp_path):
    target, _ = pairs("llama")
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    weights = str(Path(target) / "model.safetensors")
    short = tmp_path / "short.safetensors"
    short.write_bytes(Path(weights).read_bytes()[:4096])
    runner = streamed_runner(target, source="disk", ring_size=2)
    reads = ReadRedirect(runner.layers.store, weights)
    try:
        run_passes(runner)
        reads.redirect(short)  # the store's reads now hit end of file
        with pytest.raises(OffloadError, match="unexpected end of file") as info:
            run_passes(runner)
        assert "target layer" in str(info.value) and weights in str(info.value)
        reads.restore()
        assert_same_logits(run_passes(runner), want)
    finally:
        reads.close()
        runner.layers.close()


def test_failed_prefetch_for_the_next_pass_is_raised_by_that_pass(pairs, tmp_path):
    target, _ = pairs("qwen2")
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    (tmp_path / "empty").write_bytes(b"")
    runner = streamed_runner(target, source="disk", ring_size=2)
    streamer = runner.layers
    reads = ReadRedirect(streamer.store, str(Path(target) / "model.safetensors"))
    loads_done = []

    def break_reads_after_first_pass(event: str, idx: int, slot: int) -> None:
        if event == "load_end":
            loads_done.append(idx)
            if len(loads_done) == NUM_LAYERS:  # in the loader thread, before the next pass's loads
                reads.redirect(tmp_path / "empty")

    streamer.instrument(break_reads_after_first_pass)
    try:
        # The prefill pass completes; the tree pass raises: at begin_pass if the failed prefetch of
        # its layer 0 is already known, else when it needs layer 0.
        with pytest.raises(OffloadError, match="loading target layer 0 from disk failed"):
            run_passes(runner)
        streamer.on_event = None
        reads.restore()
        assert_same_logits(run_passes(runner), want)
    finally:
        reads.close()
        streamer.close()


@pytest.mark.parametrize("evict", [True, False])
def test_disk_reads_whole_layer_spans_into_a_file_mirroring_layout(pairs, evict):
    target, _ = pairs("llama")
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    runner = streamed_runner(target, source="disk", evict_page_cache=evict)
    store = runner.layers.store
    try:
        assert sorted(store.spans) == list(range(NUM_LAYERS))  # one read per layer
        direct = any(fd is not None for fd in store.direct_fds.values())
        probe = open_direct(str(Path(target) / "model.safetensors"))
        supported = probe is not None
        if probe is not None:
            os.close(probe)
        assert direct == (evict and supported)  # O_DIRECT when serving without the page cache
        assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


def test_disk_source_converts_dtype_and_reads_sharded_checkpoints(tmp_path):
    model = build_model("mixtral", 320, seed=5, layers=NUM_LAYERS)
    folder = tmp_path / "fp16-sharded"
    model.half().save_pretrained(folder, max_shard_size="200KB")  # float16 on disk, several files
    assert len(list(folder.glob("*.safetensors"))) > 1
    want = run_passes(DecoderRunner(checkpoint.load_model(str(folder), torch.float32)))
    runner = streamed_runner(str(folder), source="disk", resident_layers=1)
    try:
        store = runner.layers.store
        assert not store.spans and any(p.src_dtype == torch.float16 for p in store.plans[1])  # pieces
        assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


def test_compute_error_mid_pass_resynchronises_the_ring(pairs):
    target, _ = pairs("mistral")
    want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
    runner = streamed_runner(target, source="ram", ring_size=2)
    layer = runner.hf_layers[1]

    def fail(*_args):
        raise RuntimeError("injected compute failure")

    handle = layer.input_layernorm.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            run_passes(runner)
        handle.remove()
        assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


def test_not_enough_host_memory_fails_at_load_with_bytes(pairs, monkeypatch):
    target, _ = pairs("llama")
    monkeypatch.setattr(offload_build, "host_memory_available", lambda: 1000)
    with pytest.raises(OffloadError, match=r"needs [\d,]+ bytes, [\d,]+ available"):
        streamed_runner(target, source="ram")


def test_disk_layout_mismatch_is_caught_at_load(pairs):
    target, _ = pairs("qwen2")
    model = checkpoint.load_model(target, torch.float32)
    model.model.layers[0].mlp.down_proj.weight.data.mul_(2)
    cfg = EngineConfig(model=ModelConfig(target=target), offload=OffloadConfig(enabled=True, source="disk"))
    with pytest.raises(OffloadError, match="mlp.down_proj.weight .* differs"):
        build_offloaded_runner(model, cfg, CPU)


@pytest.mark.parametrize("evict", [True, False])
def test_disk_fixups_turn_file_bytes_into_the_loaded_form(pairs, evict):
    """A loader that changes a tensor after reading it (gptqmodel's zero points) is matched by a fixup
    applied on every disk read; the layer check catches a missing one."""
    target, _ = pairs("llama")
    model = checkpoint.load_model(target, torch.float32)
    want_model = checkpoint.load_model(target, torch.float32)
    for layer in (model.model.layers, want_model.model.layers):
        for block in layer:
            block.input_layernorm.weight.data.add_(1.0)  # what a converting loader would have done
    want = run_passes(DecoderRunner(want_model))
    cfg = EngineConfig(
        model=ModelConfig(target=target),
        offload=OffloadConfig(enabled=True, source="disk", resident_layers=1, evict_page_cache=evict),
    )
    with pytest.raises(OffloadError, match="input_layernorm.weight .* differs"):
        build_offloaded_runner(model, cfg, CPU)  # no fixup: refused

    def add_one(tensor: torch.Tensor) -> None:
        tensor.add_(1.0)

    fixups = {idx: {"input_layernorm.weight": add_one} for idx in range(NUM_LAYERS)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptq, "disk_fixups", lambda config, layers: {i: fixups[i] for i in layers})
        model = checkpoint.load_model(target, torch.float32)
        for block in model.model.layers:
            block.input_layernorm.weight.data.add_(1.0)
        runner = build_offloaded_runner(model, cfg, CPU)
    try:
        for _ in range(2):  # the ring wraps: every read of every layer is fixed up, once
            assert_same_logits(run_passes(runner), want)
    finally:
        runner.layers.close()


class MixedLayer(torch.nn.Module):
    """A GPTQ-like layer: int32 packed words and fp16 scales."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("qweight", torch.randint(-(2**31), 2**31 - 1, (64, 256), generator=gen, dtype=torch.int32))
        self.register_buffer("qzeros", torch.randint(-(2**31), 2**31 - 1, (2, 256), generator=gen, dtype=torch.int32))
        self.register_buffer("scales", torch.randn(2, 2048, generator=gen).half())
        self.register_buffer("norm", torch.randn(300, generator=gen).half())


@pytest.mark.parametrize("evict", [True, False])
def test_disk_spans_of_a_mixed_dtype_layer_read_only_its_own_bytes(tmp_path, evict):
    """safetensors orders tensors by dtype, then name: each layer's int32 tensors, then (after every
    other layer's) its fp16 ones. A layer reads as one run per dtype, never the bytes between."""
    layers = {idx: MixedLayer(idx) for idx in range(3)}
    tensors = {f"model.layers.{idx}.{name}": t for idx, layer in layers.items() for name, t in layer_tensors(layer).items()}
    save_file(tensors, tmp_path / "model.safetensors")
    packed = {idx: layout_of(layer) for idx, layer in layers.items()}
    store = DiskStore(str(tmp_path), {idx: f"model.layers.{idx}." for idx in layers}, packed, evict=evict)
    try:
        for idx, layer in layers.items():
            own = sum(t.nbytes for t in layer_tensors(layer).values())
            assert len(store.spans[idx]) == 2  # one run of int32 tensors, one of fp16
            assert own <= sum(span.needed for span in store.spans[idx]) < own + 2 * 4096
            buffer = empty_buffer(store.layouts[idx].nbytes, CPU)
            store.read_into(idx, buffer)
            for entry in store.layouts[idx].entries:
                got = buffer[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
                assert torch.equal(got, layer_tensors(layer)[entry.name])
    finally:
        store.close()


def test_disk_fixup_for_an_unknown_tensor_is_refused(pairs):
    target, _ = pairs("llama")
    model = checkpoint.load_model(target, torch.float32)
    packed = {1: layout_of(model.model.layers[1])}
    with pytest.raises(ValueError, match="layer 1: fixups for tensors it does not have: nope.qzeros"):
        DiskStore(target, {1: "model.layers.1."}, packed, evict=False, fixups={1: {"nope.qzeros": print}})


@pytest.mark.parametrize("source", ["ram", "disk"])
def test_non_persistent_buffers_stay_on_the_device_and_are_not_streamed(pairs, source):
    """Constants a module builds for itself (not in the checkpoint) are not in the streamed layout;
    they move to the device once, with the resident weights."""
    target, _ = pairs("llama")
    model = checkpoint.load_model(target, torch.float32)
    for block in model.model.layers:
        block.mlp.register_buffer("shift_table", torch.arange(8, dtype=torch.int32), persistent=False)
    assert "mlp.shift_table" not in layer_tensors(model.model.layers[0])
    assert constant_buffers(model.model.layers[0]) == [("mlp", "shift_table")]
    cfg = EngineConfig(
        model=ModelConfig(target=target), offload=OffloadConfig(enabled=True, source=source, resident_layers=1)
    )
    runner = build_offloaded_runner(model, cfg, CPU)
    try:
        for idx in runner.layers.streamed:
            assert all("shift_table" not in e.name for e in runner.layers.layouts[idx].entries)
        before = [layer.mlp.shift_table for layer in runner.hf_layers]
        want = run_passes(DecoderRunner(checkpoint.load_model(target, torch.float32)))
        assert_same_logits(run_passes(runner), want)
        assert all(b is layer.mlp.shift_table for b, layer in zip(before, runner.hf_layers, strict=True))
    finally:
        runner.layers.close()


def test_planner_fits_layers_and_ring_in_gpu_memory():
    layer = 10**8  # bytes per layer, 0.1 GB
    plan = lambda **kw: plan_resident([layer] * 8, OffloadConfig(enabled=True, **kw))  # noqa: E731
    assert plan() == []
    assert plan(gpu_memory=0.8) == list(range(8))  # everything fits: no ring needed
    assert plan(gpu_memory=0.6) == [0, 2, 4, 6]  # 4 resident + 2 ring buffers
    assert plan(gpu_memory=0.6, ring_size=3) == [0, 2, 5]
    assert plan(resident_layers=2) == [0, 4]
    assert plan(resident_layers=20) == list(range(8))
    with pytest.raises(
        ConfigError, match="offload.gpu_memory: .* cannot hold 0 resident layers plus a ring of 2"
    ):
        plan(gpu_memory=0.15)
    with pytest.raises(ConfigError, match="cannot hold 5 resident"):
        plan(gpu_memory=0.6, resident_layers=5)
