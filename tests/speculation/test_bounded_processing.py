"""Verification processes a tree's logits in blocks of rows, with outputs unchanged.

The reference is verification as it was before blocks (written out here): the whole [n, vocab]
matrix processed at once by process_logits, one sample_tokens call (one exponential_ call for
all rows), SpecInfer softmaxing every row up front, and the acceptance curve's path
probabilities from the whole processed matrix. Blocked verification must give the same path,
bonus token, generator state afterwards and path probabilities, bit for bit, for every block
size; this rests on every processing step being row-wise and on CPU exponential_ filling
sequentially from the generator (checked on its own below). The memory bound is checked by
recording every tensor that an aten op newly allocates during verify_step (a TorchDispatchMode
sees each op's outputs; an output whose storage is not an input's is a new allocation): for
a tree of n nodes with a small block, nothing bigger than a block is allocated and a few blocks
at most are alive at once, while the reference allocates n x vocab."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.speculation.sampling import (
    LOGITS_WORKSPACE_BLOCKS,
    block_rows,
    logits_workspace_bytes,
    process_logits,
    sample_tokens,
)
from engine.speculation.step import verify_step
from engine.speculation.tree import Tree, append_nodes, path_token_counts
from engine.speculation.verify import children_lists, path_probabilities
from engine.types import SamplingParams

VOCAB = 50
NUM_NODES = 40

GREEDY = SamplingParams(temperature=0.0)
GREEDY_SHAPED = SamplingParams(
    temperature=0.0, presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={3: 2.0, 7: -1.5}
)
PLAIN = SamplingParams(temperature=1.0)
ALL_OPTIONS = SamplingParams(
    temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
    presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={3: 2.0, 7: -1.5},
)
PARAMS = [GREEDY, GREEDY_SHAPED, PLAIN, ALL_OPTIONS]
PARAM_IDS = ["greedy", "greedy-penalties-bias", "plain", "all-options"]
BLOCKS = [1, 3, 7, NUM_NODES, 10 * NUM_NODES, None]


def random_tree(num_nodes: int, vocab: int, gen: torch.Generator, draft_vocab: int | None = None) -> Tree:
    """Random parents (shallow and deep branches), distinct tokens among siblings; with
    draft_vocab, random draft distributions at every node (a SpecInfer tree)."""
    parents, tokens = [-1], [int(torch.randint(vocab, (), generator=gen))]
    taken: dict[int, set[int]] = {0: set()}
    for node in range(1, num_nodes):
        low = max(0, node - 4) if node % 3 else 0
        parent = int(torch.randint(low, node, (), generator=gen))
        free = [t for t in torch.randperm(vocab, generator=gen).tolist() if t not in taken[parent]]
        parents.append(parent)
        tokens.append(free[0])
        taken[parent].add(free[0])
        taken[node] = set()
    ancestors = torch.ones(1, 1, dtype=torch.bool)
    depths = [0]
    for node in range(1, num_nodes):
        ancestors = append_nodes(ancestors, torch.tensor([parents[node]]))
        depths.append(depths[parents[node]] + 1)
    draft_probs = None
    if draft_vocab is not None:
        draft_probs = (torch.randn(num_nodes, draft_vocab, generator=gen) * 2).softmax(-1)
    return Tree(
        token_ids=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
        scores=torch.zeros(num_nodes), ancestors=ancestors, draft_slots=torch.full((num_nodes,), -1),
        draft_probs=draft_probs,
    )


def target_logits(tree: Tree, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[n, vocab] raw logits that favour each node's children, so walks go deep."""
    logits = torch.randn(tree.num_nodes, vocab, generator=gen)
    logits[tree.parents[1:], tree.token_ids[1:]] += 3.0
    return logits


