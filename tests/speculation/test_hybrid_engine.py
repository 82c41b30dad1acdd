"""Hybrid linear-attention targets (Qwen3-Next, Qwen3.5) through the whole engine are the target alone.

Reference: a plain loop over transformers' forward (tests/helpers/reference.plain_loop: greedy argmax,
or the engine's documented seeded draw), sharing no code with the engine. Checked, greedy and seeded
sampling: a hybrid draft (the target plus noise) and a standard one (a Llama of the same vocabulary),
and a Llama target with a hybrid draft; the target resident, streamed from RAM and from disk; requests
batched, joining while others decode (their prompts written in slices beside the trees), cancelled
mid-request, n choices of one prompt at once; the prefix cache (a state is reused whole: a conversation's
next turn hits, a partial share does not). Sampled (unseeded) output follows the target's law
(chi-square, slow)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams, TokenDelta
from tests.helpers.family_configs import HYBRID_FAMILIES
from tests.helpers.reference import plain_loop
from tests.helpers.speculation import NAMED_TREES, fix_unseeded_entropy
from tests.helpers.tiny_models import build_model, build_tokenizer, make_tiny_pair, save_checkpoint

NUM_TOKENS = 12
_gen = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 300, (n,), generator=_gen).tolist() for n in (9, 23, 5, 40)]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=17, max_tokens=NUM_TOKENS, ignore_eos=True),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(target family, draft kind) -> (target, draft) folders: draft 'noisy' (the target plus noise, hybrid
    itself), 'llama' (a standard model), or target 'llama' with a 'hybrid' (qwen3_5_text) draft."""
    built: dict[tuple[str, str], tuple[str, str]] = {}

    def get(family: str, draft: str) -> tuple[str, str]:
        if (family, draft) not in built:
            folder = tmp_path_factory.mktemp(f"{family}-{draft}")
            if draft == "hybrid":
                tokenizer = build_tokenizer()
                target = build_model(family, len(tokenizer), seed=5, eos_token_id=tokenizer.eos_token_id, layers=4)
                small = build_model("qwen3_5_text", len(tokenizer), seed=6, eos_token_id=tokenizer.eos_token_id,
                                    layers=4)
                built[(family, draft)] = (str(save_checkpoint(target, tokenizer, folder / "target")),
                                          str(save_checkpoint(small, tokenizer, folder / "draft")))
            else:
                kind = "noisy" if draft == "noisy" else "random"
                built[(family, draft)] = tuple(map(str, make_tiny_pair(folder, arch=family, draft=kind, seed=5,
                                                                        layers=4)))
        return built[(family, draft)]

    return get


@pytest.fixture(scope="module")
def reference(pairs):
    memo: dict[tuple, list[int]] = {}
    models: dict[str, torch.nn.Module] = {}

    def get(target: str, prompt: list[int], kind: str) -> list[int]:
        key = (target, tuple(prompt), kind)
        if key not in memo:
            if target not in models:
                models[target] = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            memo[key] = plain_loop(models[target], prompt, PARAMS[kind], NUM_TOKENS)
        return memo[key]

    return get


def load(pair: tuple[str, str], mode: str = "resident", overlap: bool = False, **limits) -> Engine:
    offload = OffloadConfig() if mode == "resident" else OffloadConfig(enabled=True, source=mode, resident_layers=1)
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=16, max_depth=6, overlap=overlap),
        offload=offload,
        limits=LimitsConfig(max_context=128, **limits),
    ))


def run(engine: Engine, prompt: list[int], kind: str) -> tuple[list[int], int, int]:
    """(tokens, cached_tokens, target passes) of one request alone."""
    deltas = list(engine.generate(Request("r", prompt, PARAMS[kind])))
    totals = deltas[-1].totals
    return [t for d in deltas for t in d.token_ids], totals.cached_tokens, totals.target_passes


ALONE = [pytest.param(family, draft, mode, marks=() if (draft, mode) in {("noisy", "resident"), ("llama", "disk")}
                      else pytest.mark.slow)
         for family in HYBRID_FAMILIES for draft in ("noisy", "llama") for mode in ("resident", "ram", "disk")]


