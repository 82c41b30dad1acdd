"""The built-in pair's training corpus, as build_default makes it and model_card describes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast


@dataclass
class Corpus:
    tokenizer: PreTrainedTokenizerFast
    train_ids: torch.Tensor  # int32 [n_train_tokens]
    train_is_target: torch.Tensor  # bool [n_train_tokens]: False for a token just before a cursor cut
    heldout_ids: torch.Tensor  # int32 [n_heldout_tokens]
    heldout_texts: list[str]
    train_files: int
    heldout_files: int
    train_bytes: int
    fim_examples: int
    cut_documents: int  # train files cut at cursors
    cuts: int  # cursor cuts in them
    seconds: float
