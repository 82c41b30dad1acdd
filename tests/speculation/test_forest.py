"""Several SpecExec trees grown as one forest (engine.speculation.forest_growth): each tree is the search
specexec_growth.grow_tree makes of it alone (its own budget, depth, temperature, logit bias and stop
tokens), an engine step with several requests grows them so with fewer tensor ops a draft forward, its
output is transformers' greedy output, and a failing tree fails its request alone."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import engine.speculation.forest_growth as forest_module
import engine.speculation.specexec_growth as specexec_module
from bench.forest import run_together
from bench.overlap import slow_passes
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model.kv_cache import KVCache
from engine.runtime import Engine
from engine.speculation import batch as batch_module
from engine.speculation.drafter import Drafter, GrowLimits, run_growths
from engine.speculation.forest_growth import TreeRequest, extend_forest, grow_forest
from engine.speculation.overlap import extension
from engine.speculation.search_tree import SearchTree
from engine.speculation.specexec_growth import grow_tree
from engine.speculation.step import prefill
from engine.types import ConfigError, Request, SamplingParams, StructuredOutput
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.speculation import config_from_flags
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [90, 12], [130, 131, 132]]
LENGTH = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=7)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def references(pair) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    return [reference_greedy(model, prompt, LENGTH) for prompt in PROMPTS]


def load(pair, **spec) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(**{"budget": 24, "max_depth": 6, "max_expand": 8, "max_children": 4, **spec}),
        limits=LimitsConfig(max_context=256),
    ))


def greedy(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": LENGTH, "ignore_eos": True, **fields})


def drafters(engine: Engine) -> list[Drafter]:
    """A drafter per prompt over a fresh cache holding the prompt but its last token (the root)."""
    runner = engine.pair.draft
    out = []
    for prompt in PROMPTS:
        cache: KVCache = runner.new_cache(256)
        prefill(runner, cache, prompt[:-1])
        out.append(Drafter(runner, cache, engine.pair.target.vocab_size))
    return out


def test_each_tree_of_a_forest_is_its_own_search(pair) -> None:
    """Budgets 8-40, depths 2-6, greedy and sampled, a logit bias and a stop token: the forest's trees are
    grow_tree's, node for node (tokens, parents, scores, draft slots, proposals)."""
    engine = load(pair)
    spec = engine.config.speculation
    vocab = engine.pair.draft.vocab_size
    stop = torch.zeros(vocab, dtype=torch.bool)
    params = [greedy(), SamplingParams(temperature=0.7, seed=1), greedy(logit_bias={9: 4.0, 10: -3.0}), greedy()]
    limits = [GrowLimits(8, 2, stop), GrowLimits(40, 6, stop), GrowLimits(24, 5, stop), GrowLimits(16, 4, stop)]

    def grown_alone() -> list:  # one growth per tree, in lockstep (the same draft passes as the forest's)
        return run_growths([(d.runner, grow_tree(d, p[-1], [], q, spec, lim))
                            for d, p, q, lim in zip(drafters(engine), PROMPTS, params, limits, strict=True)])

    # the best child of tree 3's root becomes a stop token of its request: never expanded in either growth
    stopped = stop.clone()
    stopped[int(grown_alone()[3].token_ids[1])] = True
    limits[3] = GrowLimits(16, 4, stopped)
    alone = grown_alone()
    requests = [TreeRequest(d, q, lim, p[-1]) for d, p, q, lim in zip(drafters(engine), PROMPTS, params, limits,
                                                                         strict=True)]
    forest = run_growths([(engine.pair.draft, grow_forest(requests, spec, 2))])[0]
    assert not isinstance(forest, Exception)
    sizes = []
    for own, grown in zip(alone, forest, strict=True):
        tree = grown.tree()
        sizes.append(tree.num_nodes)
        for field in ("token_ids", "parents", "depths", "scores", "draft_slots", "child_lp", "child_ids", "ancestors"):
            assert torch.equal(getattr(tree, field), getattr(own, field)), field
    assert sizes == [9, 41, 25, 17]  # every budget filled, each its own
    assert int(alone[0].depths.max()) == 2 and int(alone[1].depths.max()) > 2
    assert not (alone[3].draft_slots[alone[3].token_ids == alone[3].token_ids[1]] >= 0).any()  # stop: unexpanded


