"""Training documents for `specexec build-default`, tokenized as they are met at a cursor.

A document is a tuple of parts; the stream encoder tokenizes each part alone and concatenates them,
because the server tokenizes a prompt that ends at a cursor alone. Byte-level BPE joins a space run's
last space to the next word (`"\n    return"` is `"\n   "` + `" return"`), so a prompt ending in
`"\n    "` ends in a token that whole-text tokenization only shows before a blank line or the end of
a text; a model trained on whole texts alone answers it with EOS.

Fill-in-the-middle: a FIM document is cut at line boundaries into pieces short enough to sit inside
one training window; each piece is split into prefix / middle / suffix and written in SPM order as
two parts, the prompt `<|fim_prefix|><|fim_suffix|>{suffix}<|fim_middle|>{prefix}` and the middle.
The stream encoder wraps every example in BOS ... EOS, so the model learns to end the middle with
EOS where the suffix begins.

SPM rather than PSM: the middle continues the prefix directly, which a 4M-parameter model does as
well as plain completion, whereas in PSM it must first find where the prefix ended across the
suffix (a PSM-trained build of this size got the first middle token right 4% of the time).
The cursor (the split's start) is a uniform point that does not cut a word; half the middles run to
the end of the cursor's line or one or two lines past it (what an editor's tab completion asks
for), half end at a second uniform point.

Cursor cuts: a share of the other documents are cut at one cursor per piece (where an indented
line's code starts, where Enter and auto-indent leave it, CUT_INDENT_SHARE of the time, else a
uniform point that does not cut a word), so the model meets both tokenizations of the same code.
The stream encoder makes the token before each cut no training target: the model learns to continue
a text tokenized at a cursor, not to write text tokenized that way.
"""

from __future__ import annotations

import random
from itertools import pairwise

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
FIM_TOKENS = [FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE]

Document = tuple[str, ...]  # parts of one training document, each tokenized alone, then concatenated

FIM_ORDER = "spm"  # written to the tokenizer config: the server builds prompts in this order
LINE_END_SHARE = 0.5  # middles that end at a line end (0, 1 or 2 lines past the cursor's)
MIN_PIECE_CHARS = 32  # a piece grows line by line until it reaches a length drawn from
MAX_PIECE_CHARS = 256  # [MIN_PIECE_CHARS, MAX_PIECE_CHARS]; ~3.3 chars per token at vocab 4096
LONGEST_PIECE_CHARS = 2048  # longer pieces (one huge line) stay plain text
CUT_INDENT_SHARE = 0.75  # cursor cuts at an indented line's code start; the rest at a uniform split point


def fim_prompt(prefix: str, suffix: str) -> str:
    """The SPM prompt whose continuation is the middle."""
    return f"{FIM_PREFIX}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{prefix}"


def fim_example(prefix: str, middle: str, suffix: str) -> Document:
    """One SPM training example: the prompt (ending at the cursor) and the middle, tokenized apart as
    the server tokenizes the prompt (BOS/EOS are added by the stream encoder)."""
    return (fim_prompt(prefix, suffix), middle)


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


def line_end(piece: str, start: int, lines_after: int) -> int:
    """The end (before its newline) of the line `lines_after` lines below the one holding `start`;
    len(piece) when the piece ends first."""
    end = piece.find("\n", start)
    for _ in range(lines_after):
        if end < 0:
            break
        end = piece.find("\n", end + 1)
    return len(piece) if end < 0 else end


def middle_span(piece: str, rng: random.Random) -> tuple[int, int]:
    """(cursor, middle end): a uniform allowed cursor; the end a line end at or after it
    (LINE_END_SHARE of the time), else the later of two uniform allowed points."""
    points = split_points(piece)
    if rng.random() < LINE_END_SHARE:
        cursor = points[rng.randrange(len(points))]
        return cursor, line_end(piece, cursor, rng.choice((0, 0, 1, 2)))
    lo, hi = sorted(points[rng.randrange(len(points))] for _ in range(2))
    return lo, hi


def fim_splits(text: str, rng: random.Random) -> list[str | tuple[str, str, str]]:
    """A document's pieces, each as (prefix, middle, suffix), or as plain text when too long for a
    window."""
    splits: list[str | tuple[str, str, str]] = []
    for piece in split_pieces(text, rng):
        if len(piece) > LONGEST_PIECE_CHARS:
            splits.append(piece)
            continue
        lo, hi = middle_span(piece, rng)
        splits.append((piece[:lo], piece[lo:hi], piece[hi:]))
    return splits


def fim_pieces(text: str, rng: random.Random) -> list[Document]:
    """A document as FIM examples, one per piece (pieces too long for a window stay plain text)."""
    return [(part,) if isinstance(part, str) else fim_example(*part) for part in fim_splits(text, rng)]


def indent_ends(piece: str) -> list[int]:
    """Where each indented line's code starts (a cut before an unindented line tokenizes as the whole
    text does: a lone newline is a token of its own)."""
    points, start = [], 0
    for line in piece.splitlines(keepends=True):
        code = line.lstrip(" \t")
        if code.strip() and len(code) < len(line):
            points.append(start + len(line) - len(code))
        start += len(line)
    return points


def cursor_cut(piece: str, rng: random.Random) -> int:
    """A cursor in `piece`: an indented line's code start (CUT_INDENT_SHARE, when it has one), else a
    uniform split point."""
    indents = indent_ends(piece)
    if indents and rng.random() < CUT_INDENT_SHARE:
        return indents[rng.randrange(len(indents))]
    points = split_points(piece)
    return points[rng.randrange(len(points))]


def cursor_parts(text: str, rng: random.Random) -> Document:
    """`text` cut at one cursor per split_pieces piece (the pieces themselves stay joined); the
    non-empty parts, in order."""
    bounds, offset = [0], 0
    for piece in split_pieces(text, rng):
        bounds.append(offset + cursor_cut(piece, rng))
        offset += len(piece)
    bounds.append(len(text))
    return tuple(text[lo:hi] for lo, hi in pairwise(bounds) if hi > lo)


def training_documents(texts: list[str], fim_rate: float, cut_rate: float, seed: int) -> list[Document]:
    """Training documents: a `fim_rate` fraction of the texts (seeded draw per text) become FIM
    examples, a `cut_rate` fraction of the rest are cut at cursors (a second seeded stream, so the
    FIM choice does not depend on `cut_rate`), the others stay whole. Order is kept: a FIM text's
    examples replace it in place."""
    assert 0.0 <= fim_rate <= 1.0 and 0.0 <= cut_rate <= 1.0, (fim_rate, cut_rate)
    rng, cut_rng = random.Random(seed), random.Random(seed + 1)
    out: list[Document] = []
    for text in texts:
        if rng.random() < fim_rate:
            out.extend(fim_pieces(text, rng))
        elif cut_rng.random() < cut_rate:
            out.append(cursor_parts(text, cut_rng))
        else:
            out.append((text,))
    return out
