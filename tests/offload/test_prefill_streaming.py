"""Layer-major prefill: a streamed target brings each streamed layer to the device once per prompt,
however many chunks it has, as exactly one ring pass; the KV it writes equals the chunk-by-chunk
path's, and the next pass's logits equal a plain transformers forward of each node's path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import checkpoint
from engine.model.hybrid_cache import HybridCache
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner
from engine.offload.ring import LayerStreamer
from engine.speculation import step
from engine.speculation.tree import causal_mask, prefix_tree_mask
from tests.helpers.offload_passes import streamed_runner
from tests.helpers.tiny_models import make_tiny_pair
from tests.helpers.trees import ancestors_and_depths, path_of

ARCHS = ["llama", "mistral", "qwen2", "mixtral", "qwen3_5_text", "qwen3_next"]  # hybrids: chunks through the tree
# path (explicit masks, their commits applied lazily) against transformers' chunked rule (layer-major prefill)
NUM_LAYERS = 4
CHUNK = 16
PROMPT_LEN = 5 * CHUNK + 7  # six chunks, the last one short
PARENTS = [-1, 0, 0, 1, 2, 4]  # tree node i's parent
TOL = 1e-4


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    folders: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in folders:
            folder = tmp_path_factory.mktemp(arch)
            folders[arch] = str(make_tiny_pair(folder, arch=arch, seed=4, layers=NUM_LAYERS)[0])
        return folders[arch]

    return get


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(step, "PREFILL_CHUNK", CHUNK)


def prompt_ids(vocab_size: int, num_tokens: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(num_tokens)
    return torch.randint(3, vocab_size, (num_tokens,), generator=gen).tolist()


def chunked_prefill(runner: DecoderRunner, cache: KVCache, token_ids: list[int]) -> None:
    """The chunk-by-chunk path: one full forward (every layer) per CHUNK tokens."""
    for begin in range(0, len(token_ids), CHUNK):
        chunk = torch.tensor(token_ids[begin : begin + CHUNK])
        start = cache.length
        positions = torch.arange(start, start + chunk.shape[0])
        no_rows = torch.zeros(0, dtype=torch.long)
        runner.forward(chunk, positions, cache, start, causal_mask(chunk.shape[0], start, cache.device), no_rows)
        cache.length = start + chunk.shape[0]


def assert_same_kv(got: KVCache, want: KVCache, length: int) -> None:
    """The same KV, and for a hybrid (KV of its attention layers) the same linear-attention states. A hybrid's
    two paths are two algorithms (transformers' chunked rule, the engine's tree form over a chain): equal to
    fp32 summation order (amplified through the layers of these spiky tiny models), relative to the scale."""
    assert got.length == want.length == length
    for name in ("keys", "values"):
        got_kv, want_kv = getattr(got, name)[:, :, :length], getattr(want, name)[:, :, :length]
        if isinstance(got, HybridCache):
            assert float((got_kv - want_kv).abs().max()) <= 1e-4 * float(want_kv.abs().max()), name
        else:
            torch.testing.assert_close(got_kv, want_kv, atol=1e-6, rtol=1e-6)
    assert torch.equal(got.positions[:length], torch.arange(length))
    if isinstance(got, HybridCache) and isinstance(want, HybridCache):
        want.settle()
        assert got.linear.settled == want.linear.settled == [length] * len(got.linear.settled)
        for name in ("state", "window"):
            got_state, want_state = getattr(got.linear, name), getattr(want.linear, name)
            assert float((got_state - want_state).abs().max()) <= 1e-4 * float(want_state.abs().max()), name


def tree_pass(runner: DecoderRunner, cache: KVCache, tree_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a tree (PARENTS) scored on top of the committed prefix: [n, vocab]."""
    ancestors, depths = ancestors_and_depths(PARENTS)
    start = cache.length
    return runner.forward(tree_ids, start + depths, cache, start, prefix_tree_mask(ancestors, start))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("source", ["ram", "disk"])
