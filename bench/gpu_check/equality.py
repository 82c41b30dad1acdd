"""Streamed vs resident: the same kernels on the same bytes, so the logits must be equal bit for bit.

For ring sizes 2 and 3, with compute as it is and slowed below copy speed (each layer first stalls
longer than its copy takes, so every load waits for a slot still being read: the ring's event
ordering is what keeps the bytes right), compare with the resident target: the logits of a plain
causal pass over a prompt, the KV cache the engine's prefill writes for it, and the logits of one
random tree pass over that prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.gpu_check.context import CheckContext
from bench.gpu_check.links import best_copy_seconds
from bench.gpu_check.probes import release_memory, seconds_of, slowed_layers
from bench.offload import streamed_runner
from engine.model import checkpoint
from engine.model.runner import DecoderRunner
from engine.offload.device import empty_buffer, empty_host
from engine.speculation.step import prefill
from engine.speculation.tree import append_nodes, causal_mask, prefix_tree_mask

RING_SIZES = (2, 3)
LEVELS = 16  # the random tree grows in this many batches of children


@dataclass
class RandomTree:
    token_ids: torch.Tensor  # [n] long
    depths: torch.Tensor  # [n] long, 0 at the root
    ancestors: torch.Tensor  # [n, n] bool, ancestors[i, j]: j is i or an ancestor of i


@dataclass
class PassResults:
    prefill_logits: torch.Tensor  # [prompt_len, vocab] one causal pass over the prompt
    cache_kv: torch.Tensor  # [layers, 2, kv_heads, prompt_len, head_dim] after the engine's prefill
    tree_logits: torch.Tensor  # [n, vocab] the tree pass over that prefix
    tree_seconds: float


def random_tree(
    num_nodes: int, vocab_size: int, generator: torch.Generator, device: torch.device
) -> RandomTree:
    """Children of uniformly chosen earlier nodes, added in LEVELS batches (host, seeded)."""
    batch = max(1, num_nodes // LEVELS)
    ancestors = torch.ones(1, 1, dtype=torch.bool)
    depths = torch.zeros(1, dtype=torch.long)
    while ancestors.shape[0] < num_nodes:
        count = min(batch, num_nodes - ancestors.shape[0])
        parents = torch.randint(0, ancestors.shape[0], (count,), generator=generator)
        ancestors = append_nodes(ancestors, parents)
        depths = torch.cat([depths, depths[parents] + 1])
    token_ids = torch.randint(0, vocab_size, (num_nodes,), generator=generator)
    return RandomTree(token_ids.to(device), depths.to(device), ancestors.to(device))


def run_passes(runner: DecoderRunner, prompt_ids: torch.Tensor, tree: RandomTree) -> PassResults:
    device, prompt_len = runner.device, prompt_ids.shape[0]
    cache = runner.new_cache(prompt_len)
    positions = torch.arange(prompt_len, device=device)
    prefill_logits = runner.forward(prompt_ids, positions, cache, 0, causal_mask(prompt_len, 0, device))
    cache = runner.new_cache(prompt_len + tree.token_ids.shape[0])
    prefill(runner, cache, prompt_ids.tolist())
    cache_kv = torch.stack(
        [torch.stack(cache.view(idx, prompt_len)) for idx in range(runner.layers.num_layers)]
    )
    start = cache.length
    mask = prefix_tree_mask(tree.ancestors, start)
    out: list[torch.Tensor] = []
    seconds = seconds_of(
        device, lambda: out.append(runner.forward(tree.token_ids, start + tree.depths, cache, start, mask))
    )
    return PassResults(prefill_logits, cache_kv, out[0], seconds)


def difference(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    if torch.equal(got, want):
        return True, "exact"
    return False, f"max abs diff {(got.float() - want.float()).abs().max().item():.3g}"


def layer_copy_seconds(ctx: CheckContext) -> float:
    """One target layer's plain copy: from the copy section, or measured here."""
    nbytes = ctx.built().layer_bytes
    if "copy_bytes_per_s" in ctx.facts:
        return nbytes / ctx.facts["copy_bytes_per_s"]
    return best_copy_seconds(empty_buffer(nbytes, ctx.device), empty_host(nbytes).fill_(1), 3)


def equality_section(ctx: CheckContext) -> None:
    plan, device, report = ctx.plan, ctx.device, ctx.report
    target = str(ctx.built().target)
    generator = torch.Generator().manual_seed(plan.seed)
    prompt_ids = torch.randint(0, plan.vocab_size, (plan.prefill_len,), generator=generator).to(device)
    tree = random_tree(plan.tree_nodes, plan.vocab_size, generator, device)
    resident = DecoderRunner(checkpoint.load_model(target, ctx.dtype, device))
    want = run_passes(resident, prompt_ids, tree)
    del resident
    release_memory(device)
    stall = min(plan.stall_factor * layer_copy_seconds(ctx), plan.max_stall_s)
    report.line(
        f"Prompt {plan.prefill_len} tokens, tree {plan.tree_nodes} nodes (depth {int(tree.depths.max())}); "
        f"resident tree pass {want.tree_seconds * 1e3:.0f} ms. Slowed: each layer stalls "
        f"{stall * 1e3:.1f} ms (the smaller of {plan.stall_factor:g} x its copy time and "
        f"{plan.max_stall_s:g} s) "
        "before computing."
    )
    report.table(
        "ring",
        "compute",
        "prefill pass logits",
        "engine prefill KV",
        "tree pass logits",
        "tree pass ms",
        "status",
    )
    for ring_size in RING_SIZES:
        runner = streamed_runner(target, "ram", ring_size, device, ctx.dtype)
        try:
            for slowed in (False, True):
                compare_variant(ctx, runner, ring_size, slowed, stall, prompt_ids, tree, want)
        finally:
            runner.layers.close()
            del runner
            release_memory(device)


def compare_variant(
    ctx: CheckContext,
    runner: DecoderRunner,
    ring_size: int,
    slowed: bool,
    stall: float,
    prompt_ids: torch.Tensor,
    tree: RandomTree,
    want: PassResults,
) -> None:
    report = ctx.report
    label = "slowed below copy" if slowed else "as is"
    stalls = [0]
    if slowed:
        with slowed_layers(runner.hf_layers, stall, ctx.device) as stalls:
            got = run_passes(runner, prompt_ids, tree)
    else:
        got = run_passes(runner, prompt_ids, tree)
    checks = [
        difference(got.prefill_logits, want.prefill_logits),
        difference(got.cache_kv, want.cache_kv),
        difference(got.tree_logits, want.tree_logits),
    ]
    status = "exact" if all(ok for ok, _ in checks) else "MISMATCH"
    if slowed and stalls[0] == 0:
        status = "MISMATCH (the stall hook never ran: compute was not slowed)"
    if status != "exact":
        report.mismatch(f"ring {ring_size}, {label}")
    report.row(ring_size, label, *(text for _, text in checks), f"{got.tree_seconds * 1e3:.0f}", status)
