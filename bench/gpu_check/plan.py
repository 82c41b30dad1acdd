"""What the GPU check builds and measures: the sizes of one run (the full one, or the tiny CPU test)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    # target: Llama decoder layers of Llama-3-70B's shape (1.71 GB each in bf16)
    num_layers: int = 4
    hidden: int = 8192
    mlp: int = 28672
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 128256
    # draft: a small random Llama over the same vocabulary
    draft_layers: int = 2
    draft_hidden: int = 1024
    draft_mlp: int = 2816
    seed: int = 0
    copy_reps: int = 5  # plain copies of one layer; the best counts
    prefill_len: int = 1536  # equality: prompt tokens (several engine prefill chunks)
    tree_nodes: int = 2049  # equality: nodes of the tree pass (root included)
    stall_factor: float = 2.0  # slowed compute: each layer's compute stalls this many times its copy time
    max_stall_s: float = 1.0  # ... but at most this long
    overlap_tokens: tuple[int, ...] = (1, 256, 1024, 2048)
    overlap_passes: int = 3
    overlap_rounds: int = 2
    context_len: int = 8192  # engine steps: prompt tokens filling the context
    budgets: tuple[int, ...] = (1024, 2048)
    disk_layers: int = 2  # layers read per round
    disk_rounds: int = 2  # (a round over DISK_SLOW_S seconds ends the rounds)
    pad_to_gb: float = 4.0  # bench row: the built-in target padded to about this many GB (fp32)
    bench_budget: int = 256
    bench_prompts: int = 2
    bench_tokens: int = 32
    serving_prompts: int = 8  # serving: code prompts, all in one target pass together
    serving_tokens: int = 48

    @property
    def layer_shape(self) -> str:
        return (
            f"hidden {self.hidden}, MLP {self.mlp}, {self.num_heads}/{self.num_kv_heads} heads of "
            f"{self.head_dim}, vocab {self.vocab_size}"
        )


FULL = Plan()

TINY = Plan(  # CPU test mode: every section's logic in seconds
    num_layers=3,
    hidden=64,
    mlp=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=512,
    draft_layers=1,
    draft_hidden=64,
    draft_mlp=128,
    copy_reps=2,
    prefill_len=600,
    max_stall_s=0.005,
    tree_nodes=65,
    overlap_tokens=(1, 8, 32),
    overlap_passes=1,
    overlap_rounds=1,
    context_len=200,
    budgets=(8, 16),
    disk_rounds=1,
    pad_to_gb=0.01,
    bench_budget=8,
    bench_prompts=1,
    bench_tokens=6,
    serving_prompts=2,
    serving_tokens=8,
)
