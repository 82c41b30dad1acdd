"""Images in a tool's output (server/tool_images.py) for a text-only model: Codex's view_image (a Responses
function_call_output with an input_image), a chat `tool` message with an image_url part, Claude Code's
Read of an image (an Anthropic tool_result with an image block), an Ollama `tool` message with images.
Each is a 200 whose prompt has the tool output's text and a note where the image was, and one log line
per request; an image in a user message stays a 400. No served model takes images (the engine never
loads a vision tower: engine/multimodal.py), so there is no image-taking case to test."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from server.tool_images import IMAGE_NOTE
from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, last_prompt, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as oai

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
       "AAAABJRU5ErkJggg==")  # a 1x1 PNG
DATA = PNG.split(",", 1)[1]
VIEW_IMAGE = {"type": "function", "name": "view_image", "description": "Look at an image file.",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CALL_ARGS = '{"path": "shot.png"}'


def serve(fake_server: Callable) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), "I see it.<|end|>", 3))


def check_prompt(srv: Any, *texts: str, num_notes: int = 1) -> None:
    prompt = last_prompt(srv)
    tool_part = prompt[prompt.index("<tool_response>"):]
    assert tool_part.count(IMAGE_NOTE) == num_notes and DATA not in prompt
    for text in texts:
        assert text in tool_part


def responses_input(output: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "What does shot.png show?"},
            {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": CALL_ARGS},
            {"type": "function_call_output", "call_id": "call_1", "output": output}]


def test_responses_function_call_output_with_an_image(fake_server) -> None:
    srv = serve(fake_server)
    output = [{"type": "input_text", "text": "Viewed shot.png:"},
              {"type": "input_image", "image_url": PNG, "detail": "auto"}]
    response = oai(srv).responses.create(model="fake-model", input=responses_input(output), tools=[VIEW_IMAGE])
    assert response.status == "completed" and response.output_text == "I see it."
    check_prompt(srv, "Viewed shot.png:\n" + IMAGE_NOTE)
    events = list(oai(srv).responses.create(model="fake-model", input=responses_input(output[1:] * 2),
                                            tools=[VIEW_IMAGE], stream=True))
    assert events[-1].type == "response.completed"
    check_prompt(srv, f"{IMAGE_NOTE}\n{IMAGE_NOTE}", num_notes=2)


def test_responses_text_only_output_is_as_before(fake_server) -> None:
    srv = serve(fake_server)
    output = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    oai(srv).responses.create(model="fake-model", input=responses_input(output), tools=[VIEW_IMAGE])
    check_prompt(srv, "<tool_response>\nab\n</tool_response>", num_notes=0)


def chat_messages(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": content}]


def test_chat_tool_message_with_an_image_url_part(fake_server, caplog) -> None:
    srv = serve(fake_server)
    content = [{"type": "text", "text": "The radar map:"}, {"type": "image_url", "image_url": {"url": PNG}},
               {"type": "image_url", "image_url": {"url": PNG}}]
    with caplog.at_level(logging.INFO, logger="specexec.server"):
        reply = oai(srv).chat.completions.create(model="fake-model", messages=chat_messages(content), tools=TOOLS)
    assert reply.choices[0].message.content == "I see it."
    check_prompt(srv, f"The radar map:\n{IMAGE_NOTE}\n{IMAGE_NOTE}", num_notes=2)
    logged = [r.getMessage() for r in caplog.records if "image(s) in tool output" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("2 image(s)")


def test_an_image_in_a_user_message_is_still_a_400(fake_server) -> None:
    srv = serve(fake_server)
    image = [{"type": "image_url", "image_url": {"url": PNG}}]
    with pytest.raises(openai.BadRequestError) as caught:
        oai(srv).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": image}])
    assert caught.value.body["param"] == "messages[0].content[0]"
    response = httpx.post(srv.url + "/v1/responses", json={"input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[0].content[0]"


def test_anthropic_tool_result_with_an_image_block(fake_server) -> None:
    srv = serve(fake_server)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": DATA}}
    messages = [{"role": "user", "content": "Read shot.png"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                                   "input": {"file_path": "shot.png"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "shot.png (1x1)"}, image]}]}]
    tools = [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
    message = client.messages.create(model="fake-model", max_tokens=50, messages=messages, tools=tools)
    assert message.content[0].text == "I see it." and message.stop_reason == "end_turn"
    check_prompt(srv, f"shot.png (1x1)\n{IMAGE_NOTE}")
    with pytest.raises(anthropic.BadRequestError):  # a user's own image: a 400, as before
        client.messages.create(model="fake-model", max_tokens=50, messages=[{"role": "user", "content": [image]}])


def test_ollama_tool_message_with_images(fake_server) -> None:
    srv = serve(fake_server)
    messages = chat_messages("The radar map:")
    messages[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {}}}]}
    messages[2] |= {"images": [DATA]}
    reply = ollama.Client(host=srv.url).chat(model="fake-model", messages=messages, tools=TOOLS)
    assert reply.message.content == "I see it."
    check_prompt(srv, f"The radar map:\n{IMAGE_NOTE}")
