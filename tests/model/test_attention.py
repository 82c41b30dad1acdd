"""The engine's attention layout (each KV head a batch entry, its query group as heads, K/V expanded as
stride-0 views, mask rows aligned): equal to the plain GQA call it replaced, and the runner's tree and
prefill logits equal a plain transformers forward of every node's path, for the four architectures,
with and without GQA, with full and sliding windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from transformers import AutoModelForCausalLM

from engine.model.attention import (
    MASK_ALIGN,
    additive_mask,
    attend,
    attend_heads,
    attention_backends,
    causal_additive_mask,
    causal_allowed,
)
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner
from engine.speculation.tree import causal_mask, prefix_tree_mask
from tests.helpers.tiny_models import tiny_config
from tests.helpers.trees import ancestors_and_depths, path_of

ARCHS = ["llama", "mistral", "qwen2", "mixtral"]
VOCAB = 300
WINDOW = 4  # shorter than every path below, so sliding windows bind
PROMPT_LEN = 9
PARENTS = [-1, 0, 0, 1, 1, 2, 4, 6]  # tree node i's parent (the root continues the prompt)
TOL = 1e-4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def build(arch: str, kv_heads: int, window: int | None) -> torch.nn.Module:
    """Tiny 3-layer model with 4 query heads; qwen2 windows only layers 1 and 2 (mixed windows)."""
    base = tiny_config(arch, VOCAB, layers=3)
    fields = base.to_dict()
    fields.pop("layer_types", None)
    fields.update(num_key_value_heads=kv_heads)
    if window is not None and arch == "qwen2":
        fields.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    elif window is not None and arch in ("mistral", "mixtral"):
        fields.update(sliding_window=window)
    torch.manual_seed(11)
    return AutoModelForCausalLM.from_config(type(base)(**fields), dtype=torch.float32).eval()


def tree_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestors [n, n] bool, depths [n]) of the PARENTS tree."""
    return ancestors_and_depths(PARENTS)


def old_attention(query, keys, values, mask, scale):
    """The formulation the runner used before: one SDPA call with enable_gqa. [heads, n, head_dim]."""
    return F.scaled_dot_product_attention(
        query[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True
    )[0]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (8, 8), (6, 1)])
@pytest.mark.parametrize("kv_len", [37, 64, 203])
def test_attend_equals_the_gqa_call(num_heads, num_kv_heads, kv_len):
    gen = torch.Generator().manual_seed(kv_len)
    num_tokens, head_dim, capacity = 29, 16, 256
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).transpose(0, 1)  # as q_proj lays it
    cache_keys = torch.randn(num_kv_heads, capacity, head_dim, generator=gen)
    cache_values = torch.randn(num_kv_heads, capacity, head_dim, generator=gen)
    keys, values = cache_keys[:, :kv_len], cache_values[:, :kv_len]  # cache views: strided
    allowed = torch.rand(num_tokens, kv_len, generator=gen) < 0.4
    allowed[:, 0] = True  # every token sees at least one slot
    mask = additive_mask(allowed, torch.float32)
    got = attend(query, keys, values, mask, 0.3)  # [n, heads, head_dim]
    want = old_attention(query, keys, values, mask, 0.3)  # [heads, n, head_dim]
    torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-6, rtol=1e-5)



@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize(("start_slot", "num_tokens"), [(0, 1), (37, 1), (20, 29)])
def test_a_pass_views_write_and_attention_equal_write_view_and_attend(num_heads, num_kv_heads, start_slot, num_tokens):
    """What a layer of a pass does now (one copy into KVCache.pass_views' slot view, attend_heads over its
    row) equals what it did per layer before (KVCache.write, view, attend): the same cache bits and the
    same output bits."""
    gen = torch.Generator().manual_seed(start_slot + num_tokens)
    head_dim, layer = 16, 1
    caches = [KVCache(3, num_kv_heads, head_dim, 64, torch.float32, torch.device("cpu")) for _ in range(2)]
    filled = torch.randn(2, *caches[0].keys.shape, generator=gen)  # what earlier passes left in every slot
    for cache in caches:
        cache.keys.copy_(filled[0])
        cache.values.copy_(filled[1])
    # as an attention module lays them out: [1, n, heads, head_dim] transposed
    query = torch.randn(1, num_tokens, num_heads, head_dim, generator=gen).transpose(1, 2)
    key, value = torch.randn(2, 1, num_tokens, num_kv_heads, head_dim, generator=gen).transpose(2, 3)
    kv_len = start_slot + num_tokens
    allowed = torch.rand(num_tokens, kv_len, generator=gen) < 0.5
    allowed[:, -1] = True
    mask = additive_mask(allowed, torch.float32)

    caches[0].write(layer, start_slot, key[0], value[0])
    want = attend(query[0], *caches[0].view(layer, kv_len), mask, 0.3)  # [n, heads, head_dim]
    new_keys, new_values, keys, values = caches[1].pass_views(start_slot, num_tokens)
    row = caches[1].layer_rows[layer]
    new_keys[row].copy_(key)
    new_values[row].copy_(value)
    got = attend_heads(query, keys[row], values[row], mask, 0.3)  # [1, n, heads, head_dim]
    assert torch.equal(caches[1].keys, caches[0].keys) and torch.equal(caches[1].values, caches[0].values)
    assert torch.equal(got[0], want)

