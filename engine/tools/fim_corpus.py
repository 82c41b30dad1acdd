"""Fill-in-the-middle training examples for `specexec build-default` (PSM order, Qwen token names).

A FIM document is cut at line boundaries into pieces short enough to sit inside one training
window; each piece is split at two random character points that do not cut a word (uniform over the
allowed points) into prefix / middle / suffix and written as
`<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}`. The stream encoder wraps every
example in BOS ... EOS, so the model learns to end the middle with EOS. Splits never fall inside a
word so that the first middle token is a whole token, as it is when an editor's cursor sits
after a space or a symbol.
"""

from __future__ import annotations

import random

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
FIM_TOKENS = [FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE]

MIN_PIECE_CHARS = 32  # a piece grows line by line until it reaches a length drawn from
MAX_PIECE_CHARS = 256  # [MIN_PIECE_CHARS, MAX_PIECE_CHARS]; ~3.3 chars per token at vocab 4096
LONGEST_PIECE_CHARS = 2048  # longer pieces (one huge line) stay plain text


def fim_prompt(prefix: str, suffix: str) -> str:
    """The PSM prompt whose continuation is the middle."""
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def fim_example(prefix: str, middle: str, suffix: str) -> str:
    """One PSM training example (BOS/EOS are added by the stream encoder)."""
    return fim_prompt(prefix, suffix) + middle


def split_pieces(text: str, rng: random.Random) -> list[str]:
    """Cut `text` at line ends into consecutive pieces of roughly MIN..MAX_PIECE_CHARS characters."""
    pieces, current, goal = [], "", rng.randint(MIN_PIECE_CHARS, MAX_PIECE_CHARS)
    for line in text.splitlines(keepends=True):
        current += line
        if len(current) >= goal:
            pieces.append(current)
            current, goal = "", rng.randint(MIN_PIECE_CHARS, MAX_PIECE_CHARS)
    if current.strip():
        pieces.append(current)
    return pieces


def split_points(piece: str) -> list[int]:
    """Character positions a FIM split may take: every position that does not cut a word (a run of
    letters, digits and underscores), ends included."""
    return [p for p in range(len(piece) + 1) if p in (0, len(piece)) or not (_word(piece[p - 1]) and _word(piece[p]))]


def _word(char: str) -> bool:
    return char.isalnum() or char == "_"


def fim_pieces(text: str, rng: random.Random) -> list[str]:
    """A document as FIM examples: each piece split at two uniform random character points."""
    examples = []
    for piece in split_pieces(text, rng):
        if len(piece) > LONGEST_PIECE_CHARS:
            examples.append(piece)
            continue
        points = split_points(piece)
        lo, hi = sorted(points[rng.randrange(len(points))] for _ in range(2))
        examples.append(fim_example(piece[:lo], piece[lo:hi], piece[hi:]))
    return examples


def apply_fim(texts: list[str], rate: float, seed: int) -> list[str]:
    """Training documents with a `rate` fraction of them (seeded draw per document) turned into FIM
    examples; the rest stay whole. Order is kept: a FIM document's examples replace it in place."""
    assert 0.0 <= rate <= 1.0, rate
    rng = random.Random(seed)
    out: list[str] = []
    for text in texts:
        if rng.random() < rate:
            out.extend(fim_pieces(text, rng))
        else:
            out.append(text)
    return out
