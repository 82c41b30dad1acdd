"""The default-pair builder at toy scale, and the committed models/default pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from builder import build_default
from builder.training import ROLE_TOKENS, SPECIAL_TOKENS

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PAIR = REPO / "models" / "default"


@pytest.fixture(scope="module")
def toy_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default_pair")
    assert build_default.main(["--toy", "--threads", "1", "--out", str(out)]) == 0
    return out


def _check_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|eos|>" and tok.eos_token_id is not None
    assert tok.bos_token == "<|bos|>" and tok.chat_template
    for special in SPECIAL_TOKENS:  # never split, even glued to text
        ids = tok("x" + special + "y", add_special_tokens=False)["input_ids"]
        assert tok.convert_tokens_to_ids(special) in ids
    messages = [{"role": "user", "content": "def f():"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|><|user|>\ndef f():<|eos|>\n") and text.endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids
    assert tok.convert_tokens_to_ids(ROLE_TOKENS[2]) in ids
    return tok


def _check_pair(out: Path) -> None:
    tokenizers = [_check_tokenizer(out / role) for role in ("target", "draft")]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    assert (out / "target" / "tokenizer.json").read_bytes() == (out / "draft" / "tokenizer.json").read_bytes()
    params = {}
    for role in ("target", "draft"):
        config = json.loads((out / role / "config.json").read_text())
        assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
        assert config.get("dtype", config.get("torch_dtype")) in ("float16", "bfloat16")
        gen = json.loads((out / role / "generation_config.json").read_text())
        assert gen["eos_token_id"] == tokenizers[0].eos_token_id
        model = AutoModelForCausalLM.from_pretrained(out / role, dtype=torch.float32)
        params[role] = sum(p.numel() for p in model.parameters())
        ids = tokenizers[0]("def f(x):\n", return_tensors="pt")["input_ids"]  # [1, n]
        logits = model(input_ids=ids).logits  # [1, n, V]
        assert logits.shape[-1] >= len(tokenizers[0]) and torch.isfinite(logits).all()
    assert params["draft"] * 5 <= params["target"]
    card = (out / "MODEL_CARD.md").read_text()
    assert "Target loss" in card and "Draft loss" in card and "agreement" in card
    assert "Fill-in-the-middle" in card and "<|fim_prefix|>" in card


@pytest.mark.slow
def test_toy_build_outputs_load(toy_build: Path) -> None:
    _check_pair(toy_build)


def test_toy_build_continues_from_an_existing_pair(toy_build: Path, tmp_path: Path) -> None:
    out = tmp_path / "continued"
    flags = ["--toy", "--threads", "1", "--init-from", str(toy_build), "--out", str(out)]
    assert build_default.main([*flags, "--target-steps", "2", "--draft-steps", "2"]) == 0
    _check_pair(out)
    assert (out / "target" / "tokenizer.json").read_bytes() == (toy_build / "target" / "tokenizer.json").read_bytes()
    assert "is_local" not in (out / "target" / "tokenizer_config.json").read_text()
    card = (out / "MODEL_CARD.md").read_text()
    assert "## Earlier training" in card and "### Command" in card and f"--out {toy_build}" in card
    assert "continued from" in card and "Tokenized at the cursor" in card
    with pytest.raises(ValueError, match="--target-hidden 48"):
        build_default.main([*flags, "--target-hidden", "48"])


def test_committed_default_pair_loads() -> None:
    assert (DEFAULT_PAIR / "MODEL_CARD.md").exists(), "run `specexec build-default` to create models/default"
    _check_pair(DEFAULT_PAIR)
    size = sum(f.stat().st_size for f in DEFAULT_PAIR.rglob("*") if f.is_file())
    assert size <= 50_000_000
