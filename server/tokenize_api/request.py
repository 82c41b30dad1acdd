"""The bodies of `POST /tokenize` and `POST /detokenize`, in llama.cpp's and vLLM's words.

/tokenize: the field holding the text says whose body it is. `content`: llama.cpp's
(`add_special` false, `parse_special` true, `with_pieces` false by default); `prompt`: vLLM's text
request (`add_special_tokens` true by default); `messages`: vLLM's chat request, which is the chat
request of /v1/chat/completions (its messages, `tools`, `chat_template_kwargs`, `reasoning_effort`,
validated as that route validates them) plus vLLM's `add_generation_prompt` (true by default, false when
`continue_final_message` is true), `continue_final_message` and `add_special_tokens` (false by default).
vLLM's requests may ask for `return_token_strs`. Exactly one of the three fields must be given (a
null one counts as not given). /detokenize: `{"tokens": [ids]}` in both, `model` optional (vLLM's).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from server.errors import APIError, invalid_request
from server.json_body import load_json_object
from server.protocol import ChatCompletionRequest, validate_request

TEXT_FIELDS = ("content", "prompt", "messages")  # llama.cpp's, vLLM's text, vLLM's chat


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class LlamaTokenize(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class TextTokenize(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class ChatTokenize(ChatCompletionRequest):
    add_generation_prompt: bool | None = None  # None: not continue_final_message
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False

    @property
    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class Detokenize(_Body):
    model: str | None = None
    tokens: list[int]


TokenizeRequest = LlamaTokenize | TextTokenize | ChatTokenize
BodyT = TypeVar("BodyT", bound=_Body)


def parse_tokenize(raw: bytes) -> TokenizeRequest:
    body = load_json_object(raw)
    given = [name for name in TEXT_FIELDS if body.get(name) is not None]
    if not given:
        raise invalid_request("Give the text to tokenize as 'content' (llama.cpp) or 'prompt' (vLLM), or a "
                              "conversation as 'messages' (vLLM).", "prompt", "missing_required_parameter")
    if len(given) > 1:
        raise invalid_request(f"Give only one of 'content', 'prompt' and 'messages', not both '{given[0]}' and "
                              f"'{given[1]}'.", given[1], "invalid_value")
    if given[0] == "messages":
        return _chat(body)
    return _validate(LlamaTokenize if given[0] == "content" else TextTokenize, body)


def parse_detokenize(raw: bytes) -> Detokenize:
    return _validate(Detokenize, load_json_object(raw))


def _chat(body: dict[str, Any]) -> ChatTokenize:
    """Validated as /v1/chat/completions validates its body (server/protocol.py `validate_request`)."""
    request = validate_request(body, ChatTokenize)
    if request.continue_final_message and request.add_generation_prompt:
        raise invalid_request("Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
                              "continue_final_message", "invalid_value")
    return request


def _validate(cls: type[BodyT], body: dict[str, Any]) -> BodyT:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc.errors()[0]) from None


def _field_error(first: Any) -> APIError:
    """The 400 naming the field: `tokens[3]`."""
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return invalid_request(f"Invalid value for '{param}': {first['msg']}.", param, "invalid_value")