def test_prefill_loads_each_streamed_layer_once(targets, source, resident):
    target = targets("llama")
    runner = streamed_runner(target, source=source, resident_layers=resident, ring_size=2)
    streamer = runner.layers
    assert isinstance(streamer, LayerStreamer)
    events: list[tuple[str, int]] = []
    streamer.instrument(lambda event, idx, slot: events.append((event, idx)))
    try:
        cache = runner.new_cache(PROMPT_LEN + 16)
        step.prefill(runner, cache, prompt_ids(runner.vocab_size))
        streamer.wait_prefetched()  # the ring refilled with the next pass's first layers
        loads = [idx for event, idx in events if event == "load_start"]
        computes = [idx for event, idx in events if event == "compute_start"]
        assert computes == streamer.streamed  # one pass: every streamed layer once, in order
        assert loads == streamer.streamed + streamer.streamed[: streamer.ring_size]
        assert cache.length == PROMPT_LEN
    finally:
        streamer.close()


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_prefill_equals_chunked_and_transformers(targets, arch):
    target = targets(arch)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    token_ids = prompt_ids(model.config.vocab_size)
    resident = DecoderRunner(checkpoint.load_model(target, torch.float32))
    want = resident.new_cache(PROMPT_LEN + 16)
    chunked_prefill(resident, want, token_ids)
    runner = streamed_runner(target, source="ram", resident_layers=1, ring_size=2)
    try:
        got = runner.new_cache(PROMPT_LEN + 16)
        step.prefill(runner, got, token_ids)
        assert_same_kv(got, want, PROMPT_LEN)
        tree_ids = torch.tensor(prompt_ids(model.config.vocab_size, len(PARENTS)))
        logits = tree_pass(runner, got, tree_ids)  # the ring's next pass
    finally:
        runner.layers.close()
    with torch.no_grad():
        for node in range(len(PARENTS)):
            path = torch.tensor(token_ids + tree_ids[path_of(PARENTS, node)].tolist())
            want_logits = model(path[None]).logits[0, -1]
            if isinstance(got, HybridCache):  # transformers chunks the path by 64, the engine's prefill by CHUNK
                assert float((logits[node] - want_logits).abs().max()) <= TOL * float(want_logits.abs().max())
            else:
                torch.testing.assert_close(logits[node], want_logits, atol=TOL, rtol=TOL)


@pytest.mark.usefixtures("small_chunks")
def test_resident_prefill_in_parts_equals_chunked(targets):
    """Prefill after a committed prefix, with a prompt shorter than one chunk and an empty one."""
    runner = DecoderRunner(checkpoint.load_model(targets("qwen2"), torch.float32))
    token_ids = prompt_ids(runner.vocab_size)
    want, got = runner.new_cache(PROMPT_LEN), runner.new_cache(PROMPT_LEN)
    for begin, end in ((0, 5), (5, 5), (5, 40), (40, PROMPT_LEN)):
        chunked_prefill(runner, want, token_ids[begin:end])
        step.prefill(runner, got, token_ids[begin:end])
        assert got.length == end
    assert_same_kv(got, want, PROMPT_LEN)


def test_real_chunk_length_prefill_streams_once(targets):
    """The engine's own chunk length: a prompt of three chunks and a bit, from disk."""
    runner = streamed_runner(targets("llama"), source="disk", resident_layers=0, ring_size=3)
    streamer = runner.layers
    computes: list[int] = []
    streamer.instrument(lambda event, idx, slot: computes.append(idx) if event == "compute_start" else None)
    try:
        num_tokens = 3 * step.PREFILL_CHUNK + 40
        cache = runner.new_cache(num_tokens)
        step.prefill(runner, cache, prompt_ids(runner.vocab_size, num_tokens))
        assert computes == streamer.streamed
    finally:
        streamer.close()