@pytest.mark.parametrize(("family", "draft", "mode"), ALONE)
def test_greedy_and_seeded_requests_alone_are_the_target_alone(pairs, reference, family, draft, mode):
    pair = pairs(family, draft)
    with load(pair, mode) as engine:
        for kind in PARAMS:
            got, _, passes = run(engine, PROMPTS[1], kind)
            assert got == reference(pair[0], PROMPTS[1], kind), kind
    assert passes <= NUM_TOKENS


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_with_overlap_the_drafts_seeds_keep_the_output(pairs, reference, family):
    """Overlap: the hybrid draft grows each tree on during the target's pass (from its pending rows), and
    the part under the accepted path's end seeds the next tree (moved after the commit)."""
    pair = pairs(family, "noisy")
    forwards = 0
    with load(pair, overlap=True) as engine:
        for kind in PARAMS:
            deltas = list(engine.generate(Request("r", PROMPTS[1], PARAMS[kind])))
            assert [t for d in deltas for t in d.token_ids] == reference(pair[0], PROMPTS[1], kind), kind
            forwards += sum(d.stats.extension_forwards for d in deltas if d.stats is not None)
    assert forwards > 0  # the extensions ran


def test_a_standard_target_with_a_hybrid_draft_is_the_target_alone(pairs, reference):
    pair = pairs("llama", "hybrid")
    with load(pair) as engine:
        for kind in PARAMS:
            assert run(engine, PROMPTS[0], kind)[0] == reference(pair[0], PROMPTS[0], kind), kind


