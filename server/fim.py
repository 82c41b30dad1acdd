"""Fill-in-the-middle prompts from a tokenizer's FIM special tokens (PSM order, or SPM on request).

Conventions, detected from the vocabulary in this order:

- qwen: `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>` (Qwen2.5-Coder, CodeGemma, the built-in
  pair); stops on `<|fim_pad|>`, `<|endoftext|>`, `<|file_sep|>`, `<|file_separator|>`,
  `<|repo_name|>`; repository context with `<|repo_name|>` and `<|file_sep|>`.
- starcoder: `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>` (StarCoder, StarCoder2); stops on
  `<fim_pad>`, `<|endoftext|>`, `<file_sep>`; repository context with `<repo_name>` and `<file_sep>`.
- deepseek: `<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>` (DeepSeek-Coder); stops on `<|EOT|>`.
- codellama: `▁<PRE>`, `▁<SUF>`, `▁<MID>` (or without `▁`); stops on `▁<EOT>`. The suffix is encoded
  without SentencePiece's leading space, as `<PRE> {pre} <SUF>{suf} <MID>` spells it.

Order: prefix-suffix-middle (`PRE prefix SUF suffix MID`, what these models are trained on), unless the
tokenizer config says `"fim_order": "spm"` (the built-in pair): suffix-prefix-middle in the
Bavarian et al. form `PRE SUF suffix MID prefix`, where the middle continues the prefix directly.

Every convention also stops on its own three markers (they never occur inside a middle). The prompt
is built in token ids: the tokenizer's own leading specials (BOS), then the extra context, then
the markers and pieces in the model's order, each text piece encoded alone (special tokens split the
text first, so this equals encoding the joined string for byte-level BPE).

Extra context (llama.cpp's `input_extra`): with repository tokens, `<repo>project\\n` then
`<file_sep>{filename}\\n{text}` per chunk and `<file_sep>filename\\n` for the file being edited;
without them each chunk is `\\n\\n--- snippet ---\\n\\n{text}`. Either way it goes before the prefix marker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
PROJECT_NAME = "project"
CURRENT_FILE = "filename"
ORDERS = ("psm", "spm")
PREFIX_SHARE = 0.75  # when a prompt must be cut: the prefix keeps up to 3/4 of the room (llama.cpp's ratio)


@dataclass(frozen=True)
class FimConvention:
    name: str
    prefix: tuple[str, ...]  # accepted spellings of each marker, first match wins
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    stops: tuple[str, ...] = ()
    repo: str | None = None
    file_sep: str | None = None
    suffix_without_space: bool = False  # SentencePiece: drop the implied space before the suffix


CONVENTIONS = (
    FimConvention("qwen", ("<|fim_prefix|>",), ("<|fim_suffix|>",), ("<|fim_middle|>",),
                  ("<|fim_pad|>", "<|endoftext|>", "<|file_sep|>", "<|file_separator|>", "<|repo_name|>"),
                  repo="<|repo_name|>", file_sep="<|file_sep|>"),
    FimConvention("starcoder", ("<fim_prefix>",), ("<fim_suffix>",), ("<fim_middle>",),
                  ("<fim_pad>", "<|endoftext|>", "<file_sep>"), repo="<repo_name>", file_sep="<file_sep>"),
    FimConvention("deepseek", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",), ("<|EOT|>",)),
    FimConvention("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"),
                  ("▁<EOT>", "<EOT>"), suffix_without_space=True),
)


@dataclass(frozen=True)
class FimParts:
    """One FIM prompt in token ids, before assembly (each list excludes the markers)."""

    head: list[int]  # the tokenizer's leading specials (BOS)
    extra: list[int]
    prefix: list[int]  # prefix + prompt
    suffix: list[int]

    def num_tokens(self) -> int:
        return len(self.head) + len(self.extra) + len(self.prefix) + len(self.suffix) + 3


class FimFormat:
    """A tokenizer's FIM convention resolved to token ids."""

    def __init__(self, tokenizer: Any, convention: FimConvention, vocab: dict[str, int]):
        self.tokenizer = tokenizer
        self.convention = convention
        self.prefix_id, self.suffix_id, self.middle_id = (
            next(vocab[t] for t in spellings if t in vocab)
            for spellings in (convention.prefix, convention.suffix, convention.middle)
        )
        self.stop_ids = tuple(sorted({vocab[t] for t in convention.stops if t in vocab}
                                     | {self.prefix_id, self.suffix_id, self.middle_id}))
        self.repo_id = vocab.get(convention.repo) if convention.repo else None
        self.file_sep_id = vocab.get(convention.file_sep) if convention.file_sep else None
        self.head = leading_specials(tokenizer)
        self.order = fim_order(tokenizer)

    @classmethod
    def detect(cls, tokenizer: Any) -> FimFormat | None:
        """The first convention whose three markers are all in the vocabulary; None when none is."""
        vocab = tokenizer.get_vocab()
        for convention in CONVENTIONS:
            if all(any(t in vocab for t in spellings)
                   for spellings in (convention.prefix, convention.suffix, convention.middle)):
                return cls(tokenizer, convention, vocab)
        return None

    @property
    def name(self) -> str:
        return self.convention.name

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def parts(self, prefix: str, suffix: str, prompt: str = "",
              extra: Sequence[tuple[str, str]] = ()) -> FimParts:
        """The pieces of a PSM prompt; `extra` holds (filename, text) chunks, `prompt` follows the prefix."""
        suffix_ids = self.encode(suffix)
        if self.convention.suffix_without_space and suffix_ids:
            suffix_ids = self._drop_implied_space(suffix, suffix_ids)
        return FimParts(list(self.head), self._extra_ids(extra), self.encode(prefix + prompt), suffix_ids)

    def assemble(self, parts: FimParts) -> list[int]:
        """psm: head extra PRE prefix SUF suffix MID; spm: head extra PRE SUF suffix MID prefix."""
        if self.order == "spm":
            return [*parts.head, *parts.extra, self.prefix_id, self.suffix_id, *parts.suffix, self.middle_id,
                    *parts.prefix]
        return [*parts.head, *parts.extra, self.prefix_id, *parts.prefix, self.suffix_id, *parts.suffix,
                self.middle_id]

    def prompt_ids(self, prefix: str, suffix: str, prompt: str = "",
                   extra: Sequence[tuple[str, str]] = ()) -> list[int]:
        return self.assemble(self.parts(prefix, suffix, prompt, extra))

    def _extra_ids(self, extra: Sequence[tuple[str, str]]) -> list[int]:
        if not extra:
            return []
        repo_level = self.repo_id is not None and self.file_sep_id is not None
        ids = [self.repo_id, *self.encode(PROJECT_NAME + "\n")] if repo_level else []
        for filename, text in extra:
            if repo_level:
                ids += [self.file_sep_id, *self.encode(filename + "\n")]
            else:
                ids += self.encode(SNIPPET_SEPARATOR)
            ids += self.encode(text)
        if repo_level:
            ids += [self.file_sep_id, *self.encode(CURRENT_FILE + "\n")]
        return ids

    def _drop_implied_space(self, text: str, ids: list[int]) -> list[int]:
        """SentencePiece marks a word start with "▁": the first piece of a text that does not start
        with a space loses that mark (a lone "▁" piece is dropped)."""
        if text[:1].isspace():
            return ids
        first = self.tokenizer.convert_ids_to_tokens(ids[0])
        if not isinstance(first, str) or not first.startswith("▁"):
            return ids
        if first == "▁":
            return ids[1:]
        bare = self.tokenizer.convert_tokens_to_ids(first[1:])
        unk = getattr(self.tokenizer, "unk_token_id", None)
        return ids if bare is None or bare == unk else [bare, *ids[1:]]