def test_each_extension_of_a_forest_is_its_own(pair) -> None:
    """Overlap's extensions (twice each budget, their own depths), grown beside the pass as one forest: each is
    the extension overlap.extension grows of its tree alone, node for node, with its forward count."""
    engine = load(pair)
    spec = engine.config.speculation
    stop = torch.zeros(engine.pair.draft.vocab_size, dtype=torch.bool)
    params = [greedy(), SamplingParams(temperature=0.7, seed=1), greedy(logit_bias={9: 4.0}), greedy()]
    limits = [GrowLimits(8, 2, stop), GrowLimits(40, 6, stop), GrowLimits(24, 5, stop), GrowLimits(16, 4, stop)]
    wider = [GrowLimits(2 * lim.budget, lim.max_depth + 2, stop) for lim in limits]
    grown = []
    for alone in (True, False):
        ds = drafters(engine)
        trees = run_growths([(d.runner, grow_tree(d, p[-1], [], q, spec, lim))
                             for d, p, q, lim in zip(ds, PROMPTS, params, limits, strict=True)])
        if alone:
            grown.append(run_growths([(d.runner, extension(d, tree, q, spec, lim, None, lambda: False))
                                      for d, tree, q, lim in zip(ds, trees, params, wider, strict=True)]))
        else:
            requests = [TreeRequest(d, q, lim) for d, q, lim in zip(ds, params, wider, strict=True)]
            grown.append(run_growths([(engine.pair.draft, extend_forest(requests, trees, spec, lambda: False))])[0])
    for own, forest in zip(*grown, strict=True):
        assert own.extension_forwards == forest.extension_forwards > 0
        for field in ("token_ids", "parents", "depths", "scores", "paths", "draft_slots", "expanded", "child_lp"):
            got, want = getattr(forest, field), getattr(own, field)
            if field == "paths":  # the forest's rows have as many columns as its deepest limit allows
                got = got[:, : want.shape[1]]
            assert torch.equal(got, want), field
        assert (forest.paths[:, own.paths.shape[1]:] == -1).all()
    assert [tree.num_nodes for tree in grown[0]] == [17, 81, 49, 33]  # every extension budget filled


@pytest.fixture(scope="module")
def same_pair(tmp_path_factory) -> tuple[str, str]:
    """The target as its own draft: its extensions hold the accepted paths, so the next trees have seeds."""
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("same"), arch="llama", draft="same", seed=7)
    return str(target), str(draft)


def test_with_overlap_extensions_grow_as_one_forest_and_seed_the_next_trees(same_pair, monkeypatch) -> None:
    """Four requests, every target pass slowed to 0.1 s: their extensions grow beside it as one forest, the next
    steps' trees grow on from those seeds, and the output is the reference."""
    pair = same_pair
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    references = [reference_greedy(model, prompt, LENGTH) for prompt in PROMPTS]
    forests = []
    extension_forest = batch_module.extension_forest
    monkeypatch.setattr(batch_module, "extension_forest",
                        lambda parts, stop: forests.append(len(parts)) or extension_forest(parts, stop))
    engine = load(pair, overlap=True, budget=64)
    slow_passes(engine, 0.1)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"r{index}", prompt, greedy()))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    during = seeded = 0
    while engine.num_running:
        output = engine.step()
        during, seeded = during + output.stats.extension_forwards, seeded + output.stats.seeded_trees
        for delta in output.deltas:
            tokens[delta.request_id] += delta.token_ids
    assert list(tokens.values()) == references
    assert forests and max(forests) == 4 and during > 0 and seeded > 0


