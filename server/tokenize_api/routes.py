"""`POST /tokenize` and `POST /detokenize`: llama.cpp server's and vLLM's, one route each at the root.

/tokenize answers in the dialect asked (server/tokenize_api/request.py). llama.cpp's: `{"tokens": [ids]}`,
with `with_pieces` `{"tokens": [{"id", "piece"}]}` (server/tokenize_api/pieces.py). vLLM's: `{"count",
"max_model_len" (the server's context), "tokens", "token_strs"}` (`token_strs`: the vocabulary's
strings of the ids with `return_token_strs`, else null). Text is tokenized by the tokenizer the
prompts use; messages through the chat endpoint's own path (template, tools, template variables), so
`count` is the `usage.prompt_tokens` /v1/chat/completions reports for them. A count is given also
where it exceeds the context (a client counts to know); only text longer in characters than any
context could hold is refused, as every route refuses it (400 `context_length_exceeded`).

/detokenize answers `{"content": text, "prompt": text}`: llama.cpp reads `content`, vLLM `prompt`, and
both send the same body, so both keys serve either. The ids are decoded with their special tokens kept,
as both servers decode them; ids outside the vocabulary are a 400 naming `tokens`.

`model`: vLLM's bodies are checked as /v1 checks them (an id not served is a 404); llama.cpp's
/tokenize body has none and any there is ignored, as /infill ignores it. Parsing, templates and
tokenization run in the preparation lanes (server/preparation.py), chosen by the body's size.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request

from server.errors import APIError
from server.limits import read_body
from server.preparation import Lane
from server.prompt import PromptBuilder
from server.protocol import check_token_ids
from server.security import require_json
from server.state import ServerState
from server.tokenize_api.pieces import encode_plain, token_pieces
from server.tokenize_api.request import (
    ChatTokenize,
    Detokenize,
    LlamaTokenize,
    TokenizeRequest,
    parse_detokenize,
    parse_tokenize,
)

T = TypeVar("T")


def tokenize_router() -> APIRouter:
    """The routes, to be included at the root (behind the API key check)."""
    router = APIRouter()
    json_body = [Depends(require_json)]
    router.add_api_route("/tokenize", tokenize, methods=["POST"], dependencies=json_body)
    router.add_api_route("/detokenize", detokenize, methods=["POST"], dependencies=json_body)
    return router


async def tokenize(request: Request) -> dict[str, Any]:
    async def answer(state: ServerState, raw: bytes, lane: Lane) -> dict[str, Any]:
        req = await lane.run(parse_tokenize, raw)
        _, prompt = state.require_ready()
        if not isinstance(req, LlamaTokenize):
            state.check_model(req.model)
        return await lane.run(tokenized, prompt, req)

    return await _counted(request, "tokenize", answer)


async def detokenize(request: Request) -> dict[str, str]:
    async def answer(state: ServerState, raw: bytes, lane: Lane) -> dict[str, str]:
        req = await lane.run(parse_detokenize, raw)
        _, prompt = state.require_ready()
        state.check_model(req.model)
        text = await lane.run(detokenized, prompt, req)
        return {"content": text, "prompt": text}

    return await _counted(request, "detokenize", answer)


async def _counted(request: Request, endpoint: str, answer: Callable[[ServerState, bytes, Lane], Awaitable[T]]) -> T:
    """`answer(state, body, lane)` for the body in its lane (chosen by the body's size); an APIError is counted
    as rejected under `endpoint` and raised."""
    state: ServerState = request.app.state.specexec
    try:
        raw = await _body(request, state)
        return await answer(state, raw, state.preparation.lane(len(raw)))
    except APIError as exc:
        state.metrics.rejected.labels(endpoint, str(exc.status)).inc()
        raise


async def _body(request: Request, state: ServerState) -> bytes:
    return await read_body(request, state.server_config.max_body_bytes, state.server_config.read_timeout)


def tokenized(prompt: PromptBuilder, req: TokenizeRequest) -> dict[str, Any]:
    """The answer to a parsed /tokenize request, in its dialect."""
    if isinstance(req, LlamaTokenize):
        prompt.check_chars(req.content, "content")
        if req.parse_special:
            ids = prompt.encode(req.content, req.add_special, "content", fit=False)
        else:
            ids = encode_plain(prompt.tokenizer, req.content, req.add_special)
        if not req.with_pieces:
            return {"tokens": ids}
        pieces = token_pieces(prompt.tokenizer, ids)
        return {"tokens": [{"id": token_id, "piece": piece} for token_id, piece in zip(ids, pieces, strict=True)]}
    if isinstance(req, ChatTokenize):
        ids = prompt.chat_ids(req.messages, prompt.tool_plan(req), prompt.template_variables(req),
                              generation_prompt=req.generation_prompt, continue_final=req.continue_final_message,
                              add_special_tokens=req.add_special_tokens, fit=False)
    else:
        prompt.check_chars(req.prompt, "prompt")
        ids = prompt.encode(req.prompt, req.add_special_tokens, "prompt", fit=False)
    token_strs = list(prompt.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": prompt.max_context, "tokens": ids, "token_strs": token_strs}


def detokenized(prompt: PromptBuilder, req: Detokenize) -> str:
    check_token_ids(req.tokens, prompt.vocab_size, "tokens")
    return prompt.tokenizer.decode(req.tokens, skip_special_tokens=False)
