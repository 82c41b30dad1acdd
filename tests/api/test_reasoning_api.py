"""Reasoning kept apart from the answer (server/reasoning.py): a scripted engine writes
`<think>a b</think>answer` through a template with think tags; the openai, anthropic and ollama SDKs
see the reasoning in its own field, whole and streamed; --reasoning-format none and a template
without the tags leave it all content; tool calls after the reasoning are still read."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import ollama
import openai
import pytest

from server.reasoning import ReasoningSplitter
from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as oai

# Hermes-style template whose generation prompt closes an empty block when enable_thinking is false
# (as Qwen3's does), so it names both tags
THINK_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "{%- if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# the generation prompt opens <think> itself (SmolLM3 / GLM style)
OPENED_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "{%- if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}{# </think> #}")
SCRIPT = "<think>a b</think>answer<|end|>"
MESSAGES = [{"role": "user", "content": "hi"}]


def serve(fake_server: Callable, script: str = SCRIPT, template: str = THINK_TEMPLATE, **fields: Any) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(template), script), **fields)


def chat_both(srv: Any, **kwargs: Any) -> tuple[Any, str | None, str]:
    """The whole message, and the streamed (reasoning, content) joined."""
    client = oai(srv)
    message = client.chat.completions.create(model="fake-model", messages=MESSAGES, **kwargs).choices[0].message
    reasoning: list[str] = []
    content: list[str] = []
    saw = False
    for chunk in client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content") is not None:
                saw = True
                reasoning.append(extra["reasoning_content"])
            if choice.delta.content:
                content.append(choice.delta.content)
    return message, ("".join(reasoning) if saw else None), "".join(content)


def test_openai_reasoning_content_whole_and_streamed(fake_server) -> None:
    message, reasoning, content = chat_both(serve(fake_server))
    assert message.content == "answer"
    assert (message.model_extra or {}).get("reasoning_content") == "a b"
    assert (reasoning, content) == ("a b", "answer")


def test_prompt_that_opens_think_starts_inside_reasoning(fake_server) -> None:
    message, reasoning, content = chat_both(serve(fake_server, "a b</think>\n\nanswer<|end|>", OPENED_TEMPLATE))
    assert (message.content, (message.model_extra or {}).get("reasoning_content")) == ("answer", "a b")
    assert (reasoning, content) == ("a b", "answer")


def test_chat_template_kwargs_reach_the_template(fake_server) -> None:
    srv = serve(fake_server, "answer<|end|>")
    message, reasoning, content = chat_both(srv, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert message.content == "answer" and "reasoning_content" not in (message.model_extra or {})
    assert (reasoning, content) == (None, "answer")


def test_reserved_chat_template_kwargs_are_a_400(fake_server) -> None:
    with pytest.raises(openai.BadRequestError):
        oai(serve(fake_server)).chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


@pytest.mark.parametrize("template,fields", [(THINK_TEMPLATE, {"reasoning_format": "none"}), (HERMES_TEMPLATE, {})],
                         ids=["flag-none", "template-without-tags"])
def test_none_and_template_without_tags_leave_all_content(fake_server, template: str, fields: dict) -> None:
    message, reasoning, content = chat_both(serve(fake_server, template=template, **fields))
    assert message.content == "<think>a b</think>answer"
    assert "reasoning_content" not in (message.model_extra or {})
    assert (reasoning, content) == (None, "<think>a b</think>answer")


def test_completions_unchanged(fake_server) -> None:
    text = oai(serve(fake_server)).completions.create(model="fake-model", prompt="x").choices[0].text
    assert text == "<think>a b</think>answer"


def test_tool_calls_after_reasoning_are_read(fake_server) -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    srv = serve(fake_server, f"<think>I should call.</think>\n<tool_call>\n{call}\n</tool_call><|end|>")
    client = oai(srv)
    choice = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=300).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.model_extra or {}).get("reasoning_content") == "I should call."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    args, reasoning = [], []
    for chunk in client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                                  stream=True):
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            assert not c.delta.content
            args += [t.function.arguments or "" for t in c.delta.tool_calls or []]
    assert "".join(reasoning) == "I should call."
    assert json.loads("".join(args)) == {"city": "Paris"}


def test_anthropic_thinking_block_whole_and_streamed(fake_server) -> None:
    srv = serve(fake_server)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    kwargs: dict[str, Any] = {"model": "fake-model", "max_tokens": 64, "messages": MESSAGES}
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[0].signature, message.content[1].text) == ("a b", "", "answer")
    with client.messages.stream(**kwargs) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == ("a b", "answer")
    assert ("content_block_delta", "thinking_delta") in kinds
    assert kinds.index(("content_block_delta", "thinking_delta")) < kinds.index(("content_block_delta", "text_delta"))


def test_ollama_message_thinking_whole_and_streamed(fake_server) -> None:
    client = ollama.Client(host=serve(fake_server).url, timeout=60)
    reply = client.chat(model="fake-model", messages=MESSAGES, stream=False)
    assert (reply.message.thinking, reply.message.content) == ("a b", "answer")
    parts = list(client.chat(model="fake-model", messages=MESSAGES, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "a b"
    assert "".join(p.message.content or "" for p in parts) == "answer"


TEXT = "\n<think>\nr1 <b> r2\n</think>\n\nthe answer </think> <think>"


@pytest.mark.parametrize("inside", [False, True])
def test_splitter_every_split_position(inside: bool) -> None:
    text = TEXT.split("<think>", 1)[1] if inside else TEXT
    whole = ReasoningSplitter(inside=inside).split(text)
    assert whole == ("r1 <b> r2", "the answer </think> <think>")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            splitter = ReasoningSplitter(inside=inside)
            parts = [p for piece in (text[:i], text[i:j], text[j:]) for p in splitter.feed(piece)] + splitter.finish()
            got = ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))
            assert got == whole, (i, j)


@pytest.mark.parametrize("text,expected", [
    ("plain <think>x</think>", (None, "plain <think>x</think>")),
    ("  <thi", (None, "  <thi")),
    ("<think>cut off mid </th", ("cut off mid </th", "")),
    ("", (None, "")),
])
def test_splitter_edges(text: str, expected: tuple) -> None:
    assert ReasoningSplitter().split(text) == expected


def test_think_tags_that_are_special_tokens_are_read_too(fake_server) -> None:
    """A tokenizer that marks <think> and </think> special (decoding skips special tokens): the tags stay
    in the text the reader gets, so the block is reasoning, not run into the answer ("a banswer")."""
    tokenizer = tool_tokenizer(THINK_TEMPLATE, ("<think>", "</think>"))
    srv = fake_server(scripted_engine(tokenizer, SCRIPT))
    message, reasoning, content = chat_both(srv)
    assert (message.content, (message.model_extra or {}).get("reasoning_content")) == ("answer", "a b")
    assert (reasoning, content) == ("a b", "answer")


# Magistral / Ministral 3 Reasoning: Mistral's [THINK] special tokens, named by the template
MISTRAL_THINK_TEMPLATE = THINK_TEMPLATE.replace("<think>", "[THINK]").replace("</think>", "[/THINK]")


def test_mistral_think_tags_are_read_apart_and_structured_output_follows_them(fake_server) -> None:
    tokenizer = tool_tokenizer(MISTRAL_THINK_TEMPLATE, ("[THINK]", "[/THINK]"))
    srv = fake_server(scripted_engine(tokenizer, '[THINK]a b[/THINK]{"x": 1}<|end|>'))
    message, reasoning, content = chat_both(srv)
    assert (message.content, (message.model_extra or {}).get("reasoning_content")) == ('{"x": 1}', "a b")
    assert (reasoning, content) == ("a b", '{"x": 1}')
    oai(srv).chat.completions.create(model="fake-model", messages=MESSAGES, response_format={"type": "json_object"})
    block = srv.engine.requests[-1].params.structured_output.reasoning
    assert (block.open, block.close, block.opened) == ("[THINK]", "[/THINK]", False)
