"""Overlap: the draft grows trees on while the target scores them, and seeds the next tree.

Output is unchanged: greedy equals transformers' greedy generate, and seeded sampling is the same
with overlap on and off, alone and batched, resident and streamed from RAM and disk. Seeds are used,
and a seed's draft KV (moved after the committed prefix) is what the draft computes for those paths."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.overlap import slow_passes
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation.drafter import Drafter, GrowLimits
from engine.speculation.search_tree import SearchTree
from engine.speculation.specexec_growth import reoffer
from engine.speculation.tree import Tree, find_node
from engine.types import Request, SamplingParams
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [90, 12], [130, 131, 132, 133, 134, 135]]
LENGTHS = [30, 18, 40, 24]
MODES = {"resident": {}, "ram": {"source": "ram"}, "disk": {"source": "disk"}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=11)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def same_pair(tmp_path_factory) -> tuple[str, str]:
    """A draft equal to the target: deep acceptance, so the bonus token's node is usually grown."""
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("same"), arch="llama", draft="same", seed=11)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def references(pair) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    return [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]


def load(pair, overlap: bool, mode: str = "resident", budget: int = 16) -> Engine:
    offload = OffloadConfig(enabled=True, resident_layers=0, **MODES[mode]) if mode != "resident" else OffloadConfig()
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=budget, max_depth=6, overlap=overlap),
        offload=offload,
        limits=LimitsConfig(max_context=256),
    ))


def slow_target(engine: Engine, monkeypatch, seconds: float = 0.05) -> None:
    """Every target pass takes at least `seconds` (a streamed pass's copy time), so the draft has time
    to grow the trees on (bench overlap's --slow-pass-ms)."""
    monkeypatch.setattr(engine.pair.target, "forward_groups", engine.pair.target.forward_groups)  # restored after
    slow_passes(engine, seconds)


def run_together(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.num_running:
        step = engine.step()
        assert not step.failures
        for delta in step.deltas:
            out[delta.request_id] += delta.token_ids
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_with_overlap_equals_the_reference(pair, references, mode, monkeypatch) -> None:
    engine = load(pair, overlap=True, mode=mode)
    slow_target(engine, monkeypatch)
    alone = [engine.generate_ids(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    together = run_together(engine, [Request(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))])
    assert alone == references
    assert [together[f"r{i}"] for i in range(len(PROMPTS))] == references
    engine.close()


def test_seeded_sampling_is_the_same_with_overlap_on_and_off(pair, monkeypatch) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, presence_penalty=0.5, seed=100 + i,
                             max_tokens=24, ignore_eos=True) for i in range(3)]
    outputs = []
    for overlap in (False, True):
        engine = load(pair, overlap=overlap)
        slow_target(engine, monkeypatch)
        alone = [engine.generate_ids(PROMPTS[i], params[i]) for i in range(3)]
        together = run_together(engine, [Request(f"s{i}", PROMPTS[i], params[i]) for i in range(3)])
        assert [together[f"s{i}"] for i in range(3)] == alone
        outputs.append(alone)
    assert outputs[0] == outputs[1]


def test_seeds_are_grown_during_the_pass_and_used(same_pair, monkeypatch) -> None:
    engine = load(same_pair, overlap=True, budget=32)
    slow_target(engine, monkeypatch, seconds=0.2)
    adopted: list[int] = []
    adopt = Drafter.adopt

    def spy(self, tree):
        adopted.append(tree.extension_forwards)
        return adopt(self, tree)

    monkeypatch.setattr(Drafter, "adopt", spy)
    deltas = list(engine.generate(Request("r", PROMPTS[2], greedy(LENGTHS[2]))))
    model = AutoModelForCausalLM.from_pretrained(same_pair[0], dtype=torch.float32)
    assert [t for d in deltas for t in d.token_ids] == reference_greedy(model, PROMPTS[2], LENGTHS[2])
    assert len(adopted) >= len(deltas) // 2  # most steps start from a seed
    assert max(adopted) >= 1  # which the draft grew while the target was busy
    assert sum(d.stats.overlap_seconds for d in deltas) > 0


