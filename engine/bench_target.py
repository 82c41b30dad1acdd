"""A seeded random Llama with few, wide decoder layers: the offload benchmark's default target.

Real offloaded targets have layers of 0.4-1.7 GB; hundreds of tiny layers would measure per-op
overhead instead of bandwidth. hidden 1024 and MLP 8192 give 117 MB per fp32 layer; the small
vocabulary keeps the resident head cheap. Built in seconds, no downloads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def bench_config(
    num_layers: int = 4, hidden: int = 1024, mlp: int = 8192, vocab_size: int = 4096
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_bench_target(folder: Path, seed: int = 0, num_layers: int = 4) -> tuple[Path, int]:
    """Write the checkpoint to `folder`; returns it and its decoder layers' total bytes (fp32)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(bench_config(num_layers)).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    return folder, layer_bytes
