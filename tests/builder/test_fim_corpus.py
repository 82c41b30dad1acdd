"""Training documents of `specexec build-default`: SPM layout, lossless splits, cursor-like middles,
seeded rates, and parts tokenized apart as a prompt that ends at a cursor is."""

from __future__ import annotations

import random
from itertools import accumulate

from builder.fim_corpus import (
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    cursor_parts,
    fim_pieces,
    indent_ends,
    line_end,
    middle_span,
    split_pieces,
    split_points,
    training_documents,
)

TEXT = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(60))


def unfim(example: tuple[str, ...]) -> str:
    """The original piece of an SPM example (`PRE SUF suffix MID prefix`, `middle`): prefix + middle + suffix."""
    prompt, middle = example
    assert prompt.startswith(FIM_PREFIX + FIM_SUFFIX)
    suffix, prefix = prompt[len(FIM_PREFIX + FIM_SUFFIX) :].split(FIM_MIDDLE)
    return prefix + middle + suffix


def test_pieces_cover_the_text_at_line_ends() -> None:
    pieces = split_pieces(TEXT, random.Random(0))
    assert "".join(pieces) == TEXT and len(pieces) > 3
    assert all(p.endswith("\n") for p in pieces)


def test_fim_examples_are_spm_and_lossless() -> None:
    examples = fim_pieces(TEXT, random.Random(1))
    assert "".join(unfim(e) for e in examples) == TEXT
    for prompt, middle in examples:  # the prompt ends at the cursor, the middle is a part of its own
        assert prompt.index(FIM_PREFIX) < prompt.index(FIM_SUFFIX) < prompt.index(FIM_MIDDLE)
        assert FIM_PREFIX not in middle


def test_middles_start_at_a_cursor_and_often_end_at_a_line_end() -> None:
    piece = "def add(a, b):\n    total = a + b\n    return total\n"
    rng = random.Random(3)
    spans = [middle_span(piece, rng) for _ in range(400)]
    assert all(0 <= lo <= hi <= len(piece) for lo, hi in spans)
    at_line_end = sum(hi == len(piece) or piece[hi] == "\n" for _lo, hi in spans)
    assert at_line_end > 200  # half by construction, plus uniform ends that land on one


def test_line_end_counts_lines_below_the_cursor() -> None:
    piece = "a = 1\nb = 2\nc = 3"
    assert line_end(piece, 2, 0) == 5
    assert line_end(piece, 2, 1) == 11
    assert line_end(piece, 2, 2) == len(piece)
    assert line_end(piece, 5, 0) == 5  # a cursor at a line's end: an empty middle


def test_training_documents_are_seeded_and_follow_the_rates() -> None:
    texts = [f"x = {i}\n" * 5 for i in range(400)]
    out = training_documents(texts, 0.5, 0.0, seed=7)
    assert out == training_documents(texts, 0.5, 0.0, seed=7)
    num_fim = sum(doc[0].startswith(FIM_PREFIX) for doc in out)
    assert 150 < num_fim < 250  # each short text is one piece
    assert training_documents(texts, 0.0, 0.0, seed=7) == [(text,) for text in texts]
    assert all(doc[0].startswith(FIM_PREFIX) for doc in training_documents(texts, 1.0, 0.0, seed=7))
    cut = training_documents(texts, 0.5, 1.0, seed=7)
    is_fim = [doc[0].startswith(FIM_PREFIX) for doc in cut]
    assert is_fim == [doc[0].startswith(FIM_PREFIX) for doc in out]  # the cut rate leaves the FIM choice alone
    plain = [doc for doc, fim in zip(cut, is_fim, strict=True) if not fim]
    assert ["".join(doc) for doc in plain] == [doc[0] for doc in out if not doc[0].startswith(FIM_PREFIX)]
    assert sum(len(doc) > 1 for doc in plain) > 0.8 * len(plain)  # most have a cursor inside


def test_cursor_parts_are_lossless_and_often_end_after_indentation() -> None:
    rng = random.Random(5)
    docs = [cursor_parts(TEXT, rng) for _ in range(50)]
    assert all("".join(doc) == TEXT and all(doc) for doc in docs)
    cuts = [pos for doc in docs for pos in accumulate(len(part) for part in doc[:-1])]
    assert len(cuts) > 50 * 5  # one cut per piece of 32-256 characters
    indents = set(indent_ends(TEXT))
    assert sum(pos in indents for pos in cuts) > 0.6 * len(cuts)  # CUT_INDENT_SHARE, plus uniform points there
    assert set(cuts) <= set(split_points(TEXT))  # never inside a word


def test_indent_ends_are_where_code_starts_on_each_line() -> None:
    piece = "def f():\n    x = 1\n\n        \n\treturn x\n"
    assert [piece[p:p + 6] for p in indent_ends(piece)] == ["x = 1\n", "return"]  # indented lines with code


def test_splits_never_cut_a_word() -> None:
    piece = "def add(a, b):\n    return a_1 + b2\n"
    points = split_points(piece)
    assert 0 in points and len(piece) in points and piece.index("return") in points
    assert piece.index("return") + 2 not in points and piece.index("a_1") + 1 not in points


def test_fim_eval_examples_and_prompts_follow_the_training_split() -> None:
    from builder.fim_eval import examples, prompt_text

    cases = examples([TEXT], 10, seed=4)
    assert len(cases) == 10
    assert all(TEXT.count(prefix + middle + suffix) for prefix, middle, suffix in cases)
    assert prompt_text("spm", "pre", "suf") == f"{FIM_PREFIX}{FIM_SUFFIX}suf{FIM_MIDDLE}pre"
    assert prompt_text("psm", "pre", "suf") == f"{FIM_PREFIX}pre{FIM_SUFFIX}suf{FIM_MIDDLE}"
