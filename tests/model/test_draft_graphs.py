"""The draft's tree forwards as CUDA graphs (engine.model.draft_graphs): the static pass they capture agrees
with the eager pass (logits and the keys and values it writes), takes only the passes it can, and a pair whose
draft runs it grows the same trees and emits the target alone's tokens. On a CPU the static pass runs
uncaptured; the `cuda` tests replay real graphs."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import draft_graphs
from engine.model.draft_graphs import KV_MIN, ROW_BUCKETS, DraftGraphs, graphable, kv_span, row_bucket
from engine.model.runner import DecoderRunner, Segment
from engine.offload.device import main_thread_stream, worker_stream
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.family_configs import FAMILIES
from tests.helpers.reference import plain_loop
from tests.helpers.think_model import make_think_pair
from tests.helpers.tiny_models import build_model, make_tiny_pair
from tests.speculation.test_reasoning_exactness import JSON_SPEC

PREFIX = 40


def prefilled(runner: DecoderRunner, count: int, capacity: int = 1500) -> list:
    """`count` caches of one block (as the KV pool's), each holding the same PREFIX committed tokens."""
    caches = runner.new_caches(count, capacity)
    for cache in caches:
        runner.prefill(torch.arange(3, 3 + PREFIX, device=runner.device), cache, 64)
        cache.length = PREFIX
    return caches


def tree_segment(runner: DecoderRunner, cache, rows: int, seed: int, last_only: bool = False) -> Segment:
    """`rows` tree nodes after the prefix and 3 earlier nodes: each sees the prefix, itself and about half the
    slots between; positions prefix + depth."""
    generator = torch.Generator().manual_seed(seed)
    start = PREFIX + 3
    allowed = torch.rand(rows, start + rows, generator=generator) < 0.5
    allowed[:, :PREFIX] = True
    allowed[:, start:] |= torch.eye(rows, dtype=torch.bool)
    positions = PREFIX + torch.randint(0, 4, (rows,), generator=generator)
    ids = torch.randint(3, runner.vocab_size, (rows,), generator=generator)
    device = runner.device
    logit_rows = torch.tensor([rows - 1], device=device) if last_only else None
    return Segment(ids.to(device), positions.to(device), cache, start, allowed.to(device), logit_rows)


def both_ways(runner: DecoderRunner, rows: list[int], layout: str, seed: int = 0, capacity: int = 1500):
    """Eager and static logits of one group (a segment per entry of `rows`, each over its own fresh cache,
    the first asking for its last row only), and the caches each way wrote."""
    graphs = DraftGraphs(runner, capture=False, layout=layout)
    out = []
    for static in (False, True):
        caches = prefilled(runner, len(rows), capacity)
        group = [tree_segment(runner, cache, n, seed + 7 * i, last_only=i == 0) for i, (cache, n) in
                 enumerate(zip(caches, rows, strict=True))]
        logits = graphs.forward(group) if static else runner.forward_groups([group])[0]
        out.append((logits, caches, group))
    return out, graphs


def test_the_attention_layout_by_environment(monkeypatch) -> None:
    assert draft_graphs.attention_layout() == "block"
    monkeypatch.setenv("SPECEXEC_DRAFT_GRAPH_ATTENTION", "segments")
    assert draft_graphs.attention_layout() == "segments"
    monkeypatch.setenv("SPECEXEC_DRAFT_GRAPH_ATTENTION", "rows")
    with pytest.raises(ValueError, match="block, segments"):
        draft_graphs.attention_layout()


def test_buckets_and_spans() -> None:
    assert [row_bucket(n) for n in (1, 8, 9, 64, 65, 128)] == [8, 8, 16, 64, 128, 128]
    assert row_bucket(ROW_BUCKETS[-1] + 1) is None
    assert kv_span(10, 4096) == KV_MIN and kv_span(KV_MIN + 1, 4096) == 2 * KV_MIN
    assert kv_span(100, 300) == 300  # a small cache: its whole capacity
    assert kv_span(301, 300) is None


@pytest.mark.parametrize("layout", draft_graphs.LAYOUTS)
@pytest.mark.parametrize("rows", [[1], [5], [8], [13], [5, 13, 2]])
def test_static_pass_agrees_with_the_eager_pass(rows, layout) -> None:
    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2))
    with torch.inference_mode():
        ((eager, eager_caches, group), (static, static_caches, _)), graphs = both_ways(runner, rows, layout)
        assert len(graphs.passes) == 1
        for a, b in zip(eager, static, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        for e, s, seg in zip(eager_caches, static_caches, group, strict=True):
            end = seg.start_slot + seg.input_ids.shape[0]  # slots the eager pass wrote (and the prefix)
            torch.testing.assert_close(s.keys[:, :, :end], e.keys[:, :, :end], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(s.values[:, :, :end], e.values[:, :, :end], rtol=1e-4, atol=1e-4)
            assert torch.isfinite(s.keys).all() and torch.isfinite(s.values).all()  # padded rows' slots too


GRAPHABLE = {"llama", "qwen2", "qwen3", "glm4", "olmo2", "granite", "smollm3", "ministral3"}  # dense, full attention


@pytest.mark.parametrize("family", FAMILIES)
def test_families_with_a_static_pass_agree_with_their_eager_pass(family) -> None:
    """Sliding windows, linear attention and mixtures of experts have none; the rest agree with eager."""
    runner = DecoderRunner(build_model(family, 320, seed=3, layers=2))
    assert graphable(runner) == (family in GRAPHABLE)
    if family in GRAPHABLE:
        with torch.inference_mode():
            ((eager, _, _), (static, _, _)), _ = both_ways(runner, [5, 13], "block")
        for a, b in zip(eager, static, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_quantized_layers_are_not_graphed() -> None:
    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2))
    assert graphable(runner)
    runner.hf_layers[1].mlp.register_buffer("packed", torch.zeros(4, 4, dtype=torch.int32))  # int4 nibbles, say
    assert not graphable(runner)


def test_passes_without_a_static_form_are_left_to_the_loop() -> None:
    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2))
    graphs = DraftGraphs(runner, capture=False)
    with torch.inference_mode():
        cache = prefilled(runner, 2)[0]
        too_many = tree_segment(runner, cache, ROW_BUCKETS[-1] + 1, 1)
        assert graphs.forward([too_many]) is None
        small = prefilled(runner, 1, PREFIX + 3 + 4)[0]  # no room for the padded rows
        assert graphs.forward([tree_segment(runner, small, 5, 1)]) is None
        apart = [tree_segment(runner, cache, 5, 1), tree_segment(runner, small, 2, 2)]  # caches of two blocks
        assert graphs.forward(apart) is None
        causal = tree_segment(runner, cache, 5, 1)
        causal.allowed = None
        assert graphs.forward([causal]) is None
    assert not graphs.passes