def inputs(seed: int, draft_vocab: int | None = None, num_nodes: int = NUM_NODES, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(num_nodes, vocab, gen, draft_vocab)
    logits = target_logits(tree, vocab, gen)
    counts = torch.randint(0, 3, (vocab,), generator=gen).float() * (torch.rand(vocab, generator=gen) < 0.3)
    prompt_mask = torch.rand(vocab, generator=gen) < 0.2
    return tree, logits, counts, prompt_mask


def reference_verify(tree, logits, params, output_counts, prompt_mask, generator):
    """Verification before blocks: (path, bonus, path probabilities or None when greedy)."""
    counts = None
    if params.uses_penalties:
        counts = output_counts[None] + path_token_counts(tree, logits.shape[1])
    processed = process_logits(logits, params, counts, prompt_mask)  # [n, vocab]
    if tree.draft_probs is not None and not params.greedy:
        path, bonus = reference_specinfer(tree, processed, generator)
    else:
        drawn = sample_tokens(processed, params.greedy, generator)
        matches = tree.token_ids == drawn[tree.parents.clamp(min=0)]
        matches[0] = True
        path = (~(tree.ancestors & ~matches[None, :]).any(dim=1)).nonzero().squeeze(1)
        bonus = drawn[path[-1]]
    if params.greedy:
        return path, bonus, None
    parents = tree.parents.clamp(min=0)
    node_lp = processed[parents, tree.token_ids] - torch.logsumexp(processed, dim=-1)[parents]
    node_lp[0] = 0.0
    return path, bonus, (tree.ancestors.float() @ torch.nan_to_num(node_lp, neginf=-1e4)).exp()


def reference_specinfer(tree, processed, generator):
    vocab = processed.shape[1]
    draft_all = tree.draft_probs[:, :vocab]
    if draft_all.shape[1] < vocab:
        draft_all = torch.cat([draft_all, draft_all.new_zeros(tree.num_nodes, vocab - draft_all.shape[1])], dim=1)
    probs = processed.softmax(dim=-1)
    children = children_lists(tree.parents.tolist())
    tokens = tree.token_ids.tolist()
    current, path, target = 0, [0], probs[0]
    while True:
        draft, next_node = draft_all[current], None
        for child in children[current]:
            ratio = target[tokens[child]] / draft[tokens[child]].clamp(min=1e-30)
            if bool(torch.rand((), generator=generator) < ratio):
                next_node = child
                break
            residual = (target - draft).clamp(min=0)
            target = residual / residual.sum() if bool(residual.sum() > 0) else target
        if next_node is None:
            break
        current = next_node
        path.append(current)
        target = probs[current]
    return torch.tensor(path), torch.multinomial(target, 1, generator=generator)[0]


def check_same_as_reference(seed, params, rows_per_block, draft_vocab=None):
    tree, logits, counts, prompt_mask = inputs(seed, draft_vocab)
    want_gen = torch.Generator().manual_seed(100 + seed)
    want_path, want_bonus, want_probs = reference_verify(tree, logits, params, counts, prompt_mask, want_gen)
    got_gen = torch.Generator().manual_seed(100 + seed)
    verdict = verify_step(tree, logits, params, counts, prompt_mask, got_gen,
                          track_acceptance=True, rows_per_block=rows_per_block)
    assert torch.equal(verdict.path, want_path)
    assert torch.equal(verdict.bonus_id, want_bonus)
    assert torch.equal(got_gen.get_state(), want_gen.get_state())  # same draws consumed: later steps agree too
    if want_probs is None:
        assert verdict.node_log_probs is None
    else:
        assert torch.equal(path_probabilities(tree, verdict.node_log_probs), want_probs)
    return verdict.path.shape[0]


@pytest.mark.parametrize("rows_per_block", BLOCKS)
@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_specexec_blocks_give_todays_verdict(params, rows_per_block):
    depths = [check_same_as_reference(seed, params, rows_per_block)
              for seed in range(12)]
    assert max(depths) >= 3  # some walks go deep


@pytest.mark.parametrize("rows_per_block", BLOCKS)
@pytest.mark.parametrize("params", [PLAIN, ALL_OPTIONS], ids=["plain", "all-options"])
@pytest.mark.parametrize("draft_vocab", [VOCAB, VOCAB - 8, VOCAB + 8], ids=["same", "smaller", "larger"])
def test_specinfer_blocks_give_todays_verdict(params, rows_per_block, draft_vocab):
    depths = [check_same_as_reference(seed, params, rows_per_block, draft_vocab)
              for seed in range(12)]
    assert max(depths) >= 2


def test_cpu_exponential_noise_is_the_same_in_blocks():
    """The property the sampled equality rests on: on CPU, exponential_ draws the generator's
    numbers in order, so blocks of rows get exactly the single call's noise."""
    whole = torch.empty(2049, 3000).exponential_(generator=torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    blocks = [torch.empty(min(7, 2049 - begin), 3000).exponential_(generator=gen) for begin in range(0, 2049, 7)]
    assert torch.equal(torch.cat(blocks), whole)


class AllocationRecorder(TorchDispatchMode):
    """Records (op, shape, bytes) of every tensor an aten op newly allocates (not a view of, or in
    place on, one of its inputs), and the peak of the bytes alive at once: a tensor counts until
    its Python object is collected (a view keeps its base's object alive, so no storage is
    counted freed while a view of it lives)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[str, tuple[int, ...], int]] = []
        self.alive: dict[int, int] = {}  # storage data_ptr -> bytes
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs_flat, _ = tree_flatten((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in inputs_flat if isinstance(t, torch.Tensor)}
        outs, _ = tree_flatten(out)
        for t in outs:
            ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0
            if ptr and ptr not in seen and ptr not in self.alive:
                nbytes = t.untyped_storage().nbytes()
                self.allocations.append((str(func), tuple(t.shape), nbytes))
                self.alive[ptr] = nbytes
                self.peak = max(self.peak, sum(self.alive.values()))
                weakref.finalize(t, self.alive.pop, ptr)
        return out

    def largest(self) -> tuple[str, tuple[int, ...], int]:
        return max(self.allocations, key=lambda a: a[2])


BIG_NODES, BIG_VOCAB, SMALL_BLOCK = 160, 8192, 6
BLOCK_BYTES = SMALL_BLOCK * BIG_VOCAB * 4
CPU_PEAK_BLOCKS = 7  # LOGITS_WORKSPACE_BLOCKS's share for processing's own tensors


@pytest.mark.parametrize("params", [GREEDY_SHAPED, ALL_OPTIONS], ids=["greedy-penalties-bias", "all-options"])
@pytest.mark.parametrize("draft_vocab", [None, BIG_VOCAB - 100], ids=["specexec", "specinfer"])
def test_memory_does_not_grow_with_the_tree(params, draft_vocab):
    """During verify_step every allocation stays within one block (SMALL_BLOCK x vocab elements,
    8 bytes each at most: sort indices) and at most CPU_PEAK_BLOCKS blocks are alive at once,
    while the reference allocates n x vocab floats. The tree's own [n, n] and [n] tensors are
    far below one block here."""
    tree, logits, counts, prompt_mask = inputs(3, draft_vocab, BIG_NODES, BIG_VOCAB)
    assert BIG_NODES * BIG_NODES < SMALL_BLOCK * BIG_VOCAB
    with AllocationRecorder() as blocked:
        verify_step(tree, logits, params, counts, prompt_mask, torch.Generator().manual_seed(1),
                    track_acceptance=True, rows_per_block=SMALL_BLOCK)
    op, shape, nbytes = blocked.largest()
    assert nbytes <= 2 * BLOCK_BYTES, (op, shape, nbytes)
    assert max(a[2] for a in blocked.allocations if "sort" not in a[0]) <= BLOCK_BYTES
    assert blocked.peak <= CPU_PEAK_BLOCKS * BLOCK_BYTES, blocked.peak / BLOCK_BYTES
    assert CPU_PEAK_BLOCKS < LOGITS_WORKSPACE_BLOCKS
    with AllocationRecorder() as whole:  # the recorder sees today's [n, vocab] temporaries
        reference_verify(tree, logits, params, counts, prompt_mask, torch.Generator().manual_seed(1))
    assert whole.largest()[2] >= BIG_NODES * BIG_VOCAB * 4
    assert whole.peak >= 4 * BIG_NODES * BIG_VOCAB * 4


def test_block_rows_follow_the_byte_budget():
    assert block_rows(128_256) == (64 << 20) // (128_256 * 4)
    assert block_rows(128_256, block_bytes=1) == 1
    assert block_rows(50, block_bytes=50 * 4 * 7) == 7
    assert logits_workspace_bytes(32_000) == LOGITS_WORKSPACE_BLOCKS * block_rows(32_000) * 32_000 * 4