def test_a_larger_extension_grows_more_during_the_pass_and_less_before_it(pair, references, monkeypatch) -> None:
    """--extension-factor: with a slow pass, extensions of 8x the budget run more draft forwards beside the pass
    than 2x ones and leave fewer before the next one (richer seeds); the output is the target's either way."""
    forwards = {}
    for factor in (2, 8):
        engine = Engine.load(EngineConfig(
            model=ModelConfig(target=pair[0], draft=pair[1]), limits=LimitsConfig(max_context=256),
            speculation=SpeculationConfig(budget=8, max_depth=12, overlap=True, extension_factor=factor)))
        assert engine.config.speculation.extension_budget(8) == 8 * factor
        slow_target(engine, monkeypatch, seconds=0.1)
        engine.add_request(Request("r", PROMPTS[2], greedy(LENGTHS[2])))
        emitted, before, during, seeded, steps = [], 0, 0, 0, 0
        while engine.num_running:
            output = engine.step()
            emitted += [t for d in output.deltas for t in d.token_ids]
            before, during = before + output.stats.draft_forwards, during + output.stats.extension_forwards
            seeded, steps = seeded + output.stats.seeded_trees, steps + 1
        assert emitted == references[2]
        assert 1 <= seeded < steps  # the first tree grows afresh, later ones (most) from their seeds
        forwards[factor] = (before, during)
        engine.close()
    assert forwards[8][1] > forwards[2][1] and forwards[8][0] < forwards[2][0]


@pytest.mark.parametrize("forest", [True, False])
def test_an_extension_runs_as_many_forwards_as_its_own_depth_limit_allows(pair, references, monkeypatch,
                                                                          forest) -> None:
    """A long pass: an extension (nodes to twice --max-depth) may run up to that many draft forwards, not
    --max-depth (a copy-bound pass leaves the draft idle once it stops); the output is the target's."""
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]), limits=LimitsConfig(max_context=256),
        speculation=SpeculationConfig(budget=8, max_depth=4, max_expand=1, overlap=True, extension_factor=8,
                                      forest=forest)))
    slow_target(engine, monkeypatch, seconds=0.3)
    engine.add_request(Request("r", PROMPTS[2], greedy(LENGTHS[2])))
    emitted, during = [], []
    while engine.num_running:
        output = engine.step()
        emitted += [t for d in output.deltas for t in d.token_ids]
        during.append(output.stats.extension_forwards)
    engine.close()
    assert emitted == references[2]
    assert 4 < max(during) <= 8  # past --max-depth, within the extension's own depth limit


def test_a_seeds_draft_kv_is_what_the_draft_computes_for_its_paths(same_pair, monkeypatch) -> None:
    """After adopt, each expanded node's draft KV (layer 0 keys) equals a plain causal forward of the
    prefix and the node's path through the draft."""
    engine = load(same_pair, overlap=True, budget=32)
    slow_target(engine, monkeypatch, seconds=0.2)
    draft_model = AutoModelForCausalLM.from_pretrained(same_pair[1], dtype=torch.float32).eval()
    checked: list[int] = []
    adopt = Drafter.adopt

    def check(self, tree):
        tree = adopt(self, tree)
        prefix_len = self.cache.length
        committed = self.cache.keys[0, :, :prefix_len]  # [kv_heads, prefix, head_dim]
        slots, tokens, ancestors = tree.draft_slots.tolist(), tree.token_ids, tree.tree().ancestors  # a SearchTree
        for node in [n for n, s in enumerate(slots) if s >= 0][:6]:
            path = tokens[ancestors[node].nonzero().squeeze(1)].tolist()
            ids = torch.tensor([context[:prefix_len] + path])
            with torch.no_grad():
                keys = draft_model(ids, use_cache=True).past_key_values.layers[0].keys[0]  # [kv_heads, len, dim]
            assert torch.allclose(keys[:, :prefix_len], committed, atol=1e-5)
            assert torch.allclose(keys[:, -1], self.cache.keys[0, :, slots[node]], atol=1e-5), node
            checked.append(node)
        return tree

    monkeypatch.setattr(Drafter, "adopt", check)
    context = list(PROMPTS[2])
    engine.add_request(Request("r", PROMPTS[2], greedy(LENGTHS[2])))
    while engine.num_running:
        for delta in engine.step().deltas:
            context += delta.token_ids
    assert len(checked) >= 6


