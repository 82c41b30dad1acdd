"""What the GPU check builds and measures: the sizes of one run (the full one, or the tiny CPU test)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EXTENSION_FACTOR


@dataclass(frozen=True)
class DraftVariant:
    """How the draft runs in a set of full-shape step rows (each variant runs every budget x overlap x streams)."""

    name: str  # the rows' label
    graphs: bool = True  # its forwards as CUDA graphs (--draft-graphs)
    host_trees: bool = False  # SpecExec trees grown on the host (--host-trees)
    extension_factor: int = EXTENSION_FACTOR  # overlap extensions grow to this many times the budget (an
    # attention-only draft's default)
    fresh_forwards: int = 0  # beside seeded trees, a fresh tree's draft forwards before the pass (0: no cap)
    versus: str | None = None  # the variant whose rows its verdict compares with (None: the first, the baseline)


@dataclass(frozen=True)
class FullShape:
    """The full-shape section: a Llama-3-70B-shaped 4-bit target (every layer streamed from pinned RAM)
    beside a Llama-3.2-1B-shaped draft, under a 24 GB card's memory."""

    num_layers: int = 80
    hidden: int = 8192
    mlp: int = 28672
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    group_size: int = 128
    vocab_size: int = 128256
    draft_layers: int = 16
    draft_hidden: int = 2048
    draft_mlp: int = 8192
    draft_heads: int = 32
    draft_kv_heads: int = 8
    draft_head_dim: int = 64
    memory_cap_gb: float = 23.0  # the caching allocator's cap (a 24 GB card, less the CUDA context)
    budgets: tuple[int, ...] = (256, 1024)
    streams: tuple[int, ...] = (1, 4)
    # the first variant is the baseline the others are compared with (the defaults); in order of worth: with
    # --seconds, those the time left cannot hold are not run (why these: docs/bench/gpu.md, runs 3-6)
    variants: tuple[DraftVariant, ...] = (DraftVariant("graphs"), DraftVariant("graphs, fresh 8", fresh_forwards=8),
                                          DraftVariant("graphs, 2x extension", extension_factor=2),
                                          DraftVariant("graphs, host trees", host_trees=True))
    prompt_len: int = 64  # each stream's prompt
    warmup_steps: int = 2  # steps before the measured ones (each stream's prefill, a seed to grow from)
    measured_steps: int = 3
    join_len: int = 3800  # the prompt that joins a running stream
    join_steps_before: int = 3
    max_context: int = 4096  # join_len, the tokens after it and a tree
    kernel_tokens: tuple[int, ...] = (1, 16, 64, 257, 1025, 2049)  # int4 vs dequantize, rows per call
    autoregressive_steps: int = 3


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
    full: FullShape = FullShape()

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
    full=FullShape(
        num_layers=3, hidden=64, mlp=256, num_heads=4, num_kv_heads=2, head_dim=16, group_size=32,
        vocab_size=512, draft_layers=1, draft_hidden=32, draft_mlp=64, draft_heads=2, draft_kv_heads=1,
        draft_head_dim=16, budgets=(8, 16), streams=(1, 2), prompt_len=8, warmup_steps=1, measured_steps=2,
        join_len=150, join_steps_before=2, max_context=256, kernel_tokens=(1, 17), autoregressive_steps=2,
        variants=(DraftVariant("eager", graphs=False), DraftVariant("graphs, 8x extension, host trees", host_trees=True,
                                                                     extension_factor=8)),
    ),
)
