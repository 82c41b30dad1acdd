"""Prompts: chat template + tokenization, token-id checks, and the context-length check."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import jinja2

from engine.types import ContextLengthError
from server.config import RESERVED_TEMPLATE_KWARGS
from server.errors import APIError, context_length_error, invalid_request, unsupported
from server.fim import FimFormat
from server.harmony import speaks_harmony
from server.harmony_output import HarmonyPlan, harmony_conversation, harmony_drop_ids, plan_harmony
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    check_token_ids,
    message_text,
)
from server.reasoning import Opening, prompt_reasoning, think_tags
from server.toolcalls.detect import ToolSupport, special_ids
from server.toolcalls.plan import ToolPlan, plan_tools
from server.toolcalls.render import conversation

log = logging.getLogger("specexec.server")

# A token covers at most as many characters as its vocabulary entry is long (byte-level BPE:
# one character per byte; SentencePiece: one per character); x2 leaves room for normalizers
# that merge characters. Longer prompts cannot fit the context: refused before tokenizing.
CHARS_PER_TOKEN_MARGIN = 2

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
        tool_parser: str = "auto",
        reasoning_format: str = "auto",
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.default_template_kwargs = dict(template_kwargs or {})  # the server's --chat-template-kwargs
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens
        self._validate = validate
        self.vocab_size = len(tokenizer)
        self.max_prompt_chars = max_context * longest_token_chars(tokenizer) * CHARS_PER_TOKEN_MARGIN
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            log.warning("the tokenizer has no chat_template and none was given: using a plain fallback")
            self.chat_template = FALLBACK_CHAT_TEMPLATE
        # GPT-OSS's harmony channels: reasoning, content and tool calls (server/harmony.py); None: not harmony
        self.harmony_drop_ids = (harmony_drop_ids(tokenizer) if speaks_harmony(self.chat_template, tokenizer)
                                 else None)
        self._tools_on = tool_parser != "none"
        self._harmony_reasoning = reasoning_format == "auto"
        self.tools = ToolSupport.detect(tokenizer, self.chat_template, tool_parser)
        log.info("chat template: %s", "harmony channels (GPT-OSS): reasoning, content and tool calls"
                 if self.harmony_drop_ids is not None else self.tools.describe())
        # <think> blocks read apart from the answer (server/reasoning.py)
        tags = think_tags(self.chat_template, tokenizer)
        self.think_tags = tags if reasoning_format == "auto" and self.harmony_drop_ids is None else None
        log.info("reasoning: %s", f"{tags.open} blocks apart" if self.think_tags is not None else "none")
        self._special_ids = frozenset(special_ids(tokenizer))
        # the tags' ids where they are special tokens (decoding would skip them, and the block with them)
        added = tokenizer.get_added_vocab()
        think = self.think_tags
        tag_ids = {added.get(think.open), added.get(think.close)} if think is not None else set()
        self.special_think_ids = frozenset(tag_ids & self._special_ids)
        self.fim = FimFormat.detect(tokenizer)  # None: no fill-in-the-middle tokens (server/fim.py)
        log.info("fill-in-the-middle: %s", f"{self.fim.name}, {self.fim.order}" if self.fim is not None else "none")

    def tool_plan(self, request: SamplingRequest) -> ToolPlan | HarmonyPlan | None:
        """How a chat request's tools are served (None: plain text); a 400 for a tool_choice the
        model cannot honour. A harmony model's chat requests all have a HarmonyPlan (its output is read)."""
        if not isinstance(request, ChatCompletionRequest):
            return None
        if self.harmony_drop_ids is not None:
            return plan_harmony(request, self.harmony_drop_ids, tools_on=self._tools_on,
                                reasoning=self._harmony_reasoning)
        return plan_tools(self.tools, request)

    def render_chat(self, messages: list[ChatMessage], plan: ToolPlan | HarmonyPlan | None = None,
                    template_kwargs: dict[str, Any] | None = None, *, generation_prompt: bool = True,
                    continue_final: bool = False) -> str:
        """The prompt text; with a tool plan, the tools rendered; `template_kwargs`: a request's
        `chat_template_kwargs`, extra template variables (such as `enable_thinking`). `generation_prompt`
        and `continue_final`: the template's add_generation_prompt and continue_final_message (the chat
        endpoint's are true and false; /tokenize takes vLLM's fields)."""
        tools = {"tools": plan.tools} if plan is not None and plan.tools is not None else {}
        extra = check_template_kwargs(template_kwargs)
        if continue_final:
            extra["continue_final_message"] = True
        turns = (harmony_conversation(messages) if self.harmony_drop_ids is not None
                 else with_reasoning(conversation(messages, self.tools.format), messages))
        try:
            text = self.tokenizer.apply_chat_template(
                turns, chat_template=self.chat_template,
                add_generation_prompt=generation_prompt, tokenize=False, **extra, **tools,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            # the template's own raise_exception, or its expressions failing on these messages (a string
            # added to a number, a missing key): the request's messages, so a 400 (as vLLM); logged whole
            log.info("the chat template failed on a request's messages", exc_info=True)
            raise invalid_request(f"The chat template failed on the messages: {type(exc).__name__}: {exc}",
                                  "messages") from None
        return text

    @property
    def reasoning(self) -> bool:
        """Whether a chat reply's reasoning block is read apart (the template names a tag pair, not harmony)."""
        return self.think_tags is not None

    def reasoning_opening(self, request: SamplingRequest, prompt_ids: list[int]) -> Opening | None:
        """How a chat reply's `<think>` block may begin (server/reasoning.py): inside it when the generation
        prompt opened `<think>` itself, off when the prompt closed an empty block or the request sent
        `enable_thinking: false`; None: the reply's reasoning is not read apart (all of it is content)."""
        if self.think_tags is None or not isinstance(request, ChatCompletionRequest):
            return None
        thinking = (self.template_variables(request) or {}).get("enable_thinking") is not False
        return prompt_reasoning(self.tokenizer.decode(prompt_ids[-REASONING_TAIL:]), thinking, self.think_tags)

    def text_drop_ids(self, plan: ToolPlan | HarmonyPlan | None, reads_reasoning: bool) -> frozenset[int] | None:
        """The ids a reply's decoded text leaves out (server/detok.py; None: every special token): the tool
        plan's, and where a reply's <think> block is read apart and its tags are special tokens, every
        special id but the tags' (else the block would reach the reader without them)."""
        drop = None if plan is None else plan.drop_ids
        if not reads_reasoning or not self.special_think_ids:
            return drop
        return (self._special_ids if drop is None else drop) - self.special_think_ids

    def template_variables(self, request: ChatCompletionRequest) -> dict[str, Any] | None:
        """The chat template's extra variables for `request`: the server's --chat-template-kwargs, then
        the request's own (`template_variables` below), which win."""
        return {**self.default_template_kwargs, **(template_variables(request) or {})} or None

    def prompt_ids(self, request: SamplingRequest, plan: ToolPlan | HarmonyPlan | None = None) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            return self.chat_ids(request.messages, plan, self.template_variables(request))
        assert isinstance(request, CompletionRequest)
        return self.completion_ids(request)

    def chat_ids(self, messages: list[ChatMessage], plan: ToolPlan | HarmonyPlan | None = None,
                 template_kwargs: dict[str, Any] | None = None, *, generation_prompt: bool = True,
                 continue_final: bool = False, add_special_tokens: bool = False, fit: bool = True) -> list[int]:
        """The chat prompt's ids (`render_chat`'s options); `fit`: a prompt that fills the context is refused
        as soon as its length is known (/tokenize counts it instead)."""
        self.check_num_chars(chat_chars(messages, plan), "messages")  # before the template renders it all
        text = self.render_chat(messages, plan, template_kwargs, generation_prompt=generation_prompt,
                                continue_final=continue_final)
        self.check_chars(text, "messages")
        # the template spells out special tokens (BOS etc.) itself
        return self.encode(text, add_special_tokens, "messages", fit=fit)

    def completion_ids(self, request: CompletionRequest) -> list[int]:
        value = request.prompt
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if self.is_fim(request):
            return self.fim_ids(value, request.suffix or "")
        if isinstance(value, str):
            self.check_chars(value, "prompt")
            return self.encode(value, True, "prompt")
        check_token_ids(value, self.vocab_size, "prompt")
        return list(value)

    def encode(self, text: str, add_special_tokens: bool, param: str, *, fit: bool = True) -> list[int]:
        """`tokenizer.encode(text)`; with a fast tokenizer (no truncation or padding set), its Rust
        tokenizer is called directly: it lets go of the interpreter lock while it encodes, and with `fit` a
        prompt longer than the context is refused before its ids are made into a Python list (which holds
        the lock: 0.2 s for 1.5M tokens)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if fit and len(encoding) >= self.max_context:
            raise self.fills_context(len(encoding), param)
        return encoding.ids

    def is_fim(self, request: SamplingRequest) -> bool:
        """A completion with `suffix` is fill-in-the-middle; an empty suffix on a model without FIM
        tokens is a plain completion, a non-empty one a 400 naming `suffix`."""
        if not isinstance(request, CompletionRequest) or request.suffix is None:
            return False
        if self.fim is None and request.suffix:
            raise unsupported("suffix", "This model has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                              "<fim_prefix> or <PRE>), so 'suffix' is not supported.")
        return self.fim is not None

    def fim_ids(self, prompt: str | list[int], suffix: str) -> list[int]:
        if not isinstance(prompt, str):
            raise invalid_request("'suffix' needs the prompt as text, not token ids.", "suffix")
        self.check_chars(prompt + suffix, "prompt")
        assert self.fim is not None
        return self.fim.prompt_ids(prompt, suffix)

    def prediction_ids(self, text: str) -> list[int] | None:
        """A predicted output's tokens (chat's `prediction`), None when empty; text longer than the context
        could hold is a 400 before tokenizing."""
        self.check_num_chars(len(text), "prediction")
        return self.tokenizer.encode(text, add_special_tokens=False) or None

    def stop_ids(self, request: SamplingRequest) -> tuple[int, ...]:
        """Token ids that end this request beyond EOS and `stop_token_ids` (FIM end markers)."""
        return self.fim.stop_ids if self.fim is not None and self.is_fim(request) else ()

    def check_chars(self, text: str, param: str) -> None:
        """A 400 context_length_exceeded for text too long to fit the context, without tokenizing it."""
        self.check_num_chars(len(text), param)

    def check_num_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise invalid_request(
                f"This model's maximum context length is {self.max_context} tokens, and the prompt has "
                f"{num_chars} characters: more than {self.max_prompt_chars} characters cannot fit into it.",
                param, "context_length_exceeded")

    def fills_context(self, prompt_len: int, param: str) -> APIError:
        return invalid_request(
            f"This model's maximum context length is {self.max_context} tokens, and the prompt alone has "
            f"{prompt_len} tokens, which leaves no room for the completion. Please shorten the prompt.",
            param, "context_length_exceeded")

    def max_tokens(self, request: SamplingRequest, prompt_len: int) -> int:
        """The completion budget: the requested one (or the default), cut to the room the prompt leaves
        in the context, as llama.cpp's server and Ollama do (the reply then ends with finish_reason
        "length" when the context is full). A prompt that leaves no room is a 400 context_length_exceeded."""
        requested, param = request.requested_max_tokens(), request.prompt_param
        if prompt_len == 0:
            raise invalid_request("The prompt is empty after tokenization.", param)
        if prompt_len >= self.max_context:
            raise self.fills_context(prompt_len, param)
        budget = min(self.default_max_tokens if requested is None else requested, self.max_context - prompt_len)
        try:
            self._validate(prompt_len, budget)
        except ContextLengthError as exc:
            raise context_length_error(exc, param) from None
        return budget


def chat_chars(messages: list[ChatMessage], plan: ToolPlan | HarmonyPlan | None) -> int:
    """The characters a chat request brings to its prompt: contents, names, past tool calls and their
    ids, and the tool definitions rendered (as JSON); the template adds its own text around them."""
    total = 0
    for message in messages:
        total += len(message_text(message)) + len(message.name or "") + len(message.tool_call_id or "")
        total += len(message.reasoning_content or "")
        for call in message.tool_calls or ():
            arguments = call.function.arguments
            total += len(call.id or "") + len(call.function.name)
            total += len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments))
    return total + (len(json.dumps(plan.tools)) if plan is not None and plan.tools is not None else 0)


def with_reasoning(entries: list[dict[str, Any]], messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The template's messages with each assistant message's `reasoning_content` (a past turn's reasoning:
    Qwen3's and GLM's templates render it where they keep reasoning; others ignore the key)."""
    for entry, message in zip(entries, messages, strict=True):
        if message.reasoning_content:
            entry["reasoning_content"] = message.reasoning_content
    return entries


def longest_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry (added tokens included), in characters."""
    return max(map(len, tokenizer.get_vocab()), default=1)


REASONING_TAIL = 16  # prompt tokens decoded to see whether the generation prompt opened <think>


def template_variables(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """A chat request's extra template variables: `chat_template_kwargs`, and `reasoning_effort` (GPT-OSS's
    template reads it; chat_template_kwargs' own wins)."""
    kwargs = request.chat_template_kwargs
    if request.reasoning_effort is not None:
        kwargs = {"reasoning_effort": request.reasoning_effort} | (kwargs or {})
    return kwargs


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs` (vLLM / llama.cpp), passed to the template; a 400 for a name
    the server sets itself."""
    if not kwargs:
        return {}
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
        raise invalid_request(f"Invalid 'chat_template_kwargs': {', '.join(reserved)} cannot be set.",
                              "chat_template_kwargs", "invalid_value")
    return dict(kwargs)
