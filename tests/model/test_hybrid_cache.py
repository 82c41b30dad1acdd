"""A hybrid model's states through the engine's own cache protocol, against transformers' forward.

Per path, every logit the engine computes equals a plain transformers forward of the prompt plus that
path (fp32): a draft's catch-up (a causal chain whose committed part is applied lazily), its expansions
over several forwards (each reading the earlier ones' pending rows), the commit of an accepted path, a
seed moved after the commit (its gammas re-based), and a target's tree after a commit. Also: the prefix
cache reuses a hybrid state whole or not at all, a state is never truncated, the pending ring's room is
what the draft may use. Removing a feature (the commit advanced along a sibling's path, gammas not
re-based, the convolution window reading a sibling) breaks the equality."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model import linear_attention
from engine.model.hybrid_cache import HybridCache
from engine.model.kv_pool import KVPool, KVSlot
from engine.model.linear_state import LinearStates
from engine.model.runner import DecoderRunner
from engine.speculation.drafter import Drafter, root_tree
from engine.speculation.tree import Tree, prefix_tree_mask
from tests.helpers.family_configs import HYBRID_FAMILIES
from tests.helpers.tiny_models import build_model
from tests.helpers.trees import ancestors_and_depths, path_of

VOCAB = 300
PROMPT = [5, 17, 42, 9, 77, 130, 64, 3, 200, 31, 8]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 8]  # depth 5: paths past the convolution window (4)
TOL = 1e-4  # relative to the logits' scale: fp32 summation order


@pytest.fixture(scope="module")
def models():
    built: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in built:
            built[family] = build_model(family, VOCAB, seed=3, layers=4)
        return built[family]

    return get


@torch.no_grad()
def reference(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0, -1]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= TOL * float(want.abs().max())


def drive(runner: DecoderRunner, growth):
    """Run a drafter generator (it yields segments, is sent their logits) to its return value."""
    try:
        segment = next(growth)
        while True:
            segment = growth.send(runner.forward_groups([[segment]])[0][0])
    except StopIteration as done:
        return done.value


def hand_tree(root_id: int, root_slot: int, token_ids: list[int]) -> Tree:
    ancestors, depths = ancestors_and_depths(PARENTS)
    tree = root_tree(root_id, root_slot, torch.device("cpu"))
    tree.token_ids = torch.tensor([root_id, *token_ids[1:]])
    tree.parents, tree.depths, tree.ancestors = torch.tensor(PARENTS), depths, ancestors
    tree.scores = torch.zeros(len(PARENTS))
    tree.draft_slots = torch.cat([tree.draft_slots, torch.full((len(PARENTS) - 1,), -1)])
    return tree


def tokens(seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (len(PARENTS),), generator=torch.Generator().manual_seed(seed)).tolist()


def grow(model, runner: DecoderRunner, cache: HybridCache, tree_ids: list[int]) -> tuple[Drafter, Tree, list[bool]]:
    """Prefill all but 3 prompt tokens, catch up 2 more and the root, expand the tree level by level
    in three forwards; every row checked against transformers: (drafter, tree, per-row agreement)."""
    runner.prefill(torch.tensor(PROMPT[:-3]), cache, 4)
    cache.length = len(PROMPT) - 3
    drafter = Drafter(runner, cache, VOCAB)
    root_logits = drive(runner, drafter.catch_up(PROMPT[-3:-1], PROMPT[-1]))
    agree = [close(root_logits[0], reference(model, PROMPT))]
    tree = hand_tree(PROMPT[-1], cache.length, tree_ids)
    for selected in ([0], [1, 2], [3, 4, 5], [6, 7], [8]):  # node 0 is the root: expanded by catch_up
        if selected == [0]:
            continue
        logits = drive(runner, drafter.expand(tree, torch.tensor(selected)))
        for row, node in enumerate(selected):
            path = [int(t) for t in tree.token_ids[path_of(PARENTS, node)]]
            agree.append(close(logits[row], reference(model, PROMPT[:-1] + path)))
    return drafter, tree, agree


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_drafts_catch_up_and_expansions_over_several_forwards_are_exact(models, family):
    model = models(family)
    runner = DecoderRunner(model)
    _, _, agree = grow(model, runner, runner.new_cache(64, 16), tokens(1))
    assert all(agree), agree


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_commit_keeps_the_accepted_path_and_a_seed_moves_after_it(models, family):
    """Commit root -> 1 -> 3 (nodes expanded), then the seed under node 6 (6, 8: expanded) moves to the
    slots after the commit; expanding node 9 under it and catching up a new root are exact."""
    model = models(family)
    runner = DecoderRunner(model)
    cache = runner.new_cache(64, 16)
    tree_ids = tokens(2)
    drafter, tree, _ = grow(model, runner, cache, tree_ids)
    path = torch.tensor([0, 1, 3])
    drafter.commit(tree, path)
    accepted = PROMPT[:-1] + [int(t) for t in tree.token_ids[path]]
    seed = Tree(token_ids=tree.token_ids[[6, 8, 9]], parents=torch.tensor([-1, 0, 1]), depths=torch.arange(3),
                scores=torch.zeros(3), ancestors=torch.ones(3, 3, dtype=torch.bool).tril(),
                draft_slots=tree.draft_slots[[6, 8, 9]])
    seed = drafter.adopt(seed)
    logits = drive(runner, drafter.expand(seed, torch.tensor([2])))
    assert close(logits[0], reference(model, accepted + [int(t) for t in tree.token_ids[[6, 8, 9]]]))
    drafter.commit(seed, torch.tensor([0, 1]))  # 6 and 8 accepted; a fresh root after them
    accepted += [int(t) for t in tree.token_ids[[6, 8]]]
    root = drive(runner, drafter.catch_up([], 77))
    assert close(root[0], reference(model, accepted + [77]))


def test_without_re_based_gammas_the_seed_is_wrong(models, monkeypatch):
    """The test above has teeth: gammas left relative to the old state break the seed's rows."""
    model = models("qwen3_5_text")
    runner = DecoderRunner(model)
    cache = runner.new_cache(64, 16)
    tree_ids = tokens(2)
    drafter, tree, _ = grow(model, runner, cache, tree_ids)
    advance = LinearStates.advance

    def no_rebase(self, layer, slots):
        saved = self.gammas[layer].clone()
        advance(self, layer, slots)
        self.gammas[layer] = saved

    monkeypatch.setattr(LinearStates, "advance", no_rebase)
    drafter.commit(tree, torch.tensor([0, 1, 3]))
    monkeypatch.undo()
    seed = Tree(token_ids=tree.token_ids[[6, 8, 9]], parents=torch.tensor([-1, 0, 1]), depths=torch.arange(3),
                scores=torch.zeros(3), ancestors=torch.ones(3, 3, dtype=torch.bool).tril(),
                draft_slots=tree.draft_slots[[6, 8, 9]])
    seed = drafter.adopt(seed)
    logits = drive(runner, drafter.expand(seed, torch.tensor([2])))
    want = reference(model, PROMPT[:-1] + [int(t) for t in tree.token_ids[[0, 1, 3, 6, 8, 9]]])
    assert not close(logits[0], want)


