"""What the served model can do with tools, decided once from its chat template and tokenizer.

A template renders tools when rendering a probe tool puts the tool's name into the prompt
(a template that never reads `tools` cannot). The tool-call format is recognised from the
template's text (the markers it prints for past calls or in its instructions), else from the
tokenizer's added tokens; `--tool-parser` names it instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from server.toolcalls.parsers import FORMATS, ToolFormat

log = logging.getLogger("specexec.server")

PROBE_NAME = "specexec_probe_tool"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "Probe whether the chat template renders tools.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
# (format, texts that must all be in the template), in order: the first match wins
TEMPLATE_SIGNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter=")),  # Qwen3-Coder / Qwen3.5: XML in <tool_call>
    ("glm45", ("<tool_call>", "<arg_key>", "<arg_value>")),  # GLM-4.5 / 4.6 / 4.7: <arg_key>/<arg_value> pairs
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("mistral", ("[AVAILABLE_TOOLS]",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ("<|start_header_id|>", '"parameters": ')),  # Llama 3.2's JSON tool calls
)
VOCAB_SIGNS = (("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"), ("llama3_json", "<|python_tag|>"))


@dataclass(frozen=True)
class ToolSupport:
    format: ToolFormat | None  # None: tools are not rendered; tool_choice auto / none serve plain text
    reason: str  # why `format` is None (named by the 400 of tool_choice required / a named function)
    drop_ids: frozenset[int] | None  # detokenizing calls: special ids to drop (the format's markers kept)
    grammar_tokens: tuple[str, ...] = ()  # the format's markers that are special tokens (the grammar writes them)
    named_args: bool = False  # mistral: the tokenizer has [ARGS], so calls are `[TOOL_CALLS]f[ARGS]{...}`

    @classmethod
    def detect(cls, tokenizer: Any, chat_template: Any, tool_parser: str) -> ToolSupport:
        if tool_parser == "none":
            return cls.off("tool calling is turned off (--tool-parser none)")
        source = template_source(chat_template)
        failure = probe_tools(tokenizer, chat_template)
        if failure is not None:
            return cls.off(f"the model's chat template does not render tools ({failure})")
        name = detect_format(source, tokenizer) if tool_parser == "auto" else tool_parser
        if name is None:
            return cls.off("no tool-call format was recognised in the model's chat template; "
                           "start the server with --tool-parser hermes, qwen3_coder, glm45, llama3_json or mistral")
        fmt = FORMATS[name]
        return cls(fmt, "", marker_drop_ids(tokenizer, fmt), special_markers(tokenizer, fmt),
                   fmt.name == "mistral" and "[ARGS]" in tokenizer.get_added_vocab())

    @classmethod
    def off(cls, reason: str) -> ToolSupport:
        return cls(None, reason, None)

    def describe(self) -> str:
        return f"tool calls in the {self.format.name} format" if self.format else f"no tool calls: {self.reason}"


def template_source(chat_template: Any) -> str:
    """The template text (all of a named-templates dict)."""
    if isinstance(chat_template, dict):
        return "\n".join(str(v) for v in chat_template.values())
    return chat_template or ""


def probe_tools(tokenizer: Any, chat_template: Any) -> str | None:
    """None when the template renders a probe tool; else why not."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not chat_template or "tools" not in chat_template:
        return "it never reads `tools`"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tools=[PROBE_TOOL],
                                             chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # any template failure means: this template cannot render tools
        log.info("the chat template failed to render a probe tool: %s: %s", type(exc).__name__, exc)
        return f"rendering a tool failed: {exc}"
    return None if PROBE_NAME in text else "a tool given to it does not appear in the prompt"


def detect_format(source: str, tokenizer: Any) -> str | None:
    for name, signs in TEMPLATE_SIGNS:
        if all(sign in source for sign in signs):
            return name
    added = tokenizer.get_added_vocab()
    for name, token in VOCAB_SIGNS:
        if token in added:
            return name
    return None


def special_ids(tokenizer: Any) -> set[int]:
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} | set(tokenizer.all_special_ids)


def marker_drop_ids(tokenizer: Any, fmt: ToolFormat) -> frozenset[int] | None:
    """When a marker of `fmt` is a special token (which decoding would skip): the special ids to
    drop instead, every one but the markers. None when plain decoding keeps the markers."""
    special = special_ids(tokenizer)
    added = tokenizer.get_added_vocab()
    markers = {added[token] for token in fmt.special_tokens if token in added}
    if not markers & special:
        return None
    return frozenset(special - markers)


def special_markers(tokenizer: Any, fmt: ToolFormat) -> tuple[str, ...]:
    """The markers the call grammar of `fmt` writes that are special tokens of the tokenizer, by text."""
    special = special_ids(tokenizer)
    added = tokenizer.get_added_vocab()
    return tuple(token for token in fmt.grammar_markers if added.get(token) in special)
