"""FIM training examples of `specexec build-default`: SPM layout, lossless splits, cursor-like middles,
seeded rate."""

from __future__ import annotations

import random

from builder.fim_corpus import (
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    apply_fim,
    fim_pieces,
    line_end,
    middle_span,
    split_pieces,
    split_points,
)

TEXT = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(60))


def unfim(example: str) -> str:
    """The original piece of an SPM example `PRE SUF suffix MID prefix middle`: prefix + middle + suffix."""
    assert example.startswith(FIM_PREFIX + FIM_SUFFIX)
    suffix, prefix_middle = example[len(FIM_PREFIX + FIM_SUFFIX) :].split(FIM_MIDDLE)
    return prefix_middle + suffix


def test_pieces_cover_the_text_at_line_ends() -> None:
    pieces = split_pieces(TEXT, random.Random(0))
    assert "".join(pieces) == TEXT and len(pieces) > 3
    assert all(p.endswith("\n") for p in pieces)


def test_fim_examples_are_spm_and_lossless() -> None:
    examples = fim_pieces(TEXT, random.Random(1))
    assert "".join(unfim(e) for e in examples) == TEXT
    for example in examples:
        assert example.index(FIM_PREFIX) < example.index(FIM_SUFFIX) < example.index(FIM_MIDDLE)


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


def test_apply_fim_is_seeded_and_follows_the_rate() -> None:
    texts = [f"x = {i}\n" * 5 for i in range(400)]
    out = apply_fim(texts, 0.5, seed=7)
    assert out == apply_fim(texts, 0.5, seed=7)
    num_fim = sum(doc.startswith(FIM_PREFIX) for doc in out)
    assert 150 < num_fim < 250  # each short text is one piece
    assert apply_fim(texts, 0.0, seed=7) == texts
    assert all(doc.startswith(FIM_PREFIX) for doc in apply_fim(texts, 1.0, seed=7))


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
