"""Fill-in-the-middle on /v1/completions: each convention's prompt from a locally built tokenizer,
the FIM stop tokens, and the 400 naming `suffix` for a model without FIM tokens (openai SDK)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from server.fim import FimFormat, FimParts, fit
from tests.helpers.fake_engine import FakeEngine, tiny_tokenizer
from tests.helpers.tiny_models import CORPUS
from tests.helpers.tool_models import scripted_engine

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\n\ndef sub(a, b):\n    return a - b\n"

# convention: (prefix, suffix, middle, tokens the convention stops on beyond its markers)
BPE_CONVENTIONS = {
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|fim_pad|>", "<|endoftext|>", "<|file_sep|>")),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<|endoftext|>", "<file_sep>")),
    "deepseek": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ("<|EOT|>",)),
}


def fim_tokenizer(*special: str) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE test tokenizer with `special` added as special tokens."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    markers = BPE_CONVENTIONS["qwen"]
    return fim_tokenizer(*markers[:3], *markers[3])


def codellama_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Metaspace) BPE with BOS added on encode and CodeLlama's `▁<PRE>` specials."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]})
    return fast


@pytest.mark.parametrize("name", list(BPE_CONVENTIONS))
def test_bpe_conventions_build_the_psm_prompt(name: str) -> None:
    pre_tok, suf_tok, mid_tok, stops = BPE_CONVENTIONS[name]
    tokenizer = fim_tokenizer(pre_tok, suf_tok, mid_tok, *stops)
    fim = FimFormat.detect(tokenizer)
    assert fim is not None and fim.name == name
    # reference: the whole PSM string, tokenized at once (special tokens split the text)
    want = tokenizer.encode(f"{pre_tok}{PREFIX}{suf_tok}{SUFFIX}{mid_tok}", add_special_tokens=True)
    assert fim.prompt_ids(PREFIX, SUFFIX) == want
    markers = {tokenizer.convert_tokens_to_ids(t) for t in (pre_tok, suf_tok, mid_tok, *stops)}
    assert set(fim.stop_ids) == markers


def test_tokenizer_config_fim_order_spm_puts_the_prefix_last() -> None:
    """`"fim_order": "spm"` (the built-in pair's tokenizer config): PRE SUF suffix MID prefix, so the
    middle continues the prefix; an unknown order falls back to PSM."""
    pre_tok, suf_tok, mid_tok, _stops = BPE_CONVENTIONS["qwen"]
    tokenizer = qwen_tokenizer()
    tokenizer.init_kwargs["fim_order"] = "spm"
    fim = FimFormat.detect(tokenizer)
    assert fim is not None and fim.order == "spm"
    want = tokenizer.encode(f"{pre_tok}{suf_tok}{SUFFIX}{mid_tok}{PREFIX}", add_special_tokens=True)
    assert fim.prompt_ids(PREFIX, SUFFIX) == want
    tokenizer.init_kwargs["fim_order"] = "sideways"
    assert FimFormat.detect(tokenizer).order == "psm"


def test_codellama_convention_drops_the_space_before_the_suffix() -> None:
    tokenizer = codellama_tokenizer()
    fim = FimFormat.detect(tokenizer)
    assert fim is not None and fim.name == "codellama"
    ids = fim.prompt_ids("def f(x):\n    return", "x + 1\n")
    pre, suf, mid = (tokenizer.convert_tokens_to_ids(t) for t in ("▁<PRE>", "▁<SUF>", "▁<MID>"))
    assert ids[:2] == [tokenizer.bos_token_id, pre] and ids[-1] == mid
    cut = ids.index(suf)
    assert ids[2:cut] == tokenizer.encode("def f(x):\n    return", add_special_tokens=False)
    suffix_ids = ids[cut + 1 : -1]
    assert not tokenizer.convert_ids_to_tokens(suffix_ids[0]).startswith("▁")  # `<SUF>{suf}`: no space
    assert tokenizer.decode(suffix_ids) == "x + 1\n"
    assert tokenizer.convert_tokens_to_ids("▁<EOT>") in fim.stop_ids


def test_no_fim_tokens_detects_nothing() -> None:
    assert FimFormat.detect(tiny_tokenizer()) is None


def test_extra_context_uses_the_repo_pattern_when_the_tokens_exist() -> None:
    tokenizer = fim_tokenizer(*BPE_CONVENTIONS["qwen"][:3], "<|repo_name|>", "<|file_sep|>")
    fim = FimFormat.detect(tokenizer)
    assert fim is not None
    ids = fim.prompt_ids("x = ", "\n", extra=[("a.py", "A = 1\n")])
    want = "<|repo_name|>project\n<|file_sep|>a.py\nA = 1\n<|file_sep|>filename\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"
    assert tokenizer.decode(ids) == want
    plain = FimFormat.detect(fim_tokenizer(*BPE_CONVENTIONS["qwen"][:3]))
    assert plain is not None
    text = plain.tokenizer.decode(plain.prompt_ids("x = ", "\n", extra=[("a.py", "A = 1\n")]))
    assert text == "\n\n--- snippet ---\n\nA = 1\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"


def test_fit_cuts_extra_then_prefix_left_and_suffix_right() -> None:
    parts = FimParts(head=[0], extra=list(range(100, 150)), prefix=list(range(200, 260)), suffix=list(range(300, 340)))
    same, cut = fit(parts, 1000)
    assert same == parts and not cut
    no_extra, cut = fit(parts, 4 + 60 + 40 + 10)
    assert cut and no_extra.extra == list(range(140, 150)) and no_extra.prefix == parts.prefix
    small, cut = fit(parts, 4 + 40)
    assert cut and small.extra == [] and small.num_tokens() == 44
    assert small.prefix == parts.prefix[-30:] and small.suffix == parts.suffix[:10]


def test_completion_with_suffix_sends_the_fim_prompt_and_stops_on_fim_pad(fake_server: Callable) -> None:
    tokenizer = qwen_tokenizer()
    engine = scripted_engine(tokenizer, "a + b<|fim_pad|>never")
    srv = fake_server(engine)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="fake-model", prompt=PREFIX, suffix=SUFFIX, max_tokens=20)
    assert out.choices[0].text == "a + b" and out.choices[0].finish_reason == "stop"
    request = engine.requests[-1]
    fim = FimFormat.detect(tokenizer)
    assert fim is not None
    assert request.prompt_ids == tokenizer.encode(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert set(fim.stop_ids) <= set(request.params.stop_token_ids)
    plain = client.completions.create(model="fake-model", prompt=PREFIX, max_tokens=3)  # no suffix: no FIM
    assert engine.requests[-1].prompt_ids == tokenizer.encode(PREFIX) and plain.choices[0].text


def test_suffix_without_fim_tokens_is_a_400_naming_suffix(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt=PREFIX, suffix=SUFFIX, max_tokens=5)
    assert info.value.param == "suffix" and "fill-in-the-middle" in info.value.message
    empty = client.completions.create(model="fake-model", prompt=PREFIX, suffix="", max_tokens=3)
    assert empty.choices[0].text  # an empty suffix is a plain completion


def test_suffix_with_token_ids_prompt_is_a_400(fake_server: Callable) -> None:
    srv = fake_server(scripted_engine(qwen_tokenizer(), "x"))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt=[1, 2, 3], suffix=SUFFIX, max_tokens=5)
    assert info.value.param == "suffix"