def fim_order(tokenizer: Any) -> str:
    """"spm" when the tokenizer config says `"fim_order": "spm"`, else "psm"."""
    order = str((getattr(tokenizer, "init_kwargs", None) or {}).get("fim_order", "psm")).lower()
    return order if order in ORDERS else "psm"


def leading_specials(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text when it adds special tokens (BOS, or nothing)."""
    probe = "x"
    plain = list(tokenizer.encode(probe, add_special_tokens=False))
    full = list(tokenizer.encode(probe, add_special_tokens=True))
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def fit(parts: FimParts, room: int) -> tuple[FimParts, bool]:
    """Cut a prompt to at most `room` tokens, as llama.cpp's /infill does: extra context first (its
    oldest tokens), then the prefix from the left and the suffix from the right, the prefix keeping up
    to PREFIX_SHARE of what is left. Returns (parts, whether anything was cut)."""
    if parts.num_tokens() <= room:
        return parts, False
    fixed = len(parts.head) + 3
    extra_room = max(0, room - fixed - len(parts.prefix) - len(parts.suffix))
    extra = parts.extra[len(parts.extra) - extra_room :] if extra_room else []
    left = max(0, room - fixed - len(extra))
    if len(parts.prefix) + len(parts.suffix) > left:
        prefix_take = min(len(parts.prefix), max(int(left * PREFIX_SHARE), left - len(parts.suffix)))
        suffix_take = min(len(parts.suffix), left - prefix_take)
        prefix = parts.prefix[len(parts.prefix) - prefix_take :] if prefix_take else []
        return FimParts(parts.head, extra, prefix, parts.suffix[:suffix_take]), True
    return FimParts(parts.head, extra, parts.prefix, parts.suffix), True
