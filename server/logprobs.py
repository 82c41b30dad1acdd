"""OpenAI's logprobs shapes from the engine's `TokenLogprob`s.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}`,
top_logprobs the k most likely tokens. Completions (legacy): `{tokens, token_logprobs, top_logprobs,
text_offset}`, top_logprobs one `{token: logprob}` per token holding the k most likely and the chosen
token (so up to k + 1 entries, as OpenAI documents). A stream's chunks each carry their own tokens;
completions' text_offset goes on counting across them.

The values are the target's log-probabilities under the request's processed distribution (see
engine/speculation/logprobs.py). A token the processing removed (top_k, top_p, min_p) has log-prob -inf,
which JSON cannot carry: it is sent as MIN_LOGPROB, as vLLM does.
"""

from __future__ import annotations

import re
from typing import Any

from engine.types import TokenLogprob

MIN_LOGPROB = -9999.0
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
REPLACEMENT_CHAR = "\ufffd"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


BYTE_LEVEL = byte_level_alphabet()


class TokenTexts:
    """Token id -> (its text, its exact UTF-8 bytes), cached. A token holding part of a multi-byte
    character decodes to U+FFFD; its bytes come from the byte-level or byte-fallback vocabulary."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = (text, self._bytes(token_id, text))
        return self._cache[token_id]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if REPLACEMENT_CHAR not in text:
            return list(text.encode("utf-8"))
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if match := BYTE_TOKEN.fullmatch(piece):
                return [int(match.group(1), 16)]
            if piece and all(ch in BYTE_LEVEL for ch in piece):
                return [BYTE_LEVEL[ch] for ch in piece]
        return list(text.encode("utf-8"))


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobFormat:
    """One choice's logprobs, chat or completions shape; `format` is called once per chunk (or
    once for a whole response) with the tokens since the previous call."""

    def __init__(self, texts: TokenTexts, chat: bool):
        self._texts = texts
        self._chat = chat
        self._text_offset = 0  # completions: characters of the choice's token texts so far

    def format(self, token_ids: list[int], entries: list[TokenLogprob]) -> dict[str, Any]:
        assert len(token_ids) == len(entries), "one TokenLogprob per token"
        if self._chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(token_ids, entries, strict=True)],
                    "refusal": None}
        return self._completion(token_ids, entries)

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._texts(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": raw}

    def _chat_entry(self, token_id: int, entry: TokenLogprob) -> dict[str, Any]:
        top = [self._alternative(t, lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)]
        return self._alternative(token_id, entry.logprob) | {"top_logprobs": top}

    def _completion(self, token_ids: list[int], entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self._texts(token_id)[0]
            tokens.append(text)
            offsets.append(self._text_offset)
            self._text_offset += len(text)
            top = {self._texts(t)[0]: finite(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)}
            tops.append(top | {text: finite(entry.logprob)})
        return {"tokens": tokens, "token_logprobs": [finite(e.logprob) for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