def target_step(model, runner: DecoderRunner, cache: HybridCache, tree_ids: list[int], prefix: list[int]) -> list[bool]:
    """One tree pass on top of the committed `prefix` (root = tree_ids[0]): every node against transformers."""
    ancestors, depths = ancestors_and_depths(PARENTS)
    start = cache.length
    logits = runner.forward(torch.tensor(tree_ids), start + depths, cache, start, prefix_tree_mask(ancestors, start))
    return [close(logits[node], reference(model, prefix + [tree_ids[i] for i in path_of(PARENTS, node)]))
            for node in range(len(PARENTS))]


def two_target_steps(model, runner: DecoderRunner, path: list[int]) -> list[bool]:
    cache = runner.new_cache(64, len(PARENTS))
    runner.prefill(torch.tensor(PROMPT[:-1]), cache, 4)
    cache.length = len(PROMPT) - 1
    first, second = tokens(3), tokens(4)
    first[0] = PROMPT[-1]
    agree = target_step(model, runner, cache, first, PROMPT[:-1])
    cache.commit(cache.length + torch.tensor(path))
    second[0] = 99  # the bonus token: the next root
    return agree + target_step(model, runner, cache, second, PROMPT[:-1] + [first[node] for node in path])


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_target_tree_after_a_commit_is_exact(models, family):
    model = models(family)
    assert all(two_target_steps(model, DecoderRunner(model), [0, 1, 3, 6, 8]))


