"""A seeded random Llama with few, wide decoder layers: the offload and quantization benchmarks' target.

Real offloaded targets have layers of 0.4-1.7 GB; hundreds of tiny layers would measure per-op
overhead instead of bandwidth. hidden 1024 and MLP 8192 give 117 MB per fp32 layer; the vocabulary
is the default model's (4096 tokens), whose tokenizer files are copied in, so tools that expect a
complete checkpoint (gptqmodel's quantizer) accept it. Built in seconds, no downloads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.cli import DEFAULT_MODELS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 4096  # the default model's tokenizer
DEFAULT_SHAPE = {"num_layers": 4, "hidden": 1024, "mlp": 8192, "seed": 0}  # `bench quant` defaults
DONE_FILE = "built.json"  # written last: a folder without it is an interrupted build


def bench_config(
    num_layers: int = 4, hidden: int = 1024, mlp: int = 8192, vocab_size: int = VOCAB_SIZE
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_bench_target(
    folder: Path,
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 1024,
    mlp: int = 8192,
    dtype: torch.dtype = torch.float32,
) -> tuple[Path, int]:
    """Write the checkpoint (weights in `dtype`) to `folder`; returns it and its decoder layers' bytes.

    The same seed and shape give the same weights whatever the dtype (drawn in fp32, then cast)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(bench_config(num_layers, hidden, mlp)).to(torch.float32).eval()
    model = model.to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy2(DEFAULT_MODELS / "target" / name, folder / name)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    return folder, layer_bytes


def cache_key(shape: dict[str, int], precision: str, extra: tuple = ()) -> str:
    """A folder name for one built checkpoint: shape, precision and a digest of everything it depends on."""
    fields = [shape["num_layers"], shape["hidden"], shape["mlp"], VOCAB_SIZE, shape["seed"], precision, *extra]
    digest = hashlib.sha256("|".join(map(str, fields)).encode()).hexdigest()[:12]
    return f"{precision}-{shape['num_layers']}x{shape['hidden']}x{shape['mlp']}-{digest}"


def is_built(folder: Path) -> bool:
    return (folder / DONE_FILE).is_file()


def mark_built(folder: Path, precision: str, shape: dict[str, int]) -> Path:
    (folder / DONE_FILE).write_text(json.dumps({"precision": precision, **shape}, indent=2))
    return folder


def cached_float_target(root: Path, shape: dict[str, int], precision: str, dtype: torch.dtype) -> Path:
    """The checkpoint of `shape` in `dtype` under `root`, built first if absent."""
    folder = root / cache_key(shape, precision)
    if not is_built(folder):
        shutil.rmtree(folder, ignore_errors=True)
        build_bench_target(folder, dtype=dtype, **shape)
        mark_built(folder, precision, shape)
    return folder