def run_batch(engine: Engine, requests: list[tuple[Request, int]], abort: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Each (request, step at which it joins) through engine.step; `abort`: request id -> step at which it
    is cancelled. Returns every request's tokens."""
    out: dict[str, list[TokenDelta]] = {r.request_id: [] for r, _ in requests}
    step = 0
    waiting = list(requests)
    while waiting or engine.num_running:
        for request, at in list(waiting):
            if at <= step and engine.can_add:
                engine.add_request(request)
                waiting.remove((request, at))
        for request_id, at in (abort or {}).items():
            if at == step:
                engine.abort_request(request_id)
        result = engine.step()
        assert not result.failures
        for delta in result.deltas:
            out[delta.request_id].append(delta)
        step += 1
    return {rid: [t for d in deltas for t in d.token_ids] for rid, deltas in out.items()}


BATCHED = [pytest.param(family, mode, marks=() if (family, mode) == ("qwen3_5_text", "resident") else pytest.mark.slow)
           for family in HYBRID_FAMILIES for mode in ("resident", "ram")]


@pytest.mark.parametrize(("family", "mode"), BATCHED)
def test_batched_requests_joining_while_others_decode_are_each_the_target_alone(pairs, reference, family, mode):
    """Four requests, two joining after others run (their 23- and 40-token prompts written 8 tokens a pass
    beside the running trees), greedy and seeded mixed."""
    pair = pairs(family, "noisy")
    kinds = ["greedy", "seeded", "seeded", "greedy"]
    requests = [(Request(f"r{i}", PROMPTS[i], PARAMS[kinds[i]]), at) for i, at in enumerate((0, 2, 0, 3))]
    with load(pair, mode, max_running=4, prefill_slice=8) as engine:
        got = run_batch(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == reference(pair[0], prompt, kinds[i]), i


def test_a_cancelled_request_leaves_no_trace(pairs, reference):
    """r0 is cancelled after two steps, r1 while its prompt is still being written; r2 and r3 (which takes
    a freed slot) are the target alone, and so is r0's prompt run again."""
    pair = pairs("qwen3_5_text", "noisy")
    requests = [(Request(f"r{i}", PROMPTS[i], PARAMS["greedy"]), at) for i, at in enumerate((0, 1, 0, 4))]
    with load(pair, max_running=3, prefill_slice=4, prefix_cache_slots=1) as engine:
        got = run_batch(engine, requests, abort={"r0": 2, "r1": 3})
        again = run(engine, PROMPTS[0], "greedy")[0]
    assert len(got["r0"]) < NUM_TOKENS and len(got["r1"]) < NUM_TOKENS
    assert got["r2"] == reference(pair[0], PROMPTS[2], "greedy")
    assert got["r3"] == reference(pair[0], PROMPTS[3], "greedy")
    assert again == reference(pair[0], PROMPTS[0], "greedy")


def test_n_choices_of_one_prompt_at_once_are_each_the_target_alone(pairs, reference):
    """n = 3 as the server runs it: three requests of one prompt added together, seeds s, s + 1, s + 2."""
    pair = pairs("qwen3_next", "noisy")
    seeds = [17, 18, 19]
    requests = [(Request(f"c{i}", PROMPTS[1], SamplingParams(temperature=0.9, seed=seed, max_tokens=NUM_TOKENS,
                                                             ignore_eos=True)), 0) for i, seed in enumerate(seeds)]
    with load(pair, max_running=3) as engine:
        got = run_batch(engine, requests)
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    for i, seed in enumerate(seeds):
        params = SamplingParams(temperature=0.9, seed=seed, max_tokens=NUM_TOKENS, ignore_eos=True)
        assert got[f"c{i}"] == plain_loop(model, PROMPTS[1], params, NUM_TOKENS), i
    assert len({tuple(tokens) for tokens in got.values()}) == 3


@pytest.mark.parametrize("mode", ["resident", pytest.param("ram", marks=pytest.mark.slow)])
def test_the_prefix_cache_reuses_a_whole_conversation_and_nothing_less(pairs, reference, mode):
    pair = pairs("qwen3_5_text", "noisy")
    with load(pair, mode, max_running=1, prefix_cache_slots=2) as engine:
        first = PROMPTS[1]
        got, cached, _ = run(engine, first, "greedy")
        assert (got, cached) == (reference(pair[0], first, "greedy"), 0)
        turn2 = first + got + PROMPTS[2]  # everything the slot holds is shared: reused
        got2, cached, _ = run(engine, turn2, "seeded")
        assert cached == len(first) + NUM_TOKENS - 1 and got2 == reference(pair[0], turn2, "seeded")
        again = first  # shares less than the slot holds (the answer is not in it): nothing reused
        got3, cached, _ = run(engine, again, "greedy")
        assert (got3, cached) == (reference(pair[0], first, "greedy"), 0)


SAMPLED_LEN = 3
NUM_SAMPLES = 2_000


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory) -> tuple[str, str]:
    """An 8-token Qwen3.5 pair with flat-ish logits (3 tokens: 512 outcomes), a smaller hybrid draft."""
    folder = tmp_path_factory.mktemp("hybrid-small-vocab")
    tokenizer = build_tokenizer()
    target = build_model("qwen3_5_text", 8, seed=5, init_range=0.3, layers=4)
    draft = build_model("qwen3_5_text", 8, seed=6, init_range=0.3, hidden=32, layers=4)
    return str(save_checkpoint(target, tokenizer, folder / "target")), str(save_checkpoint(draft, tokenizer, folder / "draft"))


@pytest.mark.slow
@pytest.mark.parametrize(("method", "budget", "max_running"), [("specinfer", 8, 1), ("rrs", 16, 1), ("specexec", 16, 4)])
def test_sampled_output_follows_the_targets_law(small_vocab_pair, method, budget, max_running, monkeypatch):
    """Unseeded draws at temperature 1.3 with top_k, each method's own trees (SpecInfer: rejection sampling;
    RRS: recursive rejection over draws without replacement; SpecExec: sample-and-match): chi-square of the first token and of 3 tokens against the target alone's
    exact law (every prefix through transformers' forward); 4 requests a step when batched."""
    from tests.speculation.test_engine_sampling_exactness import exact_distribution
    from tests.speculation.test_sampling_exactness import chi_square_p, marginal

    params = dict(temperature=1.3, top_k=6)
    target_dir, draft_dir = small_vocab_pair
    exact = exact_distribution(target_dir, SamplingParams(**params))
    fix_unseeded_entropy(monkeypatch)  # the unseeded path, its draws the same every run
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=target_dir, draft=draft_dir),
        speculation=SpeculationConfig(method=method, budget=budget, specinfer_temperature=NAMED_TREES),
        limits=LimitsConfig(max_context=32, max_running=max_running),
    ))
    sampled = SamplingParams(max_tokens=SAMPLED_LEN, ignore_eos=True, **params)
    samples: list[tuple[int, ...]] = []
    for first in range(0, NUM_SAMPLES, max_running):
        got = run_batch(engine, [(Request(f"s{first + i}", [3, 4, 5, 3], sampled), 0) for i in range(max_running)])
        samples += [tuple(tokens) for tokens in got.values()]
    p_first = chi_square_p([s[:1] for s in samples], marginal(exact, 1))
    p_seq = chi_square_p(samples, exact)
    print(f"{method} budget {budget} x{max_running}: p(first)={p_first:.3g} p({SAMPLED_LEN} tokens)={p_seq:.3g}")
    assert p_first > 1e-3 and p_seq > 1e-3