def test_an_engine_step_grows_its_trees_as_one_forest_with_fewer_ops(pair, references, monkeypatch) -> None:
    """Four requests: their trees grow as one forest (one selection, inputs and add-children a round for
    all), with at most 0.7x the tensor ops a draft pass of one growth per tree; the output is the reference."""
    grown = []
    forest_growth = batch_module.forest_growth
    monkeypatch.setattr(batch_module, "forest_growth", lambda parts: grown.append(len(parts)) or forest_growth(parts))
    results = {}
    for forest in (True, False):
        engine = load(pair, budget=64, max_expand=16, max_children=8, overlap=False, forest=forest)
        tokens, totals = run_together(engine, PROMPTS, greedy(), count_ops=True)
        assert tokens == references, forest
        results[forest] = totals.ops / totals.passes
    assert grown and max(grown) == 4
    print(f"growth's own ops a draft pass, forest on / off: {results[True]:.1f} / {results[False]:.1f}")
    assert results[True] <= 0.7 * results[False], results


def test_a_failing_tree_in_a_forest_fails_its_request_alone(pair, references, monkeypatch) -> None:
    """A request whose tree cannot grow (its logit bias raises, in the forest and on its own) fails; the
    forest's other trees grow again on their own and their requests finish exactly."""

    def apply_logit_bias(logits, bias):
        if bias is not None and 3 in bias:
            raise ValueError("this request's draft scores broke")
        return logits

    monkeypatch.setattr(forest_module, "apply_logit_bias", apply_logit_bias)
    monkeypatch.setattr(specexec_module, "apply_logit_bias", apply_logit_bias)
    engine = load(pair)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"r{index}", prompt, greedy(**({"logit_bias": {3: 0.0}} if index == 1 else {}))))
    tokens: dict[str, list[int]] = {}
    failures = {}
    while engine.num_running:
        output = engine.step()
        failures.update(output.failures)
        for delta in output.deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert list(failures) == ["r1"] and "draft scores broke" in str(failures["r1"])
    for index in (0, 2, 3):
        assert tokens[f"r{index}"] == references[index], index


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host_trees", [False, True])
def test_on_cuda_a_forest_emits_the_targets_greedy_tokens(pair, references, host_trees) -> None:
    """The forest on the GPU (and on the host beside a GPU draft), overlap on: four requests, the reference."""
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1], device="cuda", dtype="float32"),
        speculation=SpeculationConfig(budget=24, max_depth=6, overlap=True, host_trees=host_trees),
        limits=LimitsConfig(max_context=256)))
    tokens, totals = run_together(engine, PROMPTS, greedy(), count_ops=False)
    assert tokens == references and totals.passes > 0


@pytest.mark.parametrize("cap", [0, 1, 3])
def test_a_fresh_tree_beside_a_seeded_one_runs_at_most_fresh_forwards(pair, cap) -> None:
    """--fresh-forwards: a forest of a seeded tree (one grown from the same root before, its KV in the cache)
    and a fresh one: the fresh tree runs its catch-up and at most `cap` search forwards (0: its full search);
    with one forward (4 children of 4 children) it cannot fill its budget of 24."""
    engine = load(pair, fresh_forwards=cap)
    spec, draft = engine.config.speculation, engine.pair.draft
    stop = torch.zeros(draft.vocab_size, dtype=torch.bool)
    limits = GrowLimits(24, 6, stop)
    seeded, fresh = drafters(engine)[:2]
    seed = run_growths([(draft, grow_tree(seeded, PROMPTS[0][-1], [], greedy(), spec, limits))])[0]
    forwards_of: dict[int, int] = {id(seeded.cache): 0, id(fresh.cache): 0}
    forward_groups = draft.forward_groups

    def counted(groups):
        for segment in groups[0]:
            forwards_of[id(segment.cache)] += 1
        return forward_groups(groups)

    draft.forward_groups = counted
    requests = [TreeRequest(seeded, greedy(), limits, PROMPTS[0][-1], [], SearchTree.of(seed, 6)),
                TreeRequest(fresh, greedy(), limits, PROMPTS[1][-1])]
    trees = run_growths([(draft, grow_forest(requests, spec, 2))])[0]
    draft.forward_groups = forward_groups
    assert trees[0].num_nodes == 25 and trees[1].num_nodes == (21 if cap == 1 else 25)  # 1 + 4 + 4 x 4 nodes
    if cap:
        assert forwards_of[id(fresh.cache)] == 1 + cap  # the catch-up, then `cap` forwards
    else:
        assert forwards_of[id(fresh.cache)] > 1 + 3  # its full search
    alone = [TreeRequest(d, greedy(), limits, p[-1]) for d, p in zip(drafters(engine)[:2], PROMPTS, strict=False)]
    assert all(t.num_nodes == 25 for t in run_growths([(draft, grow_forest(alone, spec, 2))])[0])  # no seeds: no cap