def test_additive_mask_rows_are_aligned_and_padding_masked():
    allowed = torch.rand(5, 37) < 0.5
    mask = additive_mask(allowed, torch.float16)
    assert mask.shape == (1, 1, 5, 37)
    assert all(stride % MASK_ALIGN == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    neg = torch.finfo(torch.float16).min
    assert torch.equal(mask[0, 0] == 0, allowed) and bool((mask[0, 0][~allowed] == neg).all())
    storage = mask.as_strided((5, mask.stride(-2)), (mask.stride(-2), 1))  # the padded rows
    assert bool((storage[:, 37:] == neg).all())


@pytest.mark.parametrize(("num_tokens", "start_slot"), [(1, 0), (7, 3), (16, 0), (33, 47)])
def test_causal_additive_mask_equals_the_general_one(num_tokens, start_slot):
    got = causal_additive_mask(num_tokens, start_slot, torch.float16, torch.device("cpu"))
    want = additive_mask(causal_allowed(num_tokens, start_slot, torch.device("cpu")), torch.float16)
    assert got.shape == want.shape and got.stride() == want.stride()
    rows = (num_tokens, got.stride(-2))
    assert torch.equal(got.as_strided(rows, (rows[1], 1)), want.as_strided(rows, (rows[1], 1)))  # padding too


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_and_prefill_logits_equal_transformers(arch, kv_heads, window):
    if window is not None and arch == "llama":
        pytest.skip("llama has no sliding window")
    model = build(arch, kv_heads, window)
    runner = DecoderRunner(model)
    assert runner.num_kv_heads == kv_heads
    assert (WINDOW in runner.windows) == (window is not None)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen)
    tree_ids = torch.randint(3, VOCAB, (len(PARENTS),), generator=gen)
    cache = runner.new_cache(64)
    prefill = runner.forward(prompt, torch.arange(PROMPT_LEN), cache, 0, causal_mask(PROMPT_LEN, 0, cache.device))
    cache.length = PROMPT_LEN
    ancestors, depths = tree_inputs()
    tree = runner.forward(tree_ids, PROMPT_LEN + depths, cache, PROMPT_LEN, prefix_tree_mask(ancestors, PROMPT_LEN))
    with torch.no_grad():
        torch.testing.assert_close(prefill, model(prompt[None]).logits[0], atol=TOL, rtol=TOL)
        for node in range(len(PARENTS)):
            path = torch.cat([prompt, tree_ids[path_of(PARENTS, node)]])
            torch.testing.assert_close(tree[node], model(path[None]).logits[0, -1], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("window", [None, WINDOW, 12])
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_layer_major_prefill_then_tree_equals_transformers(arch, window):
    """runner.prefill in chunks of 8 (a window of 12 binds only from the second chunk on), then a
    tree pass: every node's logits equal a plain forward of its path."""
    model = build(arch, 2, window)
    runner = DecoderRunner(model)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, VOCAB, (21,), generator=gen)
    tree_ids = torch.randint(3, VOCAB, (len(PARENTS),), generator=gen)
    cache = runner.new_cache(64)
    runner.prefill(prompt, cache, 8)
    cache.length = prompt.shape[0]
    ancestors, depths = tree_inputs()
    tree = runner.forward(tree_ids, 21 + depths, cache, 21, prefix_tree_mask(ancestors, 21))
    with torch.no_grad():
        for node in range(len(PARENTS)):
            path = torch.cat([prompt, tree_ids[path_of(PARENTS, node)]])
            torch.testing.assert_close(tree[node], model(path[None]).logits[0, -1], atol=TOL, rtol=TOL)


def test_attention_accepts_reports_the_kernels_of_this_device():
    runner = DecoderRunner(build("llama", 2, None))
    cache = runner.new_cache(64)
    cache.length = 20
    assert runner.attention_accepts(SDPBackend.MATH, cache, 9)
    assert runner.attention_accepts(attention_backends(cache.device)[0], cache, 9)
    if cache.device.type == "cpu":
        assert not runner.attention_accepts(SDPBackend.EFFICIENT_ATTENTION, cache, 9)  # CUDA-only kernel


@cuda
@pytest.mark.cuda
def test_efficient_kernel_takes_the_tree_pass_cuda():
    """CUDA-only: fp16 GQA, a tree of 2049 nodes over a 3000-slot context, the memory-efficient
    kernel alone: accepted, and the pass equals the default kernel choice."""
    device = torch.device("cuda")
    model = build("llama", 2, None).to(device, torch.float16)
    runner = DecoderRunner(model)
    cache = runner.new_cache(3000 + 2049)
    cache.length = 3000
    assert runner.attention_accepts(SDPBackend.EFFICIENT_ATTENTION, cache, 2049)
    ids = torch.randint(3, VOCAB, (64,), device=device)
    mask = causal_mask(64, 3000, device)
    want = runner.forward(ids, torch.arange(3000, 3064, device=device), cache, 3000, mask)
    runner.attention_backends = [SDPBackend.EFFICIENT_ATTENTION]
    got = runner.forward(ids, torch.arange(3000, 3064, device=device), cache, 3000, mask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
