"""A target/draft pair whose target vocabulary is padded further than the draft's embedding, as
Qwen2.5-72B (152064 rows) and Qwen2.5-1.5B (151936 rows) are past their tokenizer (151665 ids).

The target favours ids in its padded region: their head rows are scaled copies of real tokens' rows,
so it emits ids the draft cannot embed whenever one of those tokens would win."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_models import build_model, build_tokenizer, save_checkpoint

DRAFT_PAD = 16  # draft embedding rows past the tokenizer
TARGET_PAD = 48  # target rows past the tokenizer: ids [tokenizer + 16, tokenizer + 48) only the target has


def make_padded_pair(folder: Path) -> tuple[str, str, int]:
    """(target folder, draft folder, draft embedding rows); the draft is the target cut to its rows."""
    tokenizer = build_tokenizer()
    num_tokens = len(tokenizer)
    target = build_model("qwen2", num_tokens + TARGET_PAD, seed=31, eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        head = target.lm_head.weight  # [vocab, hidden]
        padded = torch.arange(num_tokens + DRAFT_PAD, num_tokens + TARGET_PAD)
        head[padded] = head[3 : 3 + padded.numel()] * 1.3  # beats the real token whenever that one would win
    draft_rows = num_tokens + DRAFT_PAD
    draft = build_model("qwen2", draft_rows, seed=32, eos_token_id=tokenizer.eos_token_id)
    draft.load_state_dict({name: value[:draft_rows] if value.shape[0] == num_tokens + TARGET_PAD else value
                           for name, value in target.state_dict().items()})
    target_dir = save_checkpoint(target, tokenizer, Path(folder) / "target")
    draft_dir = save_checkpoint(draft, tokenizer, Path(folder) / "draft")
    return str(target_dir), str(draft_dir), draft_rows


def prompts(draft_rows: int) -> list[list[int]]:
    """Token-id prompts; the second holds an id past the draft's embedding."""
    return [[5, 6, 7, 8], [40, 41, draft_rows + 5, 43, 44], [90, 12, 100, 7, 33, 21]]