def test_seeded_sampling_is_the_same_with_the_forest_on_and_off(pair) -> None:
    """Sample-and-match: a seeded request's text is a function of (seed, position) and the target alone, so four
    of them (temperatures 0.5-1.1, top-p, a logit bias) read the same whether their trees grew as a forest or not."""
    params = [SamplingParams(temperature=0.5 + 0.2 * i, top_p=0.9 if i % 2 else 1.0, seed=20 + i, max_tokens=LENGTH,
                             ignore_eos=True, **({"logit_bias": {9: 2.0}} if i == 3 else {})) for i in range(len(PROMPTS))]
    texts = []
    for forest in (True, False):
        engine = load(pair, forest=forest)
        for index, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            engine.add_request(Request(f"r{index}", prompt, p))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        while engine.num_running:
            for delta in engine.step().deltas:
                tokens[delta.request_id] += delta.token_ids
        texts.append(tokens)
    assert texts[0] == texts[1] and all(len(t) == LENGTH for t in texts[0].values())


def test_the_flag_reaches_the_config() -> None:
    config = config_from_flags  # the CLI's config of these flags
    assert config().speculation.forest is True and config().speculation.fresh_forwards == 0
    assert config("--fresh-forwards", "8").speculation.fresh_forwards == 8
    assert config("--forest", "off").speculation.forest is False
    with pytest.raises(ConfigError, match="--forest"):  # on or off only
        config("--forest", "auto")


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("source", [None, "ram", "disk"], ids=["resident", "ram", "disk"])
def test_a_forest_beside_a_grammar_request_is_exact_in_every_mode(pair, references, source, overlap) -> None:
    """Resident, streamed from RAM and from disk, overlap off and on: three greedy requests grow one forest
    (a grammar request's tree grows on its own in the same draft passes); theirs are transformers' greedy
    tokens, and the grammar request's text is the one it gets alone (no forest), within its regex."""
    offload = OffloadConfig(enabled=True, resident_layers=0, source=source) if source else OffloadConfig()
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]), offload=offload, limits=LimitsConfig(max_context=256),
        speculation=SpeculationConfig(budget=24, max_depth=6, max_expand=8, max_children=4, overlap=overlap)))
    structured = greedy(structured_output=StructuredOutput("regex", r"(ab|cd)+e?"))
    alone = engine.generate_ids(PROMPTS[3], structured)
    requests = [Request(f"r{i}", prompt, greedy()) for i, prompt in enumerate(PROMPTS[:3])]
    grown = []
    forest_growth = batch_module.forest_growth
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_module, "forest_growth", lambda parts: grown.append(len(parts)) or forest_growth(parts))
        for request in [*requests, Request("grammar", PROMPTS[3], structured)]:
            engine.add_request(request)
        tokens: dict[str, list[int]] = {request.request_id: [] for request in requests} | {"grammar": []}
        while engine.num_running:
            for delta in engine.step().deltas:
                tokens[delta.request_id] += delta.token_ids
    assert [tokens[f"r{i}"] for i in range(3)] == references[:3]
    assert tokens["grammar"] == alone and re.fullmatch(r"(ab|cd)+e?", engine.tokenizer.decode(alone, skip_special_tokens=True))
    assert grown and max(grown) == 3