def test_masks_past_their_budget_and_long_spans_run_eagerly(monkeypatch) -> None:
    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2))
    graphs = DraftGraphs(runner, capture=False, layout="block")
    with torch.inference_mode():
        caches = prefilled(runner, 2)
        assert graphs.forward([tree_segment(runner, caches[0], 5, 1)]) is not None  # 8 rows x 1024 slots x 4 bytes
        assert graphs.mask_bytes == 8 * KV_MIN * 4
        monkeypatch.setattr(draft_graphs, "MASK_BYTES", graphs.mask_bytes + 4 * 8 * KV_MIN * 4 - 1)
        two = [tree_segment(runner, caches[0], 5, 1), tree_segment(runner, caches[1], 3, 2)]
        assert graphs.forward(two) is None  # its mask would pass the budget
        assert graphs.forward([tree_segment(runner, caches[0], 5, 3)]) is not None  # a shape it holds: on
        monkeypatch.setattr(draft_graphs, "MAX_SPAN", KV_MIN // 2)
        assert graphs.forward([tree_segment(runner, caches[0], 13, 1)]) is None  # a span past MAX_SPAN
        graphs.forget()
        assert not graphs.passes and graphs.mask_bytes == 0


def run_pair(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[int]], list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    emitted: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    per_step = []
    while engine.num_running:
        output = engine.step()
        per_step.append(output.stats.num_emitted if output.stats is not None else 0)
        for delta in output.deltas:
            emitted[delta.request_id] += delta.token_ids
    return emitted, per_step


@pytest.mark.parametrize("streams,overlap,layout", [(1, False, "block"), (2, True, "block"), (2, False, "segments")])
def test_a_draft_on_the_static_pass_grows_the_same_trees_and_emits_the_targets_tokens(
        tmp_path, monkeypatch, streams, overlap, layout) -> None:
    monkeypatch.setenv("SPECEXEC_DRAFT_GRAPH_ATTENTION", layout)
    target_path, draft_path = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=4)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]][:streams]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        engine = Engine.load(EngineConfig(
            model=ModelConfig(target=str(target_path), draft=str(draft_path)),
            speculation=SpeculationConfig(budget=16, max_depth=6, overlap=overlap, draft_graphs=graphs),
            limits=LimitsConfig(max_context=128)))
        assert (engine.pair.draft.graphs is not None) == graphs
        runs[graphs] = run_pair(engine, prompts, params)
        if graphs:
            assert engine.pair.draft.graphs.passes  # the draft's forwards took the static pass
    assert runs[True][1] == runs[False][1]  # tokens per step: the same trees, to rounding
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert runs[True][0][f"r{i}"] == plain_loop(target, prompt, params, 16)


