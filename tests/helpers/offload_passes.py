"""Streamed-runner helpers shared by the offload and GPTQ tests: build a streamed target, and run one
prefill pass plus one tree pass whose logits the tests compare with the resident target's; the
greedy reference (the model alone, through transformers' generate)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig, OffloadConfig
from engine.model import checkpoint
from engine.model.runner import DecoderRunner
from engine.offload.build import build_offloaded_runner
from engine.speculation.tree import causal_mask, prefix_tree_mask

CPU = torch.device("cpu")


def streamed_runner(target: str, device: torch.device = CPU, kernel: str = "dequantize", **offload_fields) -> DecoderRunner:
    cfg = EngineConfig(
        model=ModelConfig(target=target), offload=OffloadConfig(enabled=True, **offload_fields)
    )
    return build_offloaded_runner(checkpoint.load_model(target, torch.float32, gptq_kernel=kernel), cfg, device)


def run_passes(runner: DecoderRunner, device: torch.device = CPU) -> list[torch.Tensor]:
    """A prefill pass over 9 prompt tokens, then a tree pass (7 nodes) on top; logits of both."""
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, runner.vocab_size, (9,), generator=gen).to(device)
    cache = runner.new_cache(32)
    prefill = runner.forward(prompt_ids, torch.arange(9, device=device), cache, 0, causal_mask(9, 0, device))
    cache.length = 9
    parents = [-1, 0, 0, 1, 1, 2, 4]  # node i's parent; depth grows along each path
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3], device=device)
    ancestors = torch.eye(7, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    tree_ids = torch.randint(3, runner.vocab_size, (7,), generator=gen).to(device)
    mask = prefix_tree_mask(ancestors.to(device), 9)
    tree = runner.forward(tree_ids, 9 + depths, cache, 9, mask)
    return [prefill, tree]


def reference_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """The loaded model alone, through transformers' generate: greedy, no EOS stop."""
    out = model.eval().generate(
        torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.cpu() - w.cpu()).abs().max() <= 1e-6
