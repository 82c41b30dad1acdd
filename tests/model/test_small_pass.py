"""A pass's fixed cost outside the layers, cut without changing a bit (docs/bench/small-pass.md).

- rotary cos/sin looked up in tables the model's own rotary module made (engine.model.rotary_table) equal
  the module's own output at those positions bit for bit, for every family (default, linear, yarn rope) and
  llama3 rope, fp32 and bf16, across table growth; rope types whose frequencies move are computed per pass;
- a pass (prefill chunks, then a tree) gives the same logits and cache contents, bit for bit, as the path it
  replaced (cos/sin from the module each pass, sdpa_kernel entered each pass, per-pass cache views and
  masks as they were made), and SDPA runs the same kernel;
- sdpa_kernel is skipped only where the flags SDPA reads on the device already say the same;
- a pass that grows the tables reads nothing on the host.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM

import engine.model.attention as attention
import engine.model.rotary_table as rotary_table
import engine.model.runner as runner_module
from engine.model.kv_cache import KVCache
from engine.model.rotary_table import module_rotary, static_rope
from engine.model.runner import DecoderRunner
from engine.speculation.tree import prefix_tree_mask
from tests.helpers.family_configs import FAMILIES
from tests.helpers.tiny_models import build_model, tiny_config
from tests.helpers.trees import ancestors_and_depths
from tests.model.test_family_logits import HOST_READS, OpRecorder

VOCAB = 300
PROMPT_LEN = 11
PARENTS = [-1, 0, 0, 1, 1, 2, 4, 6, 7, 8]
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
BF16_FAMILIES = ("llama", "gemma3", "gpt_oss", "phi3", "qwen3_5_text")


def build(family: str, dtype: torch.dtype = torch.float32, rope: dict | None = None) -> torch.nn.Module:
    if rope is None:
        return build_model(family, VOCAB, seed=13, layers=3).to(dtype)
    config = tiny_config(family, VOCAB, layers=3)
    config.rope_parameters = rope
    torch.manual_seed(13)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(dtype)


CASES = [(family, torch.float32, None) for family in FAMILIES] + [
    ("llama", torch.float32, LLAMA3), ("llama", torch.bfloat16, LLAMA3),
    *[(family, torch.bfloat16, None) for family in BF16_FAMILIES],
]
CASE_IDS = [f"{family}-{str(dtype)[6:]}{'-llama3' if rope else ''}" for family, dtype, rope in CASES]


@pytest.mark.parametrize(("family", "dtype", "rope"), CASES, ids=CASE_IDS)
def test_rotary_tables_equal_the_module_bitwise(family, dtype, rope):
    runner = DecoderRunner(build(family, dtype, rope))
    assert runner.rotary_tables is not None, "every family here has fixed frequencies"
    like = runner.embed_tokens.weight[:1, None]
    gen = torch.Generator().manual_seed(3)
    # bounds across growth (256 -> 512 -> 1024 positions); odd row counts put positions at every vector offset
    for bound, num_rows in ((7, 1), (200, 3), (256, 8), (257, 1), (300, 17), (511, 32), (700, 5), (1000, 64)):
        positions = torch.randint(0, bound, (num_rows,), generator=gen)
        positions[0] = bound - 1
        got = runner.rotary_tables.lookup(runner.embed_tokens.weight, positions, bound)
        for key in runner.rotary_key_set:
            want = module_rotary(runner.rotary_emb, like, positions[None], key)  # the module's own forward
            for a, b in zip(got[key], want, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                assert torch.equal(a, b), (family, key, bound)
    assert runner.rotary_tables.num_positions == 1024


def test_rope_types_whose_frequencies_move_are_computed_per_pass():
    dynamic = build("llama", rope={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0})
    assert DecoderRunner(dynamic).rotary_tables is None
    for rope_type in ("longrope", "dynamic", {"full_attention": "linear", "sliding_attention": "dynamic"}):
        assert not static_rope(type("Rotary", (torch.nn.Module,), {"rope_type": rope_type})())
    assert static_rope(type("Rotary", (torch.nn.Module,), {"rope_type": {"a": "linear", "b": "default"}})())


def old_pass_views(self, start_slot, num_tokens):
    """KVCache.pass_views before the per-cache grouped views."""
    end = start_slot + num_tokens
    new = self.keys[:, :, start_slot:end].unsqueeze(1), self.values[:, :, start_slot:end].unsqueeze(1)
    return (*new, self.keys[:, :, :end].unsqueeze(2), self.values[:, :, :end].unsqueeze(2))


def old_additive_mask(allowed, dtype):
    """attention.additive_mask before its single slice."""
    num_tokens, kv_len = allowed.shape
    mask = attention.masked_rows(num_tokens, kv_len, dtype, allowed.device)
    mask[:, :kv_len].masked_fill_(allowed, 0.0)
    return mask[None, None, :, :kv_len]


def passes(runner: DecoderRunner, dtype: torch.dtype) -> tuple[list[torch.Tensor], KVCache, set[str]]:
    """Causal prefill in chunks of 4, a causal pass with logits, then a tree pass: logits, cache, and the SDPA
    kernels of the last two passes (the profiler's names: the dispatch sees only scaled_dot_product_attention)."""
    gen = torch.Generator().manual_seed(5)
    prompt, tree_ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen), torch.randint(3, VOCAB, (10,), generator=gen)
    cache = runner.new_cache(64)
    runner.prefill(prompt[:-3], cache, 4)
    cache.length = PROMPT_LEN - 3
    positions = torch.arange(PROMPT_LEN - 3, PROMPT_LEN)
    causal = positions[:, None] >= torch.arange(PROMPT_LEN)[None, :]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        first = runner.forward(prompt[-3:], positions, cache, PROMPT_LEN - 3, causal)
        cache.length = PROMPT_LEN
        ancestors, depths = ancestors_and_depths(PARENTS)
        tree = runner.forward(tree_ids, PROMPT_LEN + depths, cache, PROMPT_LEN, prefix_tree_mask(ancestors, PROMPT_LEN))
    kernels = {event.name for event in profile.events() if event.name.startswith("aten::_scaled_dot_product")}
    return [first, tree], cache, kernels


