"""The training stream of `specexec build-default`: a document's parts are tokenized apart, as the server
tokenizes a prompt that ends at a cursor, and the token before a cut is no training target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from builder.training import IGNORE, batches, encode_stream

TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "default" / "target"

pytestmark = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").exists(), reason="models/default is missing")


@pytest.fixture(scope="module")
def tok() -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_parts_are_tokenized_as_a_prompt_and_its_continuation(tok: AutoTokenizer) -> None:
    prompt, rest = "def f(x):\n    ", "return x\n"
    whole, _ = encode_stream(tok, [(prompt + rest,)])
    cut, is_target = encode_stream(tok, [(prompt, rest)])
    as_served = tok(prompt)["input_ids"]  # BOS + the prompt alone, as the server encodes it
    assert cut.tolist() == [*as_served, *tok.encode(rest, add_special_tokens=False), tok.eos_token_id]
    assert cut.tolist() != whole.tolist()  # the indentation's last space joins `return` in the whole text
    assert tok.decode(cut, skip_special_tokens=True) == tok.decode(whole, skip_special_tokens=True)
    cursor = len(as_served) - 1  # the prompt's last token, the indentation token
    assert is_target.tolist() == [i != cursor for i in range(len(cut))]


def test_documents_are_bos_text_eos_and_whole_ones_are_all_targets(tok: AutoTokenizer) -> None:
    ids, is_target = encode_stream(tok, [("a = 1\n",), ("<|fim_prefix|><|fim_suffix|>\n<|fim_middle|>b", " = 2"), ("",)])
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert ids.dtype == torch.int32 and ids.tolist().count(bos) == 3 and ids.tolist().count(eos) == 3
    assert ids[0] == bos and ids[-2:].tolist() == [bos, eos]
    assert (~is_target).sum() == 1  # the FIM prompt's last token


def test_batches_ignore_labels_before_a_cut() -> None:
    ids = torch.arange(40, dtype=torch.int32)
    is_target = torch.ones(40, dtype=torch.bool)
    is_target[torch.arange(0, 40, 5)] = False
    inputs, labels = next(batches(ids, is_target, batch_size=3, seq_len=8, seed=0))
    assert inputs.shape == labels.shape == (3, 8) and inputs.dtype == labels.dtype == torch.int64
    expected = inputs + 1
    assert torch.equal(labels, expected.masked_fill(expected % 5 == 0, IGNORE))
