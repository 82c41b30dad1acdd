"""Documents and files in a tool's output (server/tool_files.py): Claude Code's Read of a PDF (an Anthropic
tool_result with a base64 PDF document block), an MCP text resource (a document with a text source), Codex's
tools returning an input_file part (a Responses function_call_output). Each is a 200 whose prompt has the
file's text where it is text, else a note naming the file; a user's own PDF stays a 400, a user's text
document is its text."""

from __future__ import annotations

import base64
from typing import Any

import anthropic
import pytest

from server.tool_files import FILE_NOTE
from tests.helpers.tool_models import HERMES_TEMPLATE, last_prompt, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as oai

PDF = base64.b64encode(b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF").decode()
NOTES = "notes.txt"
TEXT = "line one\nline two"
READ = [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]


def serve(fake_server) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), "Read it.<|end|>", 3))


def tool_part(srv: Any) -> str:
    prompt = last_prompt(srv)
    return prompt[prompt.index("<tool_response>"):]


def anthropic_turns(result_content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Read report.pdf"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                               "input": {"file_path": "report.pdf"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}]}]


def client(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def test_anthropic_tool_result_with_a_pdf_document_is_a_note(fake_server) -> None:
    srv = serve(fake_server)
    pdf = {"type": "document", "title": "report.pdf",
           "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}}
    message = client(srv).messages.create(model="fake-model", max_tokens=50, tools=READ,
                                          messages=anthropic_turns([{"type": "text", "text": "PDF file read"}, pdf]))
    assert message.content[0].text == "Read it."
    part = tool_part(srv)
    assert "PDF file read" in part and FILE_NOTE.format(name="report.pdf", kind="PDF") in part and PDF not in part
    with pytest.raises(anthropic.BadRequestError, match="text sources only"):  # a user's own PDF: a 400
        client(srv).messages.create(model="fake-model", max_tokens=50, messages=[{"role": "user", "content": [pdf]}])


@pytest.mark.parametrize("source", [
    {"type": "text", "media_type": "text/plain", "data": TEXT},
    {"type": "content", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]},
    {"type": "base64", "media_type": "text/plain", "data": base64.b64encode(TEXT.encode()).decode()},
])
def test_anthropic_text_documents_are_their_text(fake_server, source) -> None:
    srv = serve(fake_server)
    document = {"type": "document", "title": NOTES, "source": source}
    client(srv).messages.create(model="fake-model", max_tokens=50, tools=READ, messages=anthropic_turns([document]))
    assert f"{NOTES}\n{TEXT}" in tool_part(srv)
    client(srv).messages.create(model="fake-model", max_tokens=50, messages=[
        {"role": "user", "content": [document, {"type": "text", "text": "Summarise it."}]}])
    assert f"{NOTES}\n{TEXT}" in last_prompt(srv)  # a user's text document too


def responses_input(output: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "What is in the files?"},
            {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": output}]


def test_responses_input_file_in_a_tool_output(fake_server) -> None:
    srv = serve(fake_server)
    output = [{"type": "input_text", "text": "Two files:\n"},
              {"type": "input_file", "filename": NOTES,
               "file_data": "data:text/plain;base64," + base64.b64encode(TEXT.encode()).decode()},
              {"type": "input_file", "filename": "report.pdf", "file_data": "data:application/pdf;base64," + PDF},
              {"type": "input_file", "filename": "a.txt", "file_data": "data:text/plain,fifty%20fifty"}]
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
    response = oai(srv).responses.create(model="fake-model", input=responses_input(output), tools=tools)
    assert response.status == "completed" and response.output_text == "Read it."
    part = tool_part(srv)
    assert f"Two files:\n{NOTES}\n{TEXT}" in part and FILE_NOTE.format(name="report.pdf", kind="PDF") in part
    assert PDF not in part and "a.txt\nfifty fifty" in part