def test_draft_graphs_default_off_on_a_cpu(tmp_path) -> None:
    target_path, draft_path = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=4)
    engine = Engine.load(EngineConfig(model=ModelConfig(target=str(target_path), draft=str(draft_path)),
                                      limits=LimitsConfig(max_context=128)))
    assert engine.config.speculation.draft_graphs is False and engine.pair.draft.graphs is None



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_the_eager_pass_for_new_inputs() -> None:
    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2).cuda())
    with torch.inference_mode():
        graphs = DraftGraphs(runner, capture=True)
        eager_caches, block = prefilled(runner, 3), prefilled(runner, 4)
        for seed in (0, 1, 2):  # one capture, then replays with other trees of the same shape
            # seed 2: other caches of the block, in another order: the same graph
            caches = [block[3], block[0], block[2]] if seed == 2 else block[:3]
            eager = runner.forward_groups([[tree_segment(runner, c, n, seed + i, i == 0)
                                            for i, (c, n) in enumerate(zip(eager_caches, (5, 13, 2), strict=True))]])[0]
            group = [tree_segment(runner, c, n, seed + i, i == 0) for i, (c, n) in enumerate(zip(caches, (5, 13, 2), strict=True))]
            static = graphs.forward(group)
            assert static is not None and not graphs.failed
            for a, b in zip(eager, static, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
        assert len(graphs.passes) == 1 and next(iter(graphs.passes.values())).graph is not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captures_beside_a_thread_queueing_cross_stream_copies() -> None:
    """An overlapped step captures new shapes while the layer loader's thread queues copies that wait on
    the pass's stream. More worker streams than torch's pool holds, so a capture on any priority-0 stream
    would share one with the thread (its copies would join the capture: cudaErrorStreamCaptureIsolation)."""
    device = torch.device("cuda")
    workers = [worker_stream(device) for _ in range(40)]  # the pool has 32 a priority: every one is a worker's
    assert all(main_thread_stream(device).cuda_stream not in {w.cuda_stream for w in workers} for _ in range(40))
    src, dst = torch.randn(1 << 20).pin_memory(), torch.empty(1 << 20, device=device)
    events, stop, errors = [torch.cuda.Event() for _ in workers], threading.Event(), []

    def copy_loop() -> None:  # what ring.py's loader does: wait for a release on another stream, copy, record
        try:
            while not stop.is_set():
                for i, stream in enumerate(workers):
                    stream.wait_event(events[i - 1])
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=True)
                    events[i].record(stream)
        except Exception as exc:  # torch.AcceleratorError: the thread's work joined a capture
            errors.append(exc)

    runner = DecoderRunner(build_model("llama", 320, seed=3, layers=2).cuda())
    thread = threading.Thread(target=copy_loop)
    with torch.inference_mode():
        graphs, block = DraftGraphs(runner, capture=True), prefilled(runner, 3)
        thread.start()
        try:
            for sizes in ((5,), (5, 13), (5, 13, 2), (30,), (30, 40)):  # a new shape each: a capture each
                group = [tree_segment(runner, c, n, 0, i == 0) for i, (c, n) in enumerate(zip(block, sizes, strict=False))]
                assert graphs.forward(group) is not None and not graphs.failed
        finally:
            stop.set()
            thread.join()
        torch.cuda.synchronize()
    assert not errors and len(graphs.passes) == 5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graphed_draft_on_cuda_emits_the_targets_tokens(tmp_path) -> None:
    target_path, draft_path = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=4)
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(target_path), draft=str(draft_path), device="cuda", dtype="float32"),
        speculation=SpeculationConfig(budget=16, max_depth=6), limits=LimitsConfig(max_context=128)))
    assert engine.pair.draft.graphs is not None  # auto: on for CUDA
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    emitted, _ = run_pair(engine, prompts, params)
    assert engine.pair.draft.graphs.passes and not engine.pair.draft.graphs.failed
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert emitted[f"r{i}"] == plain_loop(target, prompt, params, 16)


@pytest.mark.parametrize("source", [None, "ram", "disk"])
def test_a_draft_on_the_static_pass_under_a_grammar_equals_autoregressive(tmp_path, source) -> None:
    """JSON under a schema on the thinking bigram pair, the target resident or streamed from RAM or disk:
    speculative greedy with the draft on the static pass equals autoregressive greedy under the grammar."""
    target, draft = make_think_pair(tmp_path)
    offload = OffloadConfig() if source is None else OffloadConfig(enabled=True, resident_layers=1, source=source)
    base = Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)), offload=offload,
                                    speculation=SpeculationConfig(budget=16, draft_graphs=True),
                                    limits=LimitsConfig(max_context=256)))
    prompt = base.tokenizer.encode("Pick a color.", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_output=JSON_SPEC)

    def generate(engine: Engine) -> list[int]:
        return [t for d in engine.generate(Request("r", prompt, params)) for t in d.token_ids]

    speculative = generate(base)
    assert base.pair.draft.graphs is not None and base.pair.draft.graphs.passes  # the static pass ran
    assert speculative == generate(base.with_speculation(SpeculationConfig(method="autoregressive")))