@pytest.mark.parametrize(("family", "dtype", "rope"), CASES, ids=CASE_IDS)
def test_a_pass_equals_the_replaced_path_bitwise(family, dtype, rope, monkeypatch):
    model = build(family, dtype, rope)
    new_logits, new_cache, new_ops = passes(DecoderRunner(model), dtype)
    monkeypatch.setattr(runner_module, "sdpa_backends", lambda backends, device: sdpa_kernel(backends))
    monkeypatch.setattr(KVCache, "pass_views", old_pass_views)
    monkeypatch.setattr(attention, "additive_mask", old_additive_mask)
    old = DecoderRunner(model)
    old.rotary_tables = None
    old_logits, old_cache, old_ops = passes(old, dtype)
    for got, want in zip(new_logits, old_logits, strict=True):
        assert torch.equal(got, want), family
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(new_cache, name), getattr(old_cache, name)), name
    assert new_ops == old_ops, (new_ops, old_ops)


def test_masks_and_cache_views_keep_their_layout():
    allowed = torch.rand(5, 37, generator=torch.Generator().manual_seed(1)) < 0.5
    got, want = attention.additive_mask(allowed, torch.float32), old_additive_mask(allowed, torch.float32)
    assert torch.equal(got, want) and got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
    cache = KVCache(3, 2, 8, 40, torch.float32, torch.device("cpu"))
    for got, want in zip(cache.pass_views(9, 5), old_pass_views(cache, 9, 5), strict=True):
        assert got.shape == want.shape and got.data_ptr() == want.data_ptr()
        assert all(a == b for a, b, size in zip(got.stride(), want.stride(), got.shape, strict=True) if size > 1)


def test_past_the_largest_table_a_pass_computes_its_own(monkeypatch):
    monkeypatch.setattr(rotary_table, "MIN_POSITIONS", 16)
    monkeypatch.setattr(rotary_table, "MAX_POSITIONS", 16)
    model = build("gemma3")
    runner = DecoderRunner(model)
    logits, _, _ = passes(runner, torch.float32)  # the prefill and first pass from the table, the tree's (21) not
    assert runner.rotary_tables.num_positions == 16
    old = DecoderRunner(model)
    old.rotary_tables = None
    for got, want in zip(logits, passes(old, torch.float32)[0], strict=True):
        assert torch.equal(got, want)


def test_sdpa_kernel_is_entered_only_where_the_flags_differ():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object: no CUDA needed
    cpu_backends, cuda_backends = attention.attention_backends(cpu), attention.attention_backends(cuda)
    assert attention.sdpa_backends(cpu_backends, cpu) is attention.NO_CONTEXT  # the default flags
    assert attention.sdpa_backends([SDPBackend.MATH], cpu) is not attention.NO_CONTEXT  # a pinned kernel
    assert attention.sdpa_backends(cuda_backends, cuda) is not attention.NO_CONTEXT  # CUDA reads every flag
    with sdpa_kernel([SDPBackend.MATH]):
        assert attention.sdpa_backends(cpu_backends, cpu) is not attention.NO_CONTEXT
    with sdpa_kernel(cuda_backends):  # inside a step that entered them (engine.speculation.batch)
        assert attention.sdpa_backends(cuda_backends, cuda) is attention.NO_CONTEXT
        assert attention.sdpa_backends(cpu_backends, cpu) is not attention.NO_CONTEXT  # flash is off here


def test_a_pinned_kernel_still_runs():
    runner = DecoderRunner(build("llama"))
    runner.attention_backends = [SDPBackend.MATH]
    _, _, ops = passes(runner, torch.float32)
    assert ops == {"aten::_scaled_dot_product_attention_math"}, ops
    _, _, ops = passes(DecoderRunner(build("llama")), torch.float32)
    assert ops == {"aten::_scaled_dot_product_flash_attention_for_cpu"}, ops


def test_a_pass_growing_the_tables_reads_nothing_on_the_host():
    runner = DecoderRunner(build("gemma3"))
    ids = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(6)
    recorder = OpRecorder()
    with recorder:
        runner.forward(ids, positions, runner.new_cache(16), 0, positions[:, None] >= positions[None, :])
    assert runner.rotary_tables.num_positions == rotary_table.MIN_POSITIONS
    assert "aten.index_select.default" in recorder.ops and not recorder.ops & HOST_READS, sorted(recorder.ops & HOST_READS)
