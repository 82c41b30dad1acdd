"""Every family's logits through the engine's layer path equal transformers' own forward.

The runner calls each family's own decoder layers with the engine's attention (KV slots, tree and
window masks, sinks, soft-capping); prefill runs layer-major in chunks, then a tree pass: every node's
logits equal a plain transformers forward of its path (prompt + ancestors), in fp32. Sliding windows
(WINDOW) are shorter than the paths, so they bind. Also: a pass over several segments at once equals
each alone, the engine's attention is what runs (removing sinks or soft-capping breaks the families
that have them), the model's own forward is untouched after a pass, and a target pass reads no tensor
on the host (no op that would sync a GPU: .item(), .tolist(), nonzero, ...)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.model.hf_attention as hf_attention
from engine.model.runner import DecoderRunner, Segment
from engine.speculation.tree import prefix_tree_mask
from tests.helpers.family_configs import FAMILIES, WINDOW
from tests.helpers.tiny_models import build_model
from tests.helpers.trees import ancestors_and_depths, path_of

VOCAB = 300
PROMPT_LEN = 11
PARENTS = [-1, 0, 0, 1, 1, 2, 4, 6, 7, 8]  # depth 6: paths of up to 17 tokens, past every window
TOL = 2e-4  # relative to the largest logit: fp32 summation order, amplified by tiny models with init range 1


@pytest.fixture(scope="module")
def models():
    cache: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in cache:
            cache[family] = build_model(family, VOCAB, seed=13, layers=3)
        return cache[family]

    return get


def tree_pass(runner: DecoderRunner, prompt: torch.Tensor, tree_ids: torch.Tensor) -> torch.Tensor:
    """Prefill the prompt in chunks of 4 (layer-major), then one tree pass: [nodes, vocab] logits."""
    cache = runner.new_cache(64)
    runner.prefill(prompt, cache, 4)
    cache.length = prompt.shape[0]
    ancestors, depths = ancestors_and_depths(PARENTS)
    return runner.forward(tree_ids, prompt.shape[0] + depths, cache, prompt.shape[0], prefix_tree_mask(ancestors, prompt.shape[0]))


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen), torch.randint(3, VOCAB, (len(PARENTS),), generator=gen)


def max_error(model: torch.nn.Module, prompt: torch.Tensor, tree_ids: torch.Tensor, tree: torch.Tensor) -> float:
    """Largest |engine - transformers| over every node's logits, relative to the logits' scale."""
    with torch.no_grad():
        want = torch.stack([model(torch.cat([prompt, tree_ids[path_of(PARENTS, node)]])[None]).logits[0, -1]
                            for node in range(len(PARENTS))])
    return float((tree - want).abs().max() / want.abs().max().clamp(min=1.0))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_tree_equals_transformers(models, family):
    model = models(family)
    runner = DecoderRunner(model)
    prompt, tree_ids = inputs(5)
    tree = tree_pass(runner, prompt, tree_ids)
    error = max_error(model, prompt, tree_ids, tree)
    print(f"{family}: max relative error {error:.2e}")
    assert error < TOL
    if any(window is not None for window in runner.windows):
        assert WINDOW in runner.windows or family == "mistral"  # Mistral 7B v0.1's 4096 never binds here
    assert model.config._attn_implementation != hf_attention.ENGINE_ATTENTION  # restored after the pass


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gpt_oss", "qwen3_next", "qwen3_5_text"])
def test_segments_in_one_pass_equal_each_alone(models, family):
    """Two sequences, each in its own cache, scored in one pass (one [1, rows, hidden] block); hybrids: each
    its own linear-attention state."""
    runner = DecoderRunner(models(family))
    ids = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 13)]
    alone, segments = [], []
    for seq in ids:
        positions = torch.arange(seq.shape[0])
        allowed = positions[None, :] <= positions[:, None]
        alone.append(runner.forward(seq, positions, runner.new_cache(32), 0, allowed))
        segments.append(Segment(seq, positions, runner.new_cache(32), 0, allowed))
    together = runner.forward_groups([segments])[0]
    # summation order of [1, rows] blocks (a hybrid's chunked delta rule over 22 rows or 9 and 13): 1e-6 to 3e-6
    # of the scale measured; a state or mask shared between segments moves logits by the scale itself
    for got, want in zip(together, alone, strict=True):
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize(("family", "dropped"), [("gpt_oss", "sinks"), ("gemma3", "final soft-capping")])
def test_removing_a_family_feature_is_detected(models, family, dropped, monkeypatch):
    """The equality above has teeth: without GPT-OSS's sinks or Gemma's final soft-capping the logits differ."""
    model = models(family)
    if dropped == "sinks":
        attend_layer = hf_attention.attend_layer
        monkeypatch.setattr(hf_attention, "attend_layer", lambda *args: attend_layer(*args[:7], args[7], None))
    else:
        monkeypatch.setattr(model.config, "final_logit_softcapping", None)
    runner = DecoderRunner(model)
    prompt, tree_ids = inputs(5)
    tree = tree_pass(runner, prompt, tree_ids)
    monkeypatch.undo()
    assert max_error(model, prompt, tree_ids, tree) > 100 * TOL


HOST_READS = {  # ops that copy a device tensor's values to the host (a GPU sync) or size a result by them;
    # under inference mode .item() dispatches as aten.item and .tolist() shows as resolve_conj/resolve_neg
    "aten._local_scalar_dense.default", "aten.item.default", "aten.resolve_conj.default", "aten.resolve_neg.default",
    "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default",
    "aten.masked_select.default", "aten._unique2.default", "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def recorded_tree_pass(runner: DecoderRunner) -> set[str]:
    """The ops of one tree pass after a prefill (the pass a speculation step runs)."""
    prompt, tree_ids = inputs(7)
    cache = runner.new_cache(64)
    runner.prefill(prompt, cache, 4)
    cache.length = prompt.shape[0]
    ancestors, depths = ancestors_and_depths(PARENTS)
    recorder = OpRecorder()
    with recorder:
        runner.forward(tree_ids, PROMPT_LEN + depths, cache, PROMPT_LEN, prefix_tree_mask(ancestors, PROMPT_LEN))
    return recorder.ops


@pytest.mark.parametrize("family", FAMILIES)
def test_a_target_pass_reads_nothing_on_the_host(models, family):
    ops = recorded_tree_pass(DecoderRunner(models(family)))
    assert ops and not ops & HOST_READS, sorted(ops & HOST_READS)


def test_a_host_read_in_the_layer_path_is_detected(models, monkeypatch):
    attend_layer = hf_attention.attend_layer

    def reading(group, layer_idx, query, *rest):
        float(query[0, 0, 0, 0])  # .item(): a host read
        return attend_layer(group, layer_idx, query, *rest)

    monkeypatch.setattr(hf_attention, "attend_layer", reading)
    assert recorded_tree_pass(DecoderRunner(models("llama"))) & HOST_READS
