"""Each token's piece of the text (llama.cpp's `/tokenize` `with_pieces`), and text tokenized with its
special tokens read as plain text (llama.cpp's `parse_special: false`).

A piece is the text a token adds where it stands: decoding a token alone loses what its neighbours
give it (SentencePiece's `▁Hello` decodes to "Hello" alone, " Hello" after another token), so each
piece is the difference between decoding a short window of tokens with and without it, as the
server's streaming detokenizer reads generated tokens (server/detok.py). A token that ends inside a
character (byte-level BPE, byte fallback) leaves that difference ending in U+FFFD: it waits for the
tokens that complete the character, then each of them gets its own bytes from the vocabulary
(server/logprobs.py `TokenTexts`), the completing one the rest. A piece whose bytes are valid UTF-8
is a string, any other a list of byte values, as llama.cpp gives them. For the ids of any text, the
pieces' bytes joined are the ids' decoded text.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from server.detok import REPLACEMENT_CHAR
from server.logprobs import TokenTexts

Piece = str | list[int]


def token_pieces(tokenizer: Any, ids: list[int]) -> list[Piece]:
    """One piece per id."""
    token_bytes = TokenTexts(tokenizer)
    pieces: list[Piece] = []
    start = 0  # the decode window: ids[start:done] give the text before the pending ids
    done = 0  # ids before this one have their pieces
    before = ""  # decode(ids[start:done])
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
        if text.endswith(REPLACEMENT_CHAR) and end < len(ids):
            continue  # a character not yet complete: wait for the tokens that complete it
        pieces.extend(_split(text[len(before):].encode("utf-8"), ids[done:end], token_bytes))
        start, done = done, end
        before = tokenizer.decode(ids[start:done], skip_special_tokens=False)
    return pieces


def _split(added: bytes, group: list[int], token_bytes: TokenTexts) -> list[Piece]:
    """The pieces of the tokens `group` that together added `added`: all but the last get their vocabulary
    bytes, the last what those leave (all of `added` when they do not begin it)."""
    if len(group) == 1:
        return [_piece(added)]
    held = [bytes(token_bytes(token_id)[1]) for token_id in group[:-1]]
    head = b"".join(held)
    rest = added[len(head):] if added.startswith(head) else added
    return [_piece(raw) for raw in held] + [_piece(rest)]


def _piece(raw: bytes) -> Piece:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


_plain_backends: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_plain_lock = threading.Lock()


def encode_plain(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s ids with special-token text (`<|im_start|>`) tokenized as ordinary text. A fast tokenizer
    does this with a switch on its Rust tokenizer, which transformers flips on the shared object for the
    length of one call: another thread encoding a chat prompt meanwhile would split its special tokens.
    So this uses a copy of the Rust tokenizer with the switch on, made once per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer takes it as an argument
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))
    with _plain_lock:
        plain = _plain_backends.get(tokenizer)
        if plain is None:
            plain = type(backend).from_str(backend.to_str())
            plain.encode_special_tokens = True
            _plain_backends[tokenizer] = plain
    return plain.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