def hand_tree() -> Tree:
    """root(9) -> a(1) [-> c(3) -> e(5)], b(2) [-> d(4)], scores by depth; a, c and the root expanded."""
    parents = [-1, 0, 0, 1, 2, 3]
    ancestors = torch.eye(6, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    child_ids = torch.zeros(6, 3, dtype=torch.long)
    child_lp = torch.full((6, 3), float("-inf"))
    child_ids[0], child_lp[0] = torch.tensor([1, 2, 7]), torch.tensor([-0.1, -1.0, -3.0])  # 7 was dropped
    child_ids[1], child_lp[1] = torch.tensor([3, 8, 6]), torch.tensor([-0.2, -2.0, -4.0])  # 8 and 6 dropped
    child_ids[3], child_lp[3] = torch.tensor([5, 2, 1]), torch.tensor([-0.3, -1.5, -2.5])
    return Tree(
        token_ids=torch.tensor([9, 1, 2, 3, 4, 5]), parents=torch.tensor(parents),
        depths=torch.tensor([0, 1, 1, 2, 2, 3]), scores=torch.tensor([0.0, -0.1, -1.0, -0.3, -1.5, -0.6]),
        ancestors=ancestors, draft_slots=torch.tensor([10, 11, -1, 12, -1, -1]), child_lp=child_lp, child_ids=child_ids,
    )


def test_find_node_subtree_and_trim() -> None:
    tree = hand_tree()
    assert find_node(tree, [1, 3]) == 3 and find_node(tree, [2]) == 2 and find_node(tree, [1, 4]) is None
    search = SearchTree.of(tree, max_depth=4)
    sub = search.subtree(1, depth=1)  # a, c, e re-rooted at a
    assert sub.token_ids.tolist() == [1, 3, 5] and sub.parents.tolist() == [-1, 0, 1]
    assert sub.depths.tolist() == [0, 1, 2] and torch.allclose(sub.scores, torch.tensor([0.0, -0.2, -0.5]))
    assert sub.draft_slots.tolist() == [11, 12, -1] and sub.expanded.tolist() == [True, True, False]
    assert sub.paths.tolist() == [[0, -1, -1, -1, -1], [0, 1, -1, -1, -1], [0, 1, 2, -1, -1]]
    assert sub.tree().ancestors.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert search.subtree(3, depth=2).token_ids.tolist() == [3, 5]
    assert search.trim(4, 1).token_ids.tolist() == [9, 1, 2]
    assert search.trim(3, 3).token_ids.tolist() == [9, 1, 2]


def test_reoffer_adds_dropped_proposals_once() -> None:
    spec = SpeculationConfig()
    limits = GrowLimits(budget=20, max_depth=5, stop_mask=torch.zeros(10, dtype=torch.bool))
    tree = reoffer(SearchTree.of(hand_tree(), limits.max_depth), spec, limits).tree()
    paths = {tuple(tree.token_ids[tree.ancestors[n].nonzero().squeeze(1)].tolist()) for n in range(tree.num_nodes)}
    assert paths >= {(9, 7), (9, 1, 8), (9, 1, 6), (9, 1, 3, 2), (9, 1, 3, 1)}  # dropped proposals are back
    assert tree.num_nodes == 6 + 5  # and nothing twice: siblings stay distinct
    assert (tree.scores[1:] <= tree.scores[tree.parents[1:]]).all()


def passes_running() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name == "target-pass" and thread.is_alive()]


@pytest.mark.parametrize("where", ["pass", "extension"])
def test_a_failure_beside_the_pass_fails_the_step_alone_and_leaves_nothing_running(pair, references, where,
                                                                                  monkeypatch) -> None:
    """A failure raised in the overlapped pass's own thread, or in a draft forward of the extension that
    runs beside it, fails that step's request; no pass is left running, and the next request is exact."""
    engine = load(pair, overlap=True)
    target, draft = engine.pair.target, engine.pair.draft
    in_pass = threading.Event()
    target_forward, draft_forward = target.forward_groups, draft.forward_groups
    failures = [1]

    def failing_target(groups):
        if threading.current_thread().name == "target-pass":
            in_pass.set()
            time.sleep(0.05)
            in_pass.clear()
            if where == "pass" and failures[0]:
                failures[0] -= 1
                raise ValueError("the pass failed")
        return target_forward(groups)

    def failing_draft(groups):
        if where == "extension" and in_pass.is_set() and failures[0]:
            failures[0] -= 1
            raise ValueError("an extension forward failed")
        return draft_forward(groups)

    monkeypatch.setattr(target, "forward_groups", failing_target)
    monkeypatch.setattr(draft, "forward_groups", failing_draft)
    engine.add_request(Request("bad", PROMPTS[0], greedy(LENGTHS[0])))
    failed = []
    while engine.num_running:
        failed += engine.step().failures
    assert [request_id for request_id, _ in failed] == ["bad"] and failures == [0]
    assert passes_running() == []
    assert engine.generate_ids(PROMPTS[1], greedy(LENGTHS[1])) == references[1]
    engine.close()


