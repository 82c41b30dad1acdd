"""Prompts: chat template + tokenization, token-id checks, and the context-length check."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jinja2

from engine.types import ContextLengthError
from server.errors import context_length_error, invalid_request
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    check_token_ids,
    message_text,
)

log = logging.getLogger("specexec.server")

# Used only when neither the tokenizer nor --chat-template provides a template.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class PromptBuilder:
    def __init__(
        self,
        tokenizer: Any,
        *,
        max_context: int,
        default_max_tokens: int,
        validate: Callable[[int, int], None],
        chat_template: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens
        self._validate = validate
        self.vocab_size = len(tokenizer)
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            log.warning("the tokenizer has no chat_template and none was given: using a plain fallback")
            self.chat_template = FALLBACK_CHAT_TEMPLATE

    def render_chat(self, messages: list[ChatMessage]) -> str:
        conversation = [{"role": m.role, "content": message_text(m)} | ({"name": m.name} if m.name else {})
                        for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
            )
        except jinja2.TemplateError as exc:
            raise invalid_request(f"The chat template rejected the messages: {exc}", "messages") from None

    def prompt_ids(self, request: SamplingRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            return self.chat_ids(request.messages)
        assert isinstance(request, CompletionRequest)
        return self.completion_ids(request)

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        text = self.render_chat(messages)
        # the template spells out special tokens (BOS etc.) itself
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def completion_ids(self, request: CompletionRequest) -> list[int]:
        value = request.prompt
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return list(self.tokenizer.encode(value, add_special_tokens=True))
        check_token_ids(value, self.vocab_size, "prompt")
        return list(value)

    def max_tokens(self, request: SamplingRequest, prompt_len: int) -> int:
        """The completion budget; a ContextLengthError becomes a 400 context_length_exceeded."""
        requested, param = request.requested_max_tokens(), request.prompt_param
        if prompt_len == 0:
            raise invalid_request("The prompt is empty after tokenization.", param)
        if requested is None:  # the default, cut to the room left (at least 1, so a full prompt is refused)
            requested = min(self.default_max_tokens, max(1, self.max_context - prompt_len))
        try:
            self._validate(prompt_len, requested)
        except ContextLengthError as exc:
            raise context_length_error(exc, param) from None
        return requested

