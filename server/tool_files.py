"""Documents and files in a tool's output: their text where they carry text, else a short note.

Agents hand files back as tool output: Claude Code's Read of a PDF (an Anthropic `tool_result` holding a
`document` block, its source base64 PDF data), MCP tools that return text resources (a `document` whose
source is `text` or `content`), Codex's tools returning an `input_file` part in a Responses
`function_call_output`. Those were 400s that ended the agent's turn. Now a document or file whose source is
text becomes that text (its title or file name first), and one this server cannot read (a PDF, any binary
data, a URL or file id it would have to fetch) becomes FILE_NOTE naming it, so the loop goes on and the model
knows a file was there. Outside tool output, only text sources are taken (a question about an unreadable
PDF would be answered from nothing: that stays a 400).
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from typing import Any

FILE_NOTE = "[file omitted: {name}: this server reads no {kind} files]"


def note(name: str | None, media_type: str) -> str:
    """FILE_NOTE naming the file and its kind (a media type; application/pdf as PDF)."""
    return FILE_NOTE.format(name=name or "unnamed", kind="PDF" if media_type == "application/pdf" else media_type)


def titled(title: Any, text: str) -> str:
    return f"{title}\n{text}" if isinstance(title, str) and title else text


def anthropic_document_text(block: dict[str, Any]) -> str | None:
    """An Anthropic `document` block's text (its `title` first) where its source is text (`text`, `content`
    with text blocks, or base64 data of a text/* media type); None where it is not (PDF, URL, file id)."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        return titled(block.get("title"), source["data"])
    if kind == "content":
        content = source.get("content")
        if isinstance(content, str):
            return titled(block.get("title"), content)
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return titled(block.get("title"), "\n".join(str(p.get("text", "")) for p in content))
        return None
    if kind == "base64" and str(source.get("media_type", "")).startswith("text/"):
        return _decoded(source.get("data"), block.get("title"))
    return None


def anthropic_document_note(block: dict[str, Any]) -> str:
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    return note(block.get("title"), str(source.get("media_type") or source.get("type") or "such"))


def responses_file_text(part: dict[str, Any]) -> str:
    """A Responses `input_file` part in a tool's output: its text where `file_data` is a data URL (or bare
    base64) of text, else FILE_NOTE naming the file."""
    name = part.get("filename")
    data = part.get("file_data")
    if isinstance(data, str):
        media, _, payload = data.partition(",") if data.startswith("data:") else ("", "", data)
        if media.startswith("data:text/") and not media.endswith(";base64"):  # a percent-encoded data URL
            return titled(name, urllib.parse.unquote(payload))
        if media.startswith("data:text/") or (not media and (name or "").endswith((".txt", ".md", ".csv", ".json"))):
            text = _decoded(payload, name)
            if text is not None:
                return text
        return note(name, media[5:].split(";")[0] if media else "such")
    return note(name or part.get("file_id") or part.get("file_url"), "fetched")


def _decoded(data: Any, title: Any) -> str | None:
    if not isinstance(data, str):
        return None
    try:
        return titled(title, base64.b64decode(data, validate=True).decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None