def cuda_spin(engine: Engine, seconds: float) -> None:
    """Every target layer first spins on the GPU for `seconds` (a kernel queued on the pass's stream,
    not a host sleep): a slow, copy-bound-like pass the host does not wait for."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(seconds * 10_000_000 / (start.elapsed_time(end) / 1e3))
    for layer in engine.pair.target.hf_layers:
        layer.register_forward_pre_hook(lambda module, args: torch.cuda._sleep(cycles))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_grows_the_draft_during_a_gpu_bound_pass(same_pair) -> None:
    """On CUDA the pass runs on its own stream and the draft on another: with each target layer spinning
    on the GPU, every step's extension runs draft forwards while the pass is still running (before the
    fix, the draft's host syncs waited on the pass's stream: zero forwards), and the output is exact."""
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=same_pair[0], draft=same_pair[1], device="cuda", dtype="float32"),
        speculation=SpeculationConfig(budget=16, max_depth=6),  # overlap auto: on for CUDA
        limits=LimitsConfig(max_context=256),
    ))
    assert engine.config.speculation.overlap is True and engine.pass_streams is not None
    cuda_spin(engine, 0.02)
    deltas = list(engine.generate(Request("r", PROMPTS[2], greedy(LENGTHS[2]))))
    model = AutoModelForCausalLM.from_pretrained(same_pair[0], dtype=torch.float32)
    assert [t for d in deltas for t in d.token_ids] == reference_greedy(model, PROMPTS[2], LENGTHS[2])
    grown = [d.stats.extension_forwards for d in deltas if d.stats is not None]
    assert grown and min(grown[:-1]) >= 1, grown  # the last step may have too few tokens left to extend
    engine.close()


def test_extensions_allocate_on_the_draft_stream_and_hand_their_trees_over(same_pair, monkeypatch) -> None:
    """CUDA's contract, checked where it is stated (a CPU has no streams to race): an extension's set-up runs
    on the draft stream, like its growth, so nothing it allocates comes from the main stream's pool while the
    draft stream reads it; and every tensor of its grown trees is marked used by the main stream at hand-over
    (else an allocator that waits for a block's own stream only, as expandable segments do, may unmap it)."""
    from engine.speculation import batch

    engine = load(same_pair, overlap=True, budget=32)
    slow_target(engine, monkeypatch, seconds=0.05)
    streams, on_draft, handed, set_up = engine.pass_streams, [False], [], []
    enter = type(streams).on_draft

    class Recording(type(streams)):  # type: ignore[misc]
        def on_draft(self):
            on_draft[0] = True
            return enter(self)

        def hand_over(self, tensors):
            handed.extend(tensors)

    streams.__class__ = Recording
    plan = batch.extension_growths

    def spy(*args):
        set_up.append(on_draft[0])
        return plan(*args)

    monkeypatch.setattr(batch, "extension_growths", spy)
    grown: list[SearchTree] = []
    score = batch.score_trees

    def scored(*args):
        result = score(*args)
        grown.extend(tree for tree in result[1] if tree is not None)
        return result

    monkeypatch.setattr(batch, "score_trees", scored)
    deltas = list(engine.generate(Request("r", PROMPTS[2], greedy(LENGTHS[2]))))
    assert deltas and set_up and all(set_up)
    assert grown, "no extension grew"
    handed_ids = {id(t) for t in handed}
    assert all(id(t) in handed_ids for tree in grown for t in tree.tensors())
    engine.close()
