"""A tiny reasoning model that thinks before it answers: the tiny tokenizer with `<think>` and `</think>`
as added tokens (as Qwen3's and DeepSeek-R1's), a chat template that names them (Qwen3's way: with
`enable_thinking: false` the generation prompt closes an empty block), and Llama checkpoints that are
bigram models, so what the model prefers is known.

A bigram Llama: the embedding of token t is the t-th unit vector, every layer's output projections
(attention's o_proj, the MLP's down_proj) are zero, so the last hidden state is the final norm of that unit
vector, sqrt(hidden) * e_t; lm_head's column t is then the next-token logits after t, `table[t]`.
`table` is Gaussian noise (a fixed argmax among any allowed tokens) with `SCRIPT`'s pairs far above it:
after the generation prompt's last token ("\\n") the model writes `<think>`, then "Pick red.", `</think>`
and "{" (after that, under a JSON grammar, its noise picks the values). The draft is a bigram model
with the same script and other noise, so it disagrees with the target off the script.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.tiny_models import build_tokenizer, save_checkpoint, tiny_config

OPEN, CLOSE = "<think>", "</think>"
THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
REASONING = "Pick red."  # distinct tokens in the tiny vocabulary: a bigram can spell it
SCRIPT = "\n" + OPEN + REASONING + CLOSE + "{"  # each token's successor, in order
PREFERRED_LOGIT = 12.0  # a scripted successor's logit; the noise is N(0, 1)


def think_tokenizer():
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens([OPEN, CLOSE])
    tokenizer.chat_template = THINK_TEMPLATE
    return tokenizer


def bigram_table(tokenizer, seed: int) -> torch.Tensor:
    """[vocab, vocab] next-token logits given the current token: noise, SCRIPT's pairs at PREFERRED_LOGIT."""
    vocab_size = len(tokenizer)
    table = torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(seed))
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert len(set(ids[:-1])) == len(ids) - 1, "a bigram gives each token one successor"
    for current, following in zip(ids, ids[1:], strict=False):
        table[current, following] = PREFERRED_LOGIT
    return table


def bigram_model(table: torch.Tensor, eos_token_id: int, max_positions: int) -> torch.nn.Module:
    vocab_size = table.shape[0]
    hidden = 64 * math.ceil(vocab_size / 64)  # room for a unit vector per token
    config = tiny_config("llama", vocab_size, hidden=hidden, layers=1, eos_token_id=eos_token_id,
                         max_positions=max_positions)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab_size] = torch.eye(vocab_size)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab_size] = table.T / math.sqrt(hidden)  # [vocab, hidden]
    return model


def make_think_pair(folder: Path, seed: int = 0, max_positions: int = 512) -> tuple[Path, Path]:
    """target/ and draft/ checkpoints of the thinking bigram model (draft: other noise, same script)."""
    tokenizer = think_tokenizer()
    eos = tokenizer.eos_token_id
    target = bigram_model(bigram_table(tokenizer, seed), eos, max_positions)
    draft = bigram_model(bigram_table(tokenizer, seed + 1), eos, max_positions)
    return (save_checkpoint(target, tokenizer, Path(folder) / "target"),
            save_checkpoint(draft, tokenizer, Path(folder) / "draft"))