def test_a_state_advanced_along_a_wrong_path_is_detected(models, monkeypatch):
    """The commit's state follows the accepted path: advanced along a sibling's (node 7 for 6), the next
    tree's logits differ."""
    model = models("qwen3_5_text")
    advance = LinearStates.advance
    monkeypatch.setattr(LinearStates, "advance", lambda self, layer, slots: advance(self, layer, torch.where(
        slots == slots[-2], slots + 1, slots) if slots.shape[0] == 5 else slots))
    agree = two_target_steps(model, DecoderRunner(model), [0, 1, 3, 6, 8])
    assert all(agree[: len(PARENTS)]) and not any(agree[len(PARENTS) :])


def test_a_convolution_window_that_reads_a_sibling_is_detected(models, monkeypatch):
    """tree_conv picks each row's window along its own path: picked by position alone (any pending row
    at that depth), node 5's window holds its parent's sibling (node 1 for 2) and its logits differ."""
    model = models("qwen3_5_text")
    tree_conv = linear_attention.tree_conv

    def by_position(cache, layer, s, rows, conv):
        return tree_conv(cache, layer, dataclasses.replace(s, allowed=torch.ones_like(s.allowed)), rows, conv)

    monkeypatch.setattr(linear_attention, "tree_conv", by_position)
    agree = two_target_steps(model, DecoderRunner(model), [0, 1, 3])
    assert agree[:5] == [True] * 5 and not agree[5]


def test_the_prefix_cache_reuses_a_hybrid_state_whole_or_not_at_all(models):
    runner = DecoderRunner(models("qwen3_5_text"))
    pool = KVPool([KVSlot(runner.new_cache(64, 8), None) for _ in range(2)])
    first = pool.acquire(PROMPT)
    runner.prefill(torch.tensor(PROMPT[:-1]), first.slot.target, 4)
    first.slot.target.length = len(PROMPT) - 1
    pool.release(first.slot, PROMPT)
    partial = pool.acquire(PROMPT[:6] + [1, 2, 3])  # shares 6 of the 10 tokens held: nothing reused
    assert partial.cached_tokens == 0 and partial.slot is not first.slot and partial.slot.target.length == 0
    pool.release(partial.slot, [])
    extended = pool.acquire(PROMPT + [4, 5])  # the next turn: everything held is shared
    assert extended.slot is first.slot and extended.cached_tokens == len(PROMPT) - 1
    with pytest.raises(AssertionError, match="cannot be truncated"):
        extended.slot.target.length = 3


def test_the_drafts_room_is_the_pending_rings():
    runner = DecoderRunner(build_model("qwen3_5_text", VOCAB, seed=3, layers=2))
    cache = runner.new_cache(64, 8)
    cache.length = 0
    assert cache.room(0) == 8 and cache.room(5) == 3
    with pytest.raises(RuntimeError, match="pending slots overflow"):
        cache.linear.write_x(0, 6, torch.zeros(3, cache.linear.shape.conv_dim))


def test_a_linear_attention_layer_that_calls_neither_function_is_refused():
    """A transformers whose Gated DeltaNet layer does not call causal_conv1d_fn and the chunked delta rule
    (the engine's way in) is refused in one line, not run wrongly."""

    class OtherLayer(torch.nn.Module):
        def forward(self, hidden_states):
            return hidden_states

    with pytest.raises(ValueError, match="calls no causal_conv1d_fn or torch_chunk_gated_delta_rule"):
        linear_attention.install(OtherLayer)
