"""Claude Code (`claude -p`) against a scripted server over the Anthropic Messages API, with a stdio MCP
server of its own: the model's `tool_use` of `mcp__weather__get_forecast` is run by Claude Code on the MCP
server, its `tool_result` comes back in the next request, and the model's answer is the turn's result (the
whole tool loop of the Anthropic surface with the real client; tests/helpers/agent_turns.py). Also its Read
of a PDF, whose tool_result holds a document block (server/tool_files.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.tool_files import FILE_NOTE
from tests.helpers.agent_turns import CLAUDE, MCP_SERVER, TOOL_OUTPUT, turn_engine
from tests.helpers.tool_models import HERMES_TEMPLATE, last_prompt

CALL = '<tool_call>\n{"name": "mcp__weather__get_forecast", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'


def run_claude(srv, tmp_path: Path, prompt: str, *args: str, files: dict[str, bytes] | None = None) -> dict:
    """`claude -p prompt args` in a fresh home against `srv` (its work folder holding `files`): its final JSON."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    for name, data in (files or {}).items():
        (work / name).write_bytes(data)
    env = {"PATH": str(Path(shutil.which("node") or "node").parent) + ":/usr/bin:/bin", "HOME": str(home),
           "LANG": "C.UTF-8", "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": "fake-model", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "fake-model", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    result = subprocess.run(["node", str(CLAUDE), "-p", prompt, "--output-format", "json", *args],
                            env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None or not CLAUDE.is_file(),
                    reason="Claude Code is not installed: npm ci --prefix tests/clients/claude_code")
def test_claude_code_runs_an_mcp_tool_the_model_calls(fake_server, tmp_path: Path) -> None:
    srv = fake_server(turn_engine(HERMES_TEMPLATE, CALL, "It is sunny.<|end|>"))
    (tmp_path / "mcp_server.py").write_text(MCP_SERVER)
    mcp = {"mcpServers": {"weather": {"command": sys.executable, "args": [str(tmp_path / "mcp_server.py")]}}}
    final = run_claude(srv, tmp_path, "Weather in Paris?", "--mcp-config", json.dumps(mcp), "--strict-mcp-config",
                       "--allowedTools", "mcp__weather__get_forecast")
    assert final["subtype"] == "success" and final["result"] == "It is sunny.", final
    assert final["num_turns"] == 2, final  # the call, then the answer
    assert TOOL_OUTPUT in last_prompt(srv)  # the MCP server's answer, in the second request's prompt


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF showing `text` (valid xref offsets: readers that check them accept it)."""
    stream = f"BT /F1 24 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None or not CLAUDE.is_file(),
                    reason="Claude Code is not installed: npm ci --prefix tests/clients/claude_code")
def test_claude_code_reads_a_pdf_the_model_asks_for(fake_server, tmp_path: Path) -> None:
    """Claude Code's Read of a PDF sends the file back as a document block in the tool_result (a 400 before
    server/tool_files.py, which ended the turn): now a note in the prompt, and the model's answer ends the turn."""
    call = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "%s"}}\n</tool_call><|end|>'
    srv = fake_server(turn_engine(HERMES_TEMPLATE, call % (tmp_path / "work" / "report.pdf"), "It is a report.<|end|>",
                                  done_marker="<tool_response>"))
    final = run_claude(srv, tmp_path, "What is report.pdf?", "--allowedTools", "Read",
                       files={"report.pdf": minimal_pdf("Quarterly report")})
    assert final["subtype"] == "success" and final["result"] == "It is a report.", final
    assert final["num_turns"] == 2, final  # the Read, then the answer
    tool_part = last_prompt(srv)[last_prompt(srv).index("<tool_response>"):]
    assert "PDF file read" in tool_part and FILE_NOTE.format(name="unnamed", kind="PDF") in tool_part
