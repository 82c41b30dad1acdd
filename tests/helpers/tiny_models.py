"""Tiny Hugging Face checkpoints built in milliseconds from a config, for tests.

`make_tiny_pair(folder)` writes target/ and draft/ folders with config, safetensors weights and a
shared byte-level BPE tokenizer (with a chat template), exactly as a real local checkpoint looks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.helpers.family_configs import family_config

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|end|>", "<|bos|>", "<|pad|>"]

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. Hello, world! Ünïcödé ✓ 日本語",
    "import os\nimport sys\nprint(os.path.join('a', 'b'), sys.argv)\n",
] * 4


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", bos_token="<|bos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(
    arch: str,
    vocab_size: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    eos_token_id: int = 0,
    init_range: float = 1.0,
    max_positions: int = 512,
):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,  # the engine's default max_context
        initializer_range=init_range,  # spiky logits: floating-point ties stay rare
        eos_token_id=eos_token_id,
        bos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    return family_config(arch, common)


def build_model(arch: str, vocab_size: int, seed: int, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A draft that mostly agrees with `model`: its weights plus Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())
    return copy


def save_checkpoint(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, folder: Path, max_shard_size: str | None = None
) -> Path:
    """max_shard_size: sharded safetensors with an index, as hub checkpoints are (None: one file)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(folder)
    return folder


def make_tiny_pair(
    folder: Path, arch: str = "llama", draft: str = "random", seed: int = 0, max_shard_size: str | None = None,
    **kwargs,
) -> tuple[Path, Path]:
    """Write target/ and draft/ checkpoints; draft is 'random', 'same' or 'noisy' (a noisy copy: a draft
    of the target's family). max_shard_size: save sharded, with an index, as the hub does."""
    tokenizer = build_tokenizer()
    vocab_size = len(tokenizer)
    target = build_model(arch, vocab_size, seed, eos_token_id=tokenizer.eos_token_id, **kwargs)
    if draft == "same":
        draft_model = target
    elif draft == "noisy":
        draft_model = noisy_copy(target, 0.1, seed + 1)
    else:
        draft_model = build_model("llama", vocab_size, seed + 1, eos_token_id=tokenizer.eos_token_id, hidden=32)
    return (
        save_checkpoint(target, tokenizer, Path(folder) / "target", max_shard_size),
        save_checkpoint(draft_model, tokenizer, Path(folder) / "draft", max_shard_size),
    )
